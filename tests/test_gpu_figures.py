"""bench/gpu_figures.py on CPU (--dry, tiny sizes): every system runs its rounds, and the
prefetcher's busy share is its work over the chunk's time, never its waits (which once
read 600-800 %: the seconds a prefetcher waited while the other systems ran), and the
validation AUC is read after one epoch, where the fp32 placements agree exactly; a cache
is timed once it is full (it has evicted), as in a long run."""

from __future__ import annotations

import json

import bench.gpu_figures as gpu_figures


def test_the_figures_run_every_system_and_share_the_prefetchers_time_honestly(tmp_path):
    out = tmp_path / "figures"
    assert gpu_figures.main(["--dry", "--batches", "64", "--rounds", "2", "--steps", "20", "--warmup", "1",
                             "--rows", "3000", "--cardinality-scale", "0.003", "--out", str(out)]) == 0
    (batch,) = json.loads((out / "gpu_figures.json").read_text())["batches"]
    assert set(batch["systems"]) == {*gpu_figures.SYSTEMS, gpu_figures.PEER}
    for name, entry in batch["systems"].items():
        assert len(entry["rates"]) == 2 and entry["samples_per_second"] > 0, name
        if "lookahead" in name:
            assert 0 < entry["prepare_share"] < 1, (name, entry["prepare_shares"])
            assert 0 <= entry["batch_wait_share"] < 1, (name, entry["batch_wait_shares"])
            assert entry["evicted_before_timing"] > 0, name  # timed full, as in a long run
        else:
            assert entry["prepare_share"] == 0, name
    epoch = {name: entry["val_auc_step"] for name, entry in batch["systems"].items() if name != gpu_figures.PEER}
    assert set(epoch.values()) == {2 * (2400 // 64)}, epoch  # 80 % of the rows in batches of 64; 41+ steps timed
    aucs = {name: batch["systems"][name]["val_auc"] for name in ("device", "lookahead 5 %", "lookahead 1 %", "host", "uvm")}
    assert len(set(aucs.values())) == 1 and 0.5 < aucs["device"] < 1, aucs  # exact caching: one model, one AUC
