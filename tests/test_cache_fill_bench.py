"""bench/cache_fill_bench.py times a lookahead cache's prepare() and its parts: on tiny
sizes here, so the tool stays runnable and its parts stay wired to the methods it wraps."""

from __future__ import annotations

import bench.cache_fill_bench as cache_fill_bench


def test_the_fill_benchmark_times_prepare_and_every_part(tmp_path, capsys):
    assert cache_fill_bench.main(["--rows", "6000", "--cardinality-scale", "0.002", "--batch", "256",
                                  "--batches", "14", "--ratios", "0.01", "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "cache ratio 0.01" in printed and "prepare ms" in printed
    for part in cache_fill_bench.PARTS:
        assert f"{part} ms" in printed
    ops = float(printed.split("torch ops ")[1].split()[0])
    assert 20 < ops < 2000  # counted: a prepare makes tens to hundreds of torch calls


def test_every_part_wraps_a_method_prepare_calls(tmp_path):
    # A renamed method would leave its part timing nothing: each must run during prepare().
    class Args:
        rows, cardinality_scale, batch, batches, cache_dir = 6000, 0.002, 32, 40, str(tmp_path)

    group, plans = cache_fill_bench.group_and_plans(Args, 0.0005)  # a cache small enough to evict
    _, parts = cache_fill_bench.prepare_timed(group, plans, cache_fill_bench.timed_parts(group))
    assert all(sum(parts[part]) > 0 for part in cache_fill_bench.PARTS), dict(parts)
