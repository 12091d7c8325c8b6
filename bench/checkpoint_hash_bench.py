"""Checkpoint checksums (issue 27): the cost of hashing beside the write it rides on.

    .venv/bin/python -m bench.checkpoint_hash_bench [--repeat 2] [--record]

Kaggle cardinalities (33.8M rows) at dim 16, the two files a checkpoint of
them is made of:

  .pt, fp32 host tables   the tables' one fused storage (2.0 GiB) in a
                          torch.save checkpoint, as the trainer writes it
  disk base, int8 + SGD   every row's record (int8 codes, fp16 scale and
                          bias: 20 B) written chunk by chunk, as a disk
                          table's new base is (disk_checkpoint._write_file)

Each is written (and fsynced) with its checksum computed while writing,
as recsys does, and the same way without, in alternation, best of
--repeat. The write's time can vary with the disk (fsync) by more than
the checksum costs, so the XXH3-64 of the same bytes in memory is timed on
its own too. The verifying read a load does first (checksum.file_problem,
the page cache warm as it is right after a save) is timed too. Then
XXH3-64, CRC-32, SHA-256 and BLAKE2b over the same first 256 MiB, to
justify the choice. The values are random: hashing speed does not depend on them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash

from data_tools.synthetic import KAGGLE_CARDINALITIES
from recsys_cli.checksum import HashingWriter, file_problem
from recsys_cli.embeddings import disk_checkpoint

DIM = 16
RECORD = DIM + 4  # int8 codes, fp16 scale and bias (SGD: no optimizer state)
MiB = 2**20


def save_pt(state: dict, path: Path, hashed: bool) -> dict | None:
    with open(path, "wb") as f:
        out = HashingWriter(f) if hashed else f
        torch.save(state, out)
        f.flush()
        os.fsync(f.fileno())
    return out.checksum.record() if hashed else None


def write_plain(path: Path, chunks) -> None:
    """disk_checkpoint._write_file without its checksum: the reference."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(memoryview(chunk).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def base_chunks(records: np.ndarray):
    step = disk_checkpoint.CHUNK_BYTES // RECORD
    for a in range(0, records.shape[0], step):
        yield records[a:a + step]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, write_hashed, write_plain_, path: Path, repeat: int, data: memoryview) -> dict:
    hashed, plain, record = [], [], {}
    for _ in range(repeat):
        plain.append(timed(write_plain_))
        hashed.append(timed(lambda: record.update(write_hashed() or {})))
    verify = timed(lambda: file_problem(path, record))
    alone = min(timed(lambda: xxhash.xxh3_64(data).intdigest()) for _ in range(repeat))
    size = path.stat().st_size
    return {"file": name, "MiB": size / MiB, "write s, no checksum": min(plain), "write s, checksum while writing":
            min(hashed), "checksum adds % of the write": 100 * (min(hashed) - min(plain)) / min(plain),
            "xxh3_64 of the bytes alone s": alone, "xxh3_64 alone % of the write": 100 * alone / min(plain),
            "verifying read at load s": verify, "verify MiB/s": size / MiB / verify}


def algorithms(path: Path) -> dict:
    with open(path, "rb") as f:
        data = memoryview(f.read(256 * MiB))
    out = {"bytes MiB": data.nbytes / MiB}
    for name, fn in (("xxh3_64", lambda: xxhash.xxh3_64(data).intdigest()), ("crc32", lambda: zlib.crc32(data)),
                     ("sha256", lambda: hashlib.sha256(data).digest()), ("blake2b", lambda: hashlib.blake2b(data).digest())):
        out[f"{name} MiB/s"] = data.nbytes / MiB / min(timed(fn) for _ in range(2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temporary directory)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    rows = sum(KAGGLE_CARDINALITIES)
    load = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="recsys-hash-bench-", dir=args.dir) as tmp:
        pt = Path(tmp) / "step.pt"
        weights = torch.empty(rows, DIM).uniform_(-0.05, 0.05, generator=gen)
        offsets = np.cumsum([0, *KAGGLE_CARDINALITIES])
        state = {"tables": {f"C{i + 1}": {"precision": "fp32", "weights": weights[offsets[i]:offsets[i + 1]]}
                            for i in range(len(KAGGLE_CARDINALITIES))}}
        results.append(measure(".pt, fp32 host tables", lambda: save_pt(state, pt, True),
                               lambda: save_pt(state, pt, False), pt, args.repeat,
                               memoryview(weights.numpy()).cast("B")))
        algos = algorithms(pt)
        del state, weights
        base = Path(tmp) / "base.bin"
        records = np.random.default_rng(0).integers(0, 256, size=(rows, RECORD), dtype=np.uint8)
        results.append(measure("disk base, int8 + SGD", lambda: disk_checkpoint._write_file(base, base_chunks(records)),
                               lambda: write_plain(base, base_chunks(records)), base, args.repeat,
                               memoryview(records).cast("B")))
    for r in results:
        r["load average (1, 5, 15 min)"] = " ".join(f"{x:.1f}" for x in load)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    print(json.dumps({k: round(v, 1) for k, v in algos.items()}))
    if args.record:
        from bench.record import record

        command = "python -m bench.checkpoint_hash_bench " + " ".join(sys.argv[1:])
        record("Checkpoint checksums (issue 27)", list(results[0]), results, command,
               note="Kaggle cardinalities (33.8M rows) at dim 16: a torch.save checkpoint of the fp32 host tables "
                    "and a disk table's int8 base file, each fsynced, with the checksum (XXH3-64) computed "
                    "while writing vs without (best of --repeat, alternating): 'checksum adds' is what a save pays "
                    "(fsync's variance can exceed it), 'xxh3_64 alone' the hash of the same bytes in memory; and the "
                    "verifying read a load does first (page cache warm). Hash speeds on the .pt's first 256 MiB: "
                    + ", ".join(
                        f"{k} {v:,.0f}" for k, v in algos.items() if k.endswith("MiB/s")) + ".")


if __name__ == "__main__":
    main()
