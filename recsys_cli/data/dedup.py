"""Deduplicated sparse batches (RecD's inverse-keyed jagged tensors).

Samples of one session repeat most feature values. An ``InverseKeyedJaggedTensor``
(IKJT) stores, per key, only the distinct bags of the batch (for a one-hot key:
the distinct ids; for a multi-hot key: the distinct whole id lists, order
inside a bag significant) plus, per sample, which of them it uses. Lookups,
pooling and gradient updates can then run once per distinct bag and be
expanded with ``inverse`` afterwards.

Layout, for F keys and batch size B (``stride``)::

    unique_counts  list[int] [F]        U_f = number of distinct bags of key f
    lengths        int64 [sum(U_f)]     length of every distinct bag, key-major:
                                        the U_0 bags of key 0, then the U_1 of key 1, ...
    values         int64 [sum(lengths)] their ids, in the same order
    inverse        int64 [F, B]         sample b of key f uses bag inverse[f, b] of
                                        key f (0 <= inverse[f, b] < U_f, local to the key)

So it is a KeyedJaggedTensor whose stride differs per key (``U_f`` instead of B):
the bags of key f are entries ``sum(U_<f) .. sum(U_<=f)`` of ``lengths``.
Bags of a one-hot key are sorted by id; bags of a multi-hot key are in order of
first occurrence in the batch. An empty batch (B = 0) has U_f = 0; a key whose
bags are all empty has one distinct bag, the empty one.

``dedup_kjt`` is exact: one-hot keys use one ``torch.unique`` over all of them
(`unique_onehot`); every other key is first cut into runs of equal adjacent
bags (`repeats_previous`), then the runs' bags are deduplicated by
`unique_bags_of_runs`: ``torch.unique`` on the rows when they all have one
length, else a 64-bit polynomial hash, with every sample checked element-wise
against the representative of its group and an exact row-wise unique of the
padded bags if a collision ever merged two different bags. The loader's
reader-side dedup (data/reader_dedup.py) finds the runs once per row group and
calls the same `unique_bags_of_runs`, so its batches equal
``dedup_kjt(plain batch)`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recsys_cli.data.jagged import KeyedJaggedTensor

__all__ = ["InverseKeyedJaggedTensor", "dedup_kjt", "repeats_previous", "unique_bags_of_runs", "unique_onehot"]

# Two primes below 2**31: products of residues fit in int64 without overflow.
_P1 = 2147483647
_P2 = 2147483629
_G1 = 1_103_515_245 % _P1  # position bases of the two polynomial hashes
_G2 = 1_664_525_017 % _P2
_L1 = 912_367_491  # weight of the bag length
_L2 = 2_017_142_269 % _P2


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _gather_bags(
    values: torch.Tensor, offsets: torch.Tensor, bags: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Concatenate bags[i] (start offsets[bags[i]], length lengths[i]) of a jagged tensor."""
    total = int(lengths.sum())
    if total == 0:
        return values.new_empty(0)
    out_start = _exclusive_cumsum(lengths)[:-1]
    idx = torch.repeat_interleave(offsets[bags] - out_start, lengths, output_size=total)
    idx += torch.arange(total, dtype=torch.int64, device=values.device)
    return values[idx]


def _pow_mod(base: int, exps: torch.Tensor, p: int) -> torch.Tensor:
    """base ** exps mod p, element-wise (exps >= 0, base < p < 2**31)."""
    result = torch.ones_like(exps)
    b = torch.full_like(exps, base % p)
    e = exps.clone()
    while bool((e > 0).any()):
        odd = (e & 1).bool()
        result = torch.where(odd, (result * b) % p, result)
        b = (b * b) % p
        e >>= 1
    return result


_POWERS: dict[tuple[int, str], torch.Tensor] = {}


