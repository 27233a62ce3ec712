"""Ask the ranks of starting groups for ``/dwdp/status`` (rank k of a pod on port base+k).

Only pods that run and whose commit gate is still closed are asked: a committed group is
watched through its pods (readiness probes, exits), so a deployment at rest costs no HTTP
request here. An unreachable rank or an unreadable answer reads as None (not reported yet).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

from dwdp.operator.observe import ObservedPod, RankReport, rank_report_from_json

__all__ = ["PROBE_TIMEOUT_S", "probe_ranks", "to_probe"]

PROBE_TIMEOUT_S = 1.0
"""Timeout of one rank's status request, in seconds."""


def to_probe(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    """The pods whose ranks are asked: running, addressed, live, gate closed."""
    return [
        p for p in pods if p.phase == "Running" and p.ip and p.live and not p.gate and p.started
    ]


async def _get_json(host: str, port: int, path: str, timeout: float) -> object | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: */*\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(1 << 20), timeout)
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/") or b" 200 " not in head.split(b"\r\n", 1)[0] + b" ":
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


async def probe_ranks(
    pods: Iterable[ObservedPod], *, base_port: int, timeout: float = PROBE_TIMEOUT_S
) -> dict[str, tuple[RankReport | None, ...]]:
    """Reports of every rank of ``pods`` by pod name, in local-rank order."""
    pods = list(pods)
    jobs = [
        _get_json(p.ip or "", base_port + k, "/dwdp/status", timeout)
        for p in pods
        for k in range(p.ranks)
    ]
    answers = iter(await asyncio.gather(*jobs))
    return {
        p.name: tuple(rank_report_from_json(next(answers)) for _ in range(p.ranks)) for p in pods
    }
