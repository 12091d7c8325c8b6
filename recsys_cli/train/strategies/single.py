"""SingleProcess: one process trains alone; every hook is the identity."""

from __future__ import annotations

from recsys_cli.embeddings.prefetch import Prefetcher, take
from recsys_cli.train.strategies.base import Strategy


class SingleProcess(Strategy):
    def batches(self, loader, limit, start, pause_at):
        return Prefetcher(take(loader, limit), self.lookahead_groups(), self.embeddings.release, start, pause_at)
