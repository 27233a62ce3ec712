"""Ask the ranks for ``/dwdp/status`` (rank k of a pod on port base+k).

Pods that run and whose commit gate is still closed are asked at every cycle. Committed
groups (gate open) are asked once every :data:`VERIFY_INTERVAL_S`, so the operator sees a
rank that is no longer the process that committed (another start id): at rest that is one
request per rank every 30 s (2 per rank per minute), and no write. An unreachable rank or an
unreadable answer reads as None (not reported yet).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from dwdp.operator.observe import ObservedPod, RankReport, rank_report_from_json

__all__ = ["PROBE_TIMEOUT_S", "VERIFY_INTERVAL_S", "probe_ranks", "to_probe"]

PROBE_TIMEOUT_S = 3.0
"""Timeout of one rank's status request, in seconds (a loaded host answers slowly; a
rank that misses it only reads as not reported yet for this cycle)."""


VERIFY_INTERVAL_S = 30.0
"""Seconds between two looks at the ranks of committed groups (their start ids)."""


def to_probe(pods: Iterable[ObservedPod], *, verify: bool = False) -> list[ObservedPod]:
    """The pods whose ranks are asked: running, addressed, live, and gate closed (or,
    with ``verify``, open too); never a vLLM server's (it answers no ``/dwdp/status``: its
    readiness stands for its report, :meth:`~dwdp.operator.observe.ObservedPod.vllm_report`)."""
    return [
        p
        for p in pods
        if p.phase == "Running"
        and p.ip
        and p.live
        and p.started
        and not p.vllm
        and (verify or not p.gate)
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