def _powers(p: int, g: int, n: int, device: torch.device) -> torch.Tensor:
    """g ** [0, n) mod p (cached per prime and device, grown by doubling)."""
    key = (p, str(device))
    table = _POWERS.get(key)
    if table is None or table.numel() < n:
        size = max(64, 1 << max(n - 1, 1).bit_length())
        table = _pow_mod(g, torch.arange(size, dtype=torch.int64, device=device), p)
        _POWERS[key] = table
    return table


@dataclass
class InverseKeyedJaggedTensor:
    keys: list[str]
    values: torch.Tensor  # int64 [sum(lengths)]: ids of the distinct bags, key-major
    lengths: torch.Tensor  # int64 [sum(unique_counts)]: length of each distinct bag
    unique_counts: list[int]  # [F]: distinct bags per key
    inverse: torch.Tensor  # int64 [F, B]: bag of sample b of key f, local to key f
    stride: int  # B

    def __post_init__(self) -> None:
        if len(self.unique_counts) != len(self.keys):
            raise ValueError(f"{len(self.unique_counts)} unique counts for {len(self.keys)} keys")
        if self.lengths.numel() != sum(self.unique_counts):
            raise ValueError(
                f"lengths has {self.lengths.numel()} entries, unique_counts sum to {sum(self.unique_counts)}"
            )
        if tuple(self.inverse.shape) != (len(self.keys), self.stride):
            raise ValueError(
                f"inverse has shape {tuple(self.inverse.shape)}, expected ({len(self.keys)}, {self.stride})"
            )

    # -- layout helpers -------------------------------------------------
    def bag_base(self) -> list[int]:
        """Index in ``lengths`` of the first distinct bag of each key, plus the end: [F + 1]."""
        out = [0]
        for c in self.unique_counts:
            out.append(out[-1] + c)
        return out

    def offsets(self) -> torch.Tensor:
        """Start of every distinct bag in ``values``, plus the end: [sum(unique_counts) + 1]."""
        return _exclusive_cumsum(self.lengths)

    def global_inverse(self) -> torch.Tensor:
        """int64 [F, B]: for each sample, the index of its bag in ``lengths`` (all keys)."""
        base = torch.tensor(self.bag_base()[:-1], dtype=torch.int64, device=self.inverse.device)
        return self.inverse + base.view(-1, 1)

    def bags(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, lengths) of the distinct bags of one key."""
        f = self.keys.index(key)
        base = self.bag_base()
        offsets = self.offsets()
        lo, hi = int(offsets[base[f]]), int(offsets[base[f + 1]])
        return self.values[lo:hi], self.lengths[base[f] : base[f + 1]]

    # -- conversions ----------------------------------------------------
    def to_kjt(self) -> KeyedJaggedTensor:
        """Expand back to the plain batch (exact inverse of ``dedup_kjt``)."""
        flat = self.global_inverse().reshape(-1)
        lengths = self.lengths[flat]
        values = _gather_bags(self.values, self.offsets(), flat, lengths)
        return KeyedJaggedTensor(keys=list(self.keys), values=values, lengths=lengths, stride=self.stride)

    def apply(self, fn) -> "InverseKeyedJaggedTensor":
        """The same batch with fn applied to every tensor (a move, pinning)."""
        return InverseKeyedJaggedTensor(
            keys=self.keys, values=fn(self.values), lengths=fn(self.lengths), unique_counts=self.unique_counts,
            inverse=fn(self.inverse), stride=self.stride,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "InverseKeyedJaggedTensor":
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "InverseKeyedJaggedTensor":
        return self.apply(torch.Tensor.pin_memory)

    # -- statistics -----------------------------------------------------
    def _value_counts(self) -> tuple[list[int], list[int]]:
        F = len(self.keys)
        if F == 0:
            return [], []
        total = self.lengths[self.global_inverse().reshape(-1)].view(F, self.stride).sum(1).tolist()
        base = self.bag_base()
        cum = _exclusive_cumsum(self.lengths).tolist()
        unique = [cum[base[f + 1]] - cum[base[f]] for f in range(F)]
        return unique, total

    def duplication_ratio(self) -> dict[str, float]:
        """Per key: 1 - distinct-bag ids / batch ids (0.0 for a key with no ids)."""
        unique, total = self._value_counts()
        return {k: (1.0 - u / t if t else 0.0) for k, u, t in zip(self.keys, unique, total)}

    def total_duplication_ratio(self) -> float:
        """1 - distinct-bag ids / batch ids over all keys."""
        unique, total = self._value_counts()
        t = sum(total)
        return 1.0 - sum(unique) / t if t else 0.0


def _unique_bags_exact(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Inverse of the distinct bags, via unique rows of the padded bags (length first)."""
    B = lengths.numel()
    width = int(lengths.max()) if B else 0
    mat = torch.zeros(B, width + 1, dtype=torch.int64, device=values.device)
    mat[:, 0] = lengths
    if values.numel():
        bag_of = torch.repeat_interleave(torch.arange(B, device=values.device), lengths)
        pos = torch.arange(values.numel(), device=values.device) - _exclusive_cumsum(lengths)[:-1][bag_of]
        mat[bag_of, pos + 1] = values
    _, inverse = torch.unique(mat, dim=0, return_inverse=True)
    return inverse


