"""Free local ports for a stack: a base whose ports and metrics ports are all free, below the
kernel's ephemeral range (there an outgoing connection of the stack itself could take one of them
first, and a restarted service would find its port in use).

$EPD_PORT_RANGE ("LOW-HIGH") narrows where bases are drawn: runs that share a machine (parallel test
workers, two developers' stacks) each get their own slice, so one never takes a base the other has
checked free but not yet bound."""
from __future__ import annotations

import os
import random
import socket


def free_port_base(count: int, offset: int = 100) -> int:
    """A port base whose `count` ports and their metrics ports (+offset) are all free now."""
    low, top = port_range()
    high = top - offset - count   # the highest base whose metrics ports still fit below top
    if high <= low:
        raise RuntimeError(f"the port range {low}-{top} cannot hold {count} ports and their metrics ports (+{offset})")
    for _ in range(200):
        base = random.randrange(low, high)
        ports = [*range(base, base + count), *range(base + offset, base + offset + count)]
        if all(port_free(p) for p in ports):
            return base
    raise RuntimeError(f"no free range of {count} local ports in {low}-{top}")


def port_range() -> tuple[int, int]:
    """[low, high) for stack ports: $EPD_PORT_RANGE, else 20000 up to the kernel's ephemeral range
    (10000-20000 where that range starts lower)."""
    text = os.environ.get("EPD_PORT_RANGE", "").strip()
    if text:
        try:
            low, high = (int(part) for part in text.split("-"))
        except ValueError:
            raise ValueError(f"EPD_PORT_RANGE must be LOW-HIGH (e.g. 20000-26000), got {text!r}") from None
        if not 1024 <= low < high <= 65536:
            raise ValueError(f"EPD_PORT_RANGE must satisfy 1024 <= LOW < HIGH <= 65536, got {text!r}")
        return low, high
    ephemeral_low = ephemeral_ports()[0]
    return (20000, ephemeral_low) if ephemeral_low > 21000 else (10000, 20000)


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
