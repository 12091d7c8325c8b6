"""A launched worker that reports where it and its launcher listen (tests/test_distributed.py,
test_a_launch_listens_on_the_loopback_address_only): importable by name, as spawned workers need."""

from __future__ import annotations

import os


def listening(pid: int) -> list[str]:
    """The local addresses (host:port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, port = fields[1].split(":")
                    found.append(f"{_host(address, width)}:{int(port, 16)}")
    return found


def _host(hexed: str, width: int) -> str:
    raw = bytes.fromhex(hexed)
    if width == 8:  # IPv4, little-endian
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]  # IPv6: four little-endian words
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def report() -> dict:
    """Joined the group (gloo), with a collective done: the environment the
    launcher gave, and what this worker and its launcher listen on."""
    import torch
    import torch.distributed as dist

    from recsys_cli.train import distributed

    distributed.init(timeout_s=60, device="cpu")
    try:
        box = torch.ones(1)
        dist.all_reduce(box)  # the gloo pairs are connected
        return {"MASTER_ADDR": os.environ.get("MASTER_ADDR"), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
                "world": int(box[0]), "worker": listening(os.getpid()), "launcher": listening(os.getppid())}
    finally:
        distributed.teardown()