def repeats_previous(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """bool [B]: bag b is element-wise equal to bag b - 1 (exact, O(ids)).

    Session-clustered data holds a session's samples next to each other and a
    history bag is shared by the whole session, so most duplicates are
    adjacent. The loader runs this once per row group (reader-side dedup);
    dedup_kjt runs it per batch before hashing what is left.
    """
    n = len(lengths)
    repeat = np.zeros(n, dtype=bool)
    if n < 2:
        return repeat
    repeat[1:] = lengths[1:] == lengths[:-1]
    if len(values):
        prev_len = np.zeros(n, dtype=np.int64)
        prev_len[1:] = lengths[:-1]
        # Element j of bag b sits prev_len[b] ids after element j of bag b - 1.
        partner = np.arange(len(values), dtype=np.int64)
        partner -= np.repeat(prev_len, lengths)
        np.maximum(partner, 0, out=partner)
        differs = values != values[partner]
        differs &= np.repeat(repeat, lengths)
        nonempty = lengths > 0  # an empty bag's segment is empty: nothing differs
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        bad = np.zeros(n, dtype=bool)
        bad[nonempty] = np.logical_or.reduceat(differs, starts[nonempty])
        repeat &= ~bad
    return repeat


def unique_bags_of_runs(
    values: torch.Tensor, lengths: torch.Tensor, run_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct bags of one key, given its samples as runs: (values, lengths, inverse [B]).

    Runs are candidate bags (``values``/``lengths`` of R runs; two runs may
    hold equal bags), numbered in order of their first sample; ``run_of[b]``
    is the run of sample b. Equal runs are merged by a 64-bit hash, verified
    element-wise (`_unique_run_heads`); the distinct bags come out in order of
    first occurrence. dedup_kjt finds the runs of a batch with
    `repeats_previous`; the loader finds them once per row group
    (data/reader_dedup.py) and passes the batch's runs here.
    """
    R = lengths.numel()
    if R == 0:
        return values.new_empty(0), lengths.new_empty(0), run_of.new_empty(0)
    lmin, lmax = (int(x) for x in lengths.aminmax())
    if lmax == 0:  # every bag empty: one distinct (empty) bag
        return values.new_empty(0), lengths[:1], torch.zeros_like(run_of)
    if lmin == lmax == 1:  # one id a bag: sorted, as the one-hot keys (unique_onehot)
        u_values, run_inverse = torch.unique(values, sorted=True, return_inverse=True)
        return u_values, torch.ones_like(u_values), run_inverse[run_of]
    if lmin == lmax:  # fixed length L: distinct rows of an [R, L] matrix
        _, run_inverse = torch.unique(values.view(R, lmin), dim=0, return_inverse=True)
        run_inverse = _first_occurrence_order(run_inverse)
        rep = _representatives(run_inverse)
        return values.view(R, lmin)[rep].reshape(-1), lengths[rep], run_inverse[run_of]
    if _surely_distinct(values, lengths):
        return values, lengths, run_of
    run_inverse, rep = _unique_run_heads(values, lengths)
    u_lengths = lengths[rep]
    u_values = _gather_bags(values, _exclusive_cumsum(lengths), rep, u_lengths)
    return u_values, u_lengths, run_inverse[run_of]


def _surely_distinct(values: torch.Tensor, lengths: torch.Tensor) -> bool:
    """True if no two bags share (length, first id, last id), hence no two are
    equal: O(bags), where the hash is O(ids). Runs of session data (one
    history bag a session) almost always pass."""
    if lengths.numel() < 2 or not bool((lengths > 0).all()):
        return lengths.numel() < 2
    ends = torch.cumsum(lengths, 0)
    signature = torch.stack([lengths, values[ends - lengths], values[ends - 1]], 1)
    return torch.unique(signature, dim=0).shape[0] == lengths.numel()


def _unique_bags(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct bags of one key with variable bag lengths: (values, lengths, inverse [B]).

    Runs of equal adjacent bags are collapsed first (exact, O(ids)); their
    first bags are then deduplicated by hashing (`unique_bags_of_runs`).
    """
    repeat = torch.from_numpy(repeats_previous(values.cpu().numpy(), lengths.cpu().numpy())).to(values.device)
    if not bool(repeat.any()):
        return unique_bags_of_runs(values, lengths, torch.arange(lengths.numel(), device=values.device))
    heads = torch.nonzero(~repeat).flatten()
    head_lengths = lengths[heads]
    head_values = _gather_bags(values, _exclusive_cumsum(lengths), heads, head_lengths)
    run_of = torch.cumsum((~repeat).long(), 0) - 1
    return unique_bags_of_runs(head_values, head_lengths, run_of)


def _unique_run_heads(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct bags by a 64-bit polynomial hash, verified element-wise."""
    B = lengths.numel()
    device = values.device
    offsets = _exclusive_cumsum(lengths)
    n = values.numel()
    bag_of = torch.repeat_interleave(torch.arange(B, device=device), lengths, output_size=n)
    pos = torch.arange(n, device=device) - offsets[:-1][bag_of]
    lo, hi = (int(x) for x in values.aminmax()) if n else (0, 0)
    reduce = hi >= _P2 or lo <= -_P2  # residues needed only to keep the products below 2**63
    keys = []
    for p, g, lw in ((_P1, _G1, _L1), (_P2, _G2, _L2)):
        residues = torch.remainder(values, p) if reduce else values  # ids are usually below both primes
        terms = (residues * _powers(p, g, int(lengths.max()), device)[pos]) % p
        h = torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, bag_of, terms)
        keys.append((h + lengths * lw) % p)
    key = keys[0] * _P2 + keys[1]
    distinct, inverse = torch.unique(key, return_inverse=True)
    if distinct.numel() == B:  # no two bags share a hash: all distinct, nothing to verify
        every = torch.arange(B, device=device)
        return every, every
    inverse = _first_occurrence_order(inverse)
    rep = _representatives(inverse)
    # Verify: every bag that shares its hash equals its group's representative, element-wise.
    in_shared = torch.bincount(inverse)[inverse] > 1
    shared = torch.nonzero(in_shared).flatten()
    ok = bool(torch.equal(lengths[rep[inverse[shared]]], lengths[shared]))
    if ok and n:
        elements = torch.nonzero(in_shared[bag_of]).flatten()
        partner = offsets[:-1][rep[inverse]][bag_of[elements]] + pos[elements]
        ok = bool(torch.equal(values[partner], values[elements]))
    if not ok:  # a hash collision merged different bags: exact path
        inverse = _first_occurrence_order(_unique_bags_exact(values, lengths))
        rep = _representatives(inverse)
    return inverse, rep


def _representatives(inverse: torch.Tensor) -> torch.Tensor:
    """First sample of each group 0..U-1 (groups numbered by first occurrence)."""
    U = int(inverse.max()) + 1 if inverse.numel() else 0
    B = inverse.numel()
    rep = torch.full((U,), B, dtype=torch.int64, device=inverse.device)
    return rep.scatter_reduce_(0, inverse, torch.arange(B, device=inverse.device), reduce="amin")


def _first_occurrence_order(inverse: torch.Tensor) -> torch.Tensor:
    """Renumber groups so that group ids increase with their first sample."""
    if inverse.numel() == 0:
        return inverse
    first = _representatives(inverse)
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank[inverse]


def unique_onehot(ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row of ``ids`` (int64 [K, B], one-hot keys): (sorted distinct ids,
    inverse [B]), with one torch.unique over all keys (ids shifted apart per
    key) instead of one a key: measured 1.5x faster at batch 128 and 1.7x at
    2048 than numpy's unique per key (BENCHMARKS.md, one-hot dedup)."""
    K, B = ids.shape
    if K == 0:
        return []
    if B == 0:
        return [(ids.new_empty(0), ids.new_empty(0))] * K
    low, high = ids.aminmax()
    span = int(high - low) + 1
    key_base = torch.arange(K, dtype=torch.int64, device=ids.device).view(-1, 1) * span
    distinct, inverse = torch.unique(ids - low + key_base, sorted=True, return_inverse=True)
    key_of = torch.div(distinct, span, rounding_mode="floor")
    counts = torch.bincount(key_of, minlength=K)
    local = distinct - key_of * span + low
    inverse = inverse - (torch.cumsum(counts, 0) - counts).view(-1, 1)
    return list(zip(torch.split(local, counts.tolist()), inverse.unbind(0)))


def dedup_kjt(kjt: KeyedJaggedTensor) -> InverseKeyedJaggedTensor:
    """Deduplicate every key of a batch (exact; vectorised per key)."""
    F, B = len(kjt.keys), kjt.stride
    device = kjt.values.device
    lengths = kjt.lengths.view(F, B)
    if B == 0 or F == 0:
        return InverseKeyedJaggedTensor(
            keys=list(kjt.keys),
            values=kjt.values.new_empty(0),
            lengths=kjt.lengths.new_empty(0),
            unique_counts=[0] * F,
            inverse=torch.zeros(F, B, dtype=torch.int64, device=device),
            stride=B,
        )
    key_off = _exclusive_cumsum(lengths.sum(1)).tolist()
    lmin, lmax = (t.tolist() for t in lengths.aminmax(dim=1))
    onehot_keys = [f for f in range(F) if lmin[f] == lmax[f] == 1]
    onehot = {}
    if onehot_keys:
        ids = torch.stack([kjt.values[key_off[f] : key_off[f] + B] for f in onehot_keys])  # [K, B]
        onehot = dict(zip(onehot_keys, unique_onehot(ids)))
    out_values, out_lengths, counts, inverses = [], [], [], []
    for f in range(F):
        vals = kjt.values[key_off[f] : key_off[f + 1]]
        lens = lengths[f]
        if f in onehot:
            u_vals, inv = onehot[f]
            u_lens = torch.ones(u_vals.numel(), dtype=torch.int64, device=device)
        else:
            u_vals, u_lens, inv = _unique_bags(vals, lens)
        out_values.append(u_vals)
        out_lengths.append(u_lens)
        counts.append(u_lens.numel())
        inverses.append(inv)
    return InverseKeyedJaggedTensor(
        keys=list(kjt.keys),
        values=torch.cat(out_values),
        lengths=torch.cat(out_lengths),
        unique_counts=counts,
        inverse=torch.stack(inverses),
        stride=B,
    )
