"""Ask the ranks of starting groups for ``/dwdp/status`` (rank k of a pod on port base+k).

Only pods that run and whose commit gate is still closed are asked: a committed group is
watched through its pods (readiness probes, exits), so a deployment at rest costs no HTTP
request here. An unreachable rank or an unreadable answer reads as None (not reported yet).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from dwdp.operator.observe import ObservedPod, RankReport, rank_report_from_json

__all__ = ["PROBE_TIMEOUT_S", "probe_ranks", "to_probe"]

PROBE_TIMEOUT_S = 3.0
"""Timeout of one rank's status request, in seconds (a loaded host answers slowly; a
rank that misses it only reads as not reported yet for this cycle)."""


def to_probe(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    """The pods whose ranks are asked: running, addressed, live, gate closed."""
    return [
        p for p in pods if p.phase == "Running" and p.ip and p.live and not p.gate and p.started
    ]


async def _get_json(
    session: aiohttp.ClientSession, host: str, port: int, path: str
) -> object | None:
    """The JSON body of ``GET http://host:port/path``; None for any failure (refused,
    timed out, not 200, not JSON): a rank that cannot answer has not reported yet."""
    try:
        async with session.get(f"http://{host}:{port}{path}") as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def probe_ranks(
    pods: Iterable[ObservedPod], *, base_port: int, timeout: float = PROBE_TIMEOUT_S
) -> dict[str, tuple[RankReport | None, ...]]:
    """Reports of every rank of ``pods`` by pod name, in local-rank order."""
    pods = list(pods)
    if not pods:
        return {}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        jobs = [
            _get_json(session, p.ip or "", base_port + k, "/dwdp/status")
            for p in pods
            for k in range(p.ranks)
        ]
        answers = iter(await asyncio.gather(*jobs))
    return {
        p.name: tuple(rank_report_from_json(next(answers)) for _ in range(p.ranks)) for p in pods
    }
