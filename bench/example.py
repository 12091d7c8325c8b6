"""The smallest benchmark: the declaration bench/README.md walks through,
and what tests/test_bench_harness.py runs end to end.

SUM: summing a list of floats with Python's sum against torch.sum of the
same numbers as a tensor, alternated in one process. MEMORY: counting the
bytes of a buffer of 1x and 4x `mib` MiB, each in its own process, so each
peak RSS (VmHWM) is that process's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import Benchmark, Size, System, SystemRun


@dataclass(frozen=True)
class SumSize(Size):
    numbers: int = 100_000
    repeats: int = 10  # sums per chunk


class PythonSum(SystemRun):
    def __init__(self, size: SumSize) -> None:
        self.numbers, self.repeats = [float(i) for i in range(size.numbers)], size.repeats

    def chunk(self) -> int:
        for _ in range(self.repeats):
            sum(self.numbers)
        return self.repeats * len(self.numbers)


class TorchSum(SystemRun):
    def __init__(self, size: SumSize) -> None:
        import torch  # here: MEMORY's processes never import it

        self.numbers, self.repeats = torch.arange(size.numbers, dtype=torch.float64), size.repeats

    def chunk(self) -> int:
        for _ in range(self.repeats):
            self.numbers.sum()
        return self.repeats * self.numbers.numel()


SUM = Benchmark[SumSize](
    name="example-sum",
    section="Example: Python sum vs torch.sum",
    sizes={"smoke": SumSize(numbers=10_000, repeats=2, rounds=3), "standard": SumSize(rounds=20)},
    systems=[System("python", PythonSum), System("torch", TorchSum)],
    unit="numbers",
    seconds=5,
)


@dataclass(frozen=True)
class BufferSize(Size):
    mib: int = 64


class BufferSum(SystemRun):
    def __init__(self, mib: int) -> None:
        self.buffer = b"\x01" * (mib * 2**20)  # written: its pages are resident

    def chunk(self) -> int:
        return self.buffer.count(1)

    def extras(self) -> dict[str, int]:
        return {"buffer MiB": len(self.buffer) // 2**20}


MEMORY = Benchmark[BufferSize](
    name="example-memory",
    section="Example: peak RSS of a 1x and a 4x buffer",
    sizes={"smoke": BufferSize(mib=32, rounds=2), "standard": BufferSize(mib=256)},
    systems=[System("1x", lambda size: BufferSum(size.mib)), System("4x", lambda size: BufferSum(4 * size.mib))],
    unit="bytes",
    isolated=True,
    seconds=5,
)
