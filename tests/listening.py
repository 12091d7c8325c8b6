"""Where a process listens: what a launched worker of tests/test_distributed.py records of itself and
its launcher (test_a_launch_listens_on_the_loopback_address_only)."""

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


def network() -> dict:
    """In a launched worker whose group is up and has communicated: the
    environment the launcher gave, and what this worker (gloo's pairs) and
    its launcher (the rendezvous and bootstrap stores) listen on."""
    return {"MASTER_ADDR": os.environ.get("MASTER_ADDR"), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
            "worker": listening(os.getpid()), "launcher": listening(os.getppid())}
