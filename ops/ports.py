"""Free local ports for a stack: a base whose ports and metrics ports are all free, below the
kernel's ephemeral range (there an outgoing connection of the stack itself could take one of them
first, and a restarted service would find its port in use)."""
from __future__ import annotations

import random
import socket


def free_port_base(count: int, offset: int = 100) -> int:
    """A port base whose `count` ports and their metrics ports (+offset) are all free now."""
    low, high = 20000, ephemeral_ports()[0] - offset - count
    if high <= low:
        low, high = 10000, 20000
    for _ in range(200):
        base = random.randrange(low, high)
        ports = [*range(base, base + count), *range(base + offset, base + offset + count)]
        if all(port_free(p) for p in ports):
            return base
    raise RuntimeError("no free range of local ports")


def ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
