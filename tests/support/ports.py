"""Loopback ports for the servers tests start (``import ports``: ``tests/support`` is on
pytest's ``pythonpath``).

A port from ``bind(0)`` is one the kernel hands out from its ephemeral range, the range
outgoing connections take their source ports from; one port is safe to take that way, but a
block of consecutive ports (a pod's HTTP port per local rank) is not: ``port + 1`` may be, or
become before the server binds it, some connection's source port (CI once failed with
EADDRINUSE that way). Blocks are therefore drawn below the ephemeral range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """One loopback TCP port nobody is bound to now (from the kernel's ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive loopback TCP ports that all bind now, drawn at random
    from 10000 up to the start of the ephemeral range (``ip_local_port_range``), so they are
    disjoint from every port :func:`free_port` returns.

    Raises RuntimeError when 200 random draws found no such block.
    """
    low = int(_RANGE.read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10000, low - count)
        socks = [socket.socket() for _ in range(count)]
        try:
            for offset, s in enumerate(socks):
                s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free loopback ports between 10000 and {low}")
