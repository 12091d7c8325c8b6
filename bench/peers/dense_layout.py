"""The exact fp32 dense speed-ups against the code they replaced (BENCHMARKS.md).

    .venv/bin/python -m bench.peers.dense_layout [--batch 128 2048] [--record]

dlrm_kaggle's dense half (bottom MLP, dot interaction, top MLP, BCE loss,
SGD step) two ways on the same inputs, alternating in chunks, one compute
thread: recsys's DLRM (index_select interaction, transposed backward for
unaligned widths, foreach SGD) and the same layers written as before
(nn.Linear, z[:, rows, cols], SGD's loop). Both compute the same values bit
for bit (tests/test_model_speed.py); this measures only the time, on the
compute thread's CPU time (the machine is shared).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from recsys_cli.model.dlrm import DLRM


class Before(nn.Module):
    """The dense half as it was written before: nn.Linear, advanced indexing."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        plain = lambda seq: nn.Sequential(*[nn.Linear(m.in_features, m.out_features) if isinstance(m, nn.Linear)  # noqa: E731
                                            else nn.ReLU() for m in seq])
        self.bottom, self.top = plain(model.bottom), plain(model.top)
        n = len(model.embeddings.features) + 1
        self.rows, self.cols = torch.tril_indices(n, n, offset=-1)
        self.load_state_dict(model.state_dict())

    def forward(self, dense, pooled):
        bottom = self.bottom(dense)
        t = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        return self.top(torch.cat([bottom, z[:, self.rows, self.cols]], dim=1)).squeeze(1)


def run(batch: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    emb = SimpleNamespace(features=[f"C{i}" for i in range(26)], dim=16)
    model = DLRM(13, emb, [512, 256, 64, 16], [512, 256, 1], "dot", "dlrm", seed=0)
    before = Before(copy.deepcopy(model))
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(batch, 13, generator=g), torch.randn(batch, 26, 16, generator=g) * 0.1,
               (torch.rand(batch, generator=g) < 0.25).float()) for _ in range(4)]
    systems = {"now": (model.dense_forward, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)),
               "before": (before, torch.optim.SGD(before.parameters(), lr=0.1))}
    ms = {k: [] for k in systems}
    load = [os.getloadavg()[0]]
    for r in range(rounds + 1):  # round 0 warms up
        for name, (forward, opt) in systems.items():
            start = time.thread_time()
            for i in range(steps):
                dense, pooled, labels = inputs[i % 4]
                loss = F.binary_cross_entropy_with_logits(forward(dense, pooled.requires_grad_()), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if r:
                ms[name].append((time.thread_time() - start) / steps * 1e3)
        load.append(os.getloadavg()[0])
    ratios = [b / n for n, b in zip(ms["now"], ms["before"])]
    return {"batch": batch, "ms/step now": statistics.median(ms["now"]),
            "ms/step before": statistics.median(ms["before"]),
            "before / now median (range)": f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
            "rounds x steps": f"{rounds} x {steps}", "load avg": f"{min(load):.1f}-{max(load):.1f}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    rows = []
    for batch in args.batch:
        rows.append(run(batch, args.rounds, max(2, 4096 // batch)))
        print(rows[-1], flush=True)
    if args.record:
        from bench.record import record

        record("Dense half: exact fp32 speed-ups vs the code they replaced (dlrm_kaggle, one compute thread)",
               list(rows[0]), rows, "python -m bench.peers.dense_layout --batch "
               + " ".join(map(str, args.batch)) + " --record",
               note=("Forward, backward and SGD step of dlrm_kaggle's dense half on the same inputs, alternating "
                     "in chunks: now (index_select interaction, transposed backward for unaligned widths, foreach "
                     "SGD) vs before (nn.Linear, advanced indexing, SGD's loop); bit-identical results "
                     "(tests/test_model_speed.py). ms/step on the compute thread's CPU time; the machine is "
                     "shared (load average column)."))


if __name__ == "__main__":
    main()
