import random

import pytest
import torch

from recsys_cli.data import dedup as dedup_mod
from recsys_cli.data.batch import Batch
from recsys_cli.data.dedup import InverseKeyedJaggedTensor, dedup_kjt
from recsys_cli.data.jagged import KeyedJaggedTensor

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


def _check(kjt: KeyedJaggedTensor) -> InverseKeyedJaggedTensor:
    ikjt = dedup_kjt(kjt)
    assert ikjt.keys == kjt.keys and ikjt.stride == kjt.stride
    assert ikjt.inverse.shape == (len(kjt.keys), kjt.stride)
    back = ikjt.to_kjt()
    assert torch.equal(back.lengths, kjt.lengths)
    assert torch.equal(back.values, kjt.values)
    assert back.values.dtype == torch.int64 and back.lengths.dtype == torch.int64
    # exactly the distinct bags of each key, nothing merged
    plain = kjt.to_dict()
    for f, k in enumerate(kjt.keys):
        vals, lens = ikjt.bags(k)
        assert lens.numel() == ikjt.unique_counts[f] == len({tuple(b) for b in plain[k]})
        offs = [0, *torch.cumsum(lens, 0).tolist()]
        bags = [tuple(vals[offs[i] : offs[i + 1]].tolist()) for i in range(len(lens))]
        assert len(set(bags)) == len(bags)
        inv = ikjt.inverse[f].tolist()
        assert all(0 <= i < len(bags) for i in inv)
        assert [list(bags[i]) for i in inv] == plain[k]
    return ikjt


def test_round_trip_one_hot():
    kjt = KeyedJaggedTensor.from_lists({"a": [[5], [3], [5], [7], [3]], "b": [[1], [1], [1], [2], [9]]})
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [3, 3]
    assert ikjt.bags("a")[0].tolist() == [3, 5, 7]  # one-hot: sorted ids
    assert ikjt.inverse[0].tolist() == [1, 0, 1, 2, 0]


def test_round_trip_multi_hot_with_empty_bags():
    kjt = KeyedJaggedTensor.from_lists(
        {
            "one": [[1], [2], [1], [2], [3], [1]],
            "hist": [[1, 2], [], [2, 1], [1, 2], [], [1, 2, 3]],
            "empty": [[], [], [], [], [], []],
            "fixed": [[4, 5], [4, 5], [5, 4], [0, 0], [4, 5], [0, 0]],
        }
    )
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [3, 4, 1, 3]
    # multi-hot: bags in order of first occurrence, order inside a bag matters
    vals, lens = ikjt.bags("hist")
    assert lens.tolist() == [2, 0, 2, 3] and vals.tolist() == [1, 2, 2, 1, 1, 2, 3]
    assert ikjt.inverse[1].tolist() == [0, 1, 2, 0, 1, 3]
    assert ikjt.bags("empty")[1].tolist() == [0]


def test_random_batches_round_trip():
    rng = random.Random(0)
    for trial in range(20):
        B = rng.randint(1, 60)
        per_key = {
            "o": [[rng.randint(0, 5)] for _ in range(B)],
            "m": [[rng.randint(0, 3) for _ in range(rng.randint(0, 3))] for _ in range(B)],
            "big": [[rng.randint(0, 10**12) for _ in range(rng.randint(0, 5))] for _ in range(B)],
        }
        _check(KeyedJaggedTensor.from_lists(per_key))


def test_no_duplicates():
    B = 50
    kjt = KeyedJaggedTensor.from_lists(
        {"a": [[i] for i in range(B)], "h": [[i, i + 1] if i % 2 else [i] for i in range(B)]}
    )
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [B, B]
    assert ikjt.duplication_ratio() == {"a": 0.0, "h": 0.0}
    assert ikjt.total_duplication_ratio() == 0.0


