"""Dense Adagrad update over DLRM-DCNv2's dense parameters (issue 41 item 4): torch.optim foreach vs DenseAdagrad's kernels.

    .venv/bin/python -m bench.dense_adagrad_bench [--rounds 5] [--steps 6]

The parameters of model=dlrm_v2 on 26 features (bottom MLP 13-512-256-128,
three rank-512 cross layers over the 3456-wide concatenation, top MLP
3456-1024-1024-512-256-1: 16.0M values), each step's gradients drawn afresh;
torch.optim.Adagrad(foreach=True) (the trainer's update before) and
train/dense_optim.DenseAdagrad's pieces (optimizer.dense_kernel=foreach) and
its fused kernel (optimizer.dense_kernel=fused) alternate in chunks of --steps
steps in one process, on the trainer's compute threads (torch's default
here), so the machine's load weighs on both alike. Prints ms per update of
each chunk, the median ratios, and checks that foreach and the pieces end
with equal parameters and sums (torch.equal; fused rounds otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recsys_cli.train import dense_optim
from recsys_cli.train.dense_optim import DenseAdagrad

BOTTOM, TOP, CROSS, RANK = [13, 512, 256, 128], [1024, 1024, 512, 256, 1], 3456, 512


def dlrm_v2_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for a, b in zip(BOTTOM, BOTTOM[1:]):
        shapes += [(b, a), (b,)]
    for _ in range(3):
        shapes += [(RANK, CROSS), (CROSS, RANK), (CROSS,)]
    widths = [CROSS, *TOP]
    for a, b in zip(widths, widths[1:]):
        shapes += [(b, a), (b,)]
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--piece", type=int, default=None, help="elements a piece (default: PIECE_ELEMENTS)")
    args = parser.parse_args()
    if args.piece:
        dense_optim.PIECE_ELEMENTS = args.piece
    g = torch.Generator().manual_seed(0)
    shapes = dlrm_v2_shapes()
    start = [torch.randn(s, generator=g) * 0.01 for s in shapes]
    kinds = ("foreach", "pieces", "fused")
    params = {kind: [torch.nn.Parameter(t.clone()) for t in start] for kind in kinds}
    opts = {"foreach": torch.optim.Adagrad(params["foreach"], lr=0.005, eps=1e-8, foreach=True),
            "pieces": DenseAdagrad(params["pieces"], lr=0.005, eps=1e-8, initial_accumulator_value=0.0),
            "fused": DenseAdagrad(params["fused"], lr=0.005, eps=1e-8, initial_accumulator_value=0.0, fused=True)}
    grads = torch.Generator().manual_seed(1)
    ms: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        chunk = [[torch.randn(s, generator=grads) * 0.01 for s in shapes] for _ in range(args.steps)]
        for kind in kinds:
            elapsed = 0.0
            for step_grads in chunk:
                for p, gr in zip(params[kind], step_grads):
                    p.grad = gr
                began = time.perf_counter()
                opts[kind].step()
                elapsed += time.perf_counter() - began
            ms[kind].append(1000 * elapsed / args.steps)
        print(", ".join(f"{kind} {ms[kind][-1]:.1f} ms" for kind in kinds) + " per update", flush=True)
    for a, b in zip(params["foreach"], params["pieces"]):
        assert torch.equal(a, b) and torch.equal(opts["foreach"].state[a]["sum"], opts["pieces"].state[b]["sum"])
    ratio = {kind: statistics.median(a / b for a, b in zip(ms["foreach"], ms[kind])) for kind in kinds[1:]}
    print(f"{sum(s and torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters, {torch.get_num_threads()} "
          f"threads: median " + ", ".join(f"{kind} {statistics.median(ms[kind]):.1f} ms" for kind in kinds)
          + f"; foreach / pieces {ratio['pieces']:.2f}x, foreach / fused {ratio['fused']:.2f}x; foreach and pieces "
          "equal")


if __name__ == "__main__":
    main()
