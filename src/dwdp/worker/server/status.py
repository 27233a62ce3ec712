"""What the server reads about this rank (``/ready``, ``/dwdp/status``, metrics): its identity,
its engine's state, the status body.

The server reads the rank's DWDP state through the ``DwdpStatusSource`` protocol only
(``dwdp.worker.status_source``, below the server and the memory ledger alike).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dwdp.api.contract import Env, RankIdentity, RankStatus, StatusPhase, new_start_id
from dwdp.worker.engine.stats import EngineSnapshot

START_ID = new_start_id()
"""This process's start id (``/dwdp/status`` ``start_id``): new with every rank process."""


def rank_identity(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``start_id`` of this process, and ``group``, ``incarnation`` (an integer when it is
    one, e.g. ``"3"`` or ``"i3"``) and ``revision`` of this rank from the operator's
    environment (absent ones are left out)."""
    return _identity(environ).wire()


def _identity(environ: Mapping[str, str] | None) -> RankIdentity:
    env = os.environ if environ is None else environ
    ident = RankIdentity(start_id=START_ID)
    if env.get(Env.GROUP):
        ident.group = env[Env.GROUP]
    inc = env.get(Env.INCARNATION)
    if inc:
        digits = inc[1:] if inc[:1] in ("i", "I") else inc
        ident.incarnation = int(digits) if digits.isdigit() else inc
    if env.get(Env.REVISION):
        ident.revision = env[Env.REVISION]
    return ident


def server_identity(
    role: str | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Who this server is for the ``dwdp`` response field and the KV side channel: ``role``
    (the argument, else ``DWDP_ROLE``), and under the operator (``DWDP_GROUP`` set) ``group``,
    ``rank`` (``DWDP_RANK``: the launcher gives each local rank its own), ``incarnation`` and
    ``pod`` (the pod's hostname). Absent ones are left out."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if role or env.get(Env.ROLE):
        out["role"] = role or env[Env.ROLE]
    if env.get(Env.GROUP):
        out["group"] = env[Env.GROUP]
        rank = env.get(Env.RANK, "")
        if rank.isdigit():
            out["rank"] = int(rank)
        incarnation = _identity(env).incarnation
        if incarnation is not None:
            out["incarnation"] = incarnation
        if env.get("HOSTNAME"):
            out["pod"] = env["HOSTNAME"]
    return out


def engine_failure(snapshot: EngineSnapshot | None) -> str | None:
    """The engine's fatal error as text, or None while it can serve (or publishes nothing:
    ``EngineClient.snapshot``)."""
    return None if snapshot is None else snapshot.failure


def kv_tokens_in_use(snapshot: EngineSnapshot | None) -> int:
    """KV cache tokens the engine's running requests reserve (0 when it publishes nothing)."""
    return 0 if snapshot is None else snapshot.stats.kv_tokens_in_use


def prefix_cache_status(snapshot: EngineSnapshot | None) -> dict[str, Any] | None:
    """The prefix cache's books for ``/dwdp/status`` (None when the engine publishes nothing):
    ``enabled``, ``cached_blocks``, ``queries`` and ``hits`` (prompt tokens, since start) and
    ``hit_rate`` (hits / queries; None before the first query)."""
    if snapshot is None:
        return None
    stats = snapshot.stats
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {
        "enabled": snapshot.prefix_caching,
        "cached_blocks": stats.kv_blocks_cached,
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries else None,
    }


def speculative_status(snapshot: EngineSnapshot | None) -> dict[str, Any] | None:
    """Speculative decoding's books for ``/dwdp/status`` (None when it is off or the engine
    publishes nothing): the resolved ``method``, ``num_speculative_tokens`` and
    ``prompt_lookup_min``/``_max``; since start ``drafts`` (request steps that proposed
    drafts), ``draft_tokens``, ``accepted_tokens``, ``acceptance_rate`` (accepted / draft
    tokens; None before the first draft) and ``accepted_per_position`` (accepted drafts per
    draft position, one entry per position up to ``num_speculative_tokens``)."""
    if snapshot is None or snapshot.speculative is None:
        return None
    spec, stats = snapshot.speculative, snapshot.stats
    k = spec.num_speculative_tokens
    return {
        "method": spec.method,
        "num_speculative_tokens": k,
        "prompt_lookup_min": spec.prompt_lookup_min,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "drafts": stats.spec_drafts,
        "draft_tokens": stats.spec_draft_tokens,
        "accepted_tokens": stats.spec_accepted_tokens,
        "acceptance_rate": stats.spec_acceptance_rate,
        "accepted_per_position": stats.spec_accepted_at(k),
    }


def with_identity(
    status: dict[str, Any], identity: Mapping[str, Any] | None, failure: str | None = None
) -> dict[str, Any]:
    """``status`` plus the rank's identity; phase ``failed`` (with ``error``) when the
    engine died."""
    out = {**status, **(identity or {})}
    if failure is not None:
        out.update(RankStatus(phase=StatusPhase.FAILED, error=failure).wire())
    return out