def test_all_samples_identical():
    B = 32
    kjt = KeyedJaggedTensor.from_lists({"a": [[7]] * B, "h": [[1, 2, 3]] * B, "v": [[4], []] * (B // 2)})
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [1, 1, 2]
    assert ikjt.inverse[0].tolist() == [0] * B
    r = ikjt.duplication_ratio()
    assert r["a"] == pytest.approx(1 - 1 / B)
    assert r["h"] == pytest.approx(1 - 3 / (3 * B))
    assert r["v"] == pytest.approx(1 - 1 / (B // 2))


def test_duplication_ratio_counts_ids():
    kjt = KeyedJaggedTensor.from_lists(
        {"a": [[1], [1], [2], [3]], "h": [[1, 2], [1, 2], [], [5]], "e": [[], [], [], []]}
    )
    ikjt = _check(kjt)
    r = ikjt.duplication_ratio()
    assert r["a"] == pytest.approx(1 - 3 / 4)
    assert r["h"] == pytest.approx(1 - 3 / 5)  # distinct bags hold 3 ids of the batch's 5
    assert r["e"] == 0.0
    assert ikjt.total_duplication_ratio() == pytest.approx(1 - 6 / 9)


def test_hash_collisions_never_merge_bags(monkeypatch):
    # Make the hash useless (every bag of one length collides): verification must catch it.
    monkeypatch.setattr(dedup_mod, "_powers", lambda p, g, n, device: torch.zeros(max(n, 1), dtype=torch.int64))
    kjt = KeyedJaggedTensor.from_lists({"h": [[1, 2], [2, 1], [3], [1, 2], [], [4], [3]]})
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [5]
    assert ikjt.inverse[0].tolist() == [0, 1, 2, 0, 3, 4, 2]


def test_empty_batch_and_device_move():
    kjt = KeyedJaggedTensor(["a", "b"], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0)
    ikjt = dedup_kjt(kjt)
    assert ikjt.unique_counts == [0, 0] and ikjt.inverse.shape == (2, 0)
    assert ikjt.to_kjt().lengths.numel() == 0
    ikjt = dedup_kjt(KeyedJaggedTensor.from_lists({"a": [[1], [1]], "h": [[2, 3], []]}))
    moved = ikjt.to("cpu")
    assert moved.unique_counts == ikjt.unique_counts and torch.equal(moved.inverse, ikjt.inverse)
    batch = Batch(dense=torch.zeros(2, 13), sparse=ikjt, labels=torch.zeros(2)).to("cpu")
    assert isinstance(batch.sparse, InverseKeyedJaggedTensor)


def test_layout_validation():
    with pytest.raises(ValueError):
        InverseKeyedJaggedTensor(
            keys=["a"],
            values=torch.zeros(1, dtype=torch.int64),
            lengths=torch.ones(2, dtype=torch.int64),
            unique_counts=[1],
            inverse=torch.zeros(1, 3, dtype=torch.int64),
            stride=3,
        )


def test_loader_dedups_history_bags_of_sessions(tmp_path):
    """Reader-side dedup: history bags shared by a session's adjacent rows are
    found per row group and arrive deduplicated, equal to the plain batch."""
    from data_tools.synthetic import SyntheticConfig, generate
    from recsys_cli.data.loader import ShardLoader

    cfg = SyntheticConfig(rows=3000, cardinality_scale=0.0005, sessions=True, multi_hot_features=2,
                          multi_hot_min_length=0, multi_hot_max_length=12, row_group_rows=700, seed=3)
    generate(cfg, tmp_path / "data")
    for shuffle in (True, False):
        plain = list(ShardLoader(tmp_path / "data", batch_size=64, seed=1, shuffle=shuffle, keep_sessions=True,
                                 drop_last=False))
        dedup = list(ShardLoader(tmp_path / "data", batch_size=64, seed=1, shuffle=shuffle, keep_sessions=True,
                                 drop_last=False, dedup=True))
        assert len(plain) == len(dedup)
        shared = 0
        for p, d in zip(plain, dedup):
            assert isinstance(d.sparse, InverseKeyedJaggedTensor)
            back = d.sparse.to_kjt()
            assert back.keys == p.sparse.keys
            assert torch.equal(back.values, p.sparse.values) and torch.equal(back.lengths, p.sparse.lengths)
            assert torch.equal(d.labels, p.labels) and torch.equal(d.dense, p.dense)
            h = d.sparse.keys.index("H1")
            shared += p.size - d.sparse.unique_counts[h]
        assert shared > 0.5 * sum(b.size for b in plain)  # sessions of ~8 share one bag


def test_loader_dedup_equals_dedup_kjt_of_the_plain_batch(tmp_path):
    """One dedup implementation: the loader's reader-side path (runs found per
    row group, merged by unique_bags_of_runs) gives exactly dedup_kjt's IKJT of
    the plain batch, one-hot and multi-hot keys, across row-group boundaries."""
    from data_tools.synthetic import SyntheticConfig, generate
    from recsys_cli.data.loader import ShardLoader

    cfg = SyntheticConfig(rows=2000, cardinality_scale=0.0005, sessions=True, multi_hot_features=2,
                          multi_hot_min_length=0, multi_hot_max_length=6, row_group_rows=300, seed=5)
    generate(cfg, tmp_path / "data")
    for shuffle, keep_sessions in ((True, True), (False, True), (True, False)):
        kw = dict(batch_size=48, seed=2, shuffle=shuffle, keep_sessions=keep_sessions, drop_last=False)
        plain = list(ShardLoader(tmp_path / "data", **kw))
        dedup = list(ShardLoader(tmp_path / "data", dedup=True, **kw))
        assert len(plain) == len(dedup)
        for p, d in zip(plain, dedup):
            want = dedup_kjt(p.sparse)
            got = d.sparse
            assert got.keys == want.keys and got.unique_counts == want.unique_counts and got.stride == want.stride
            for field in ("values", "lengths", "inverse"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_multi_hot_key_with_one_length_in_a_batch():
    """A multi-hot key whose bags all have one length goes the fixed-length
    way; its bags are still numbered by first occurrence."""
    kjt = KeyedJaggedTensor.from_lists({"h": [[5], [3], [5], [7]], "f": [[9, 1], [2, 2], [9, 1], [0, 4]]})
    ikjt = _check(kjt)
    assert ikjt.bags("f")[0].tolist() == [9, 1, 2, 2, 0, 4]
    assert ikjt.inverse[1].tolist() == [0, 1, 0, 2]


def test_bags_that_share_length_and_ends_are_still_told_apart():
    # (length, first id, last id) is only a shortcut for "surely distinct"; equal
    # signatures go through the verified hash
    kjt = KeyedJaggedTensor.from_lists({"h": [[1, 5, 2], [1, 6, 2], [1, 5, 2], [7], [7, 7], [1, 6, 2]]})
    ikjt = _check(kjt)
    assert ikjt.unique_counts == [4]
    assert ikjt.inverse[0].tolist() == [0, 1, 0, 2, 3, 1]
