"""The config groups that used to be appended: `placement`, `precision`, `dedup`.

They are in train.yaml's defaults list (device, fp32, off), so `placement=lookahead`
overrides the default as for any Hydra group. Before they were, the documented form
was `+placement=lookahead` (append), and it is in users' scripts: Hydra refuses to
append a group the defaults list already has, so `+group=option` (and `++`) is
rewritten to `group=option` before composition, sweeps included
(`+placement=device,lookahead`). Keys inside a group (`+placement.overrides.C3=disk`)
are left as they are. No heavy imports: this runs before any of them.
"""

from __future__ import annotations

GROUPS_ONCE_APPENDED = ("placement", "precision", "dedup")


def group_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with `+group=...`/`++group=...` of those groups as `group=...`."""
    out = []
    for o in overrides:
        key, eq, _ = o.partition("=")
        if eq and key.startswith("+") and key.lstrip("+") in GROUPS_ONCE_APPENDED:
            o = o.lstrip("+")
        out.append(o)
    return out
