"""What an engine counts and what it publishes about itself.

The engine thread keeps its counters in ``EngineStats``. The server reads neither them nor any
other field of the engine: as vLLM's engine core publishes its ``SchedulerStats`` (with its
``PrefixCacheStats``) to its stat loggers, an engine publishes an ``EngineSnapshot``
(``EngineClient.snapshot``), a copy of its counters with what else the server reports of it.
``/dwdp/status`` (``dwdp.worker.server.status``) and ``/metrics`` (``dwdp.worker.server.metrics``,
``dwdp.worker.server.vllm_metrics``) read snapshots only.
"""

from __future__ import annotations

from dataclasses import dataclass

from dwdp.worker.engine.speculative import SpeculativeConfig


@dataclass(slots=True)
class EngineStats:
    """Counters since start, kept by the engine thread (tests and benches read them in place;
    the server reads copies, ``EngineSnapshot``)."""

    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    forward_passes: int = 0
    forward_seconds: float = 0.0
    waves: int = 0
    """Waves of the wave engine; steps of the continuous engine."""
    preemptions: int = 0
    kv_tokens_in_use: int = 0
    """KV cache tokens held by running requests (a gauge, not a counter)."""
    requests_running: int = 0
    """Requests in the running set (a gauge; the continuous engine)."""
    requests_waiting: int = 0
    """Requests queued for a step (a gauge; the continuous engine)."""
    kv_leases: int = 0
    """Remote-decode prefills whose blocks wait for the generation side (a gauge)."""
    remote_prefill_tokens: int = 0
    """Prompt tokens whose KV was read from a context server (a counter)."""
    graph_replays: int = 0
    """Decode and verify steps run as a CUDA graph replay (a counter;
    ``EngineConfig.cuda_graphs``)."""
    piecewise_replays: int = 0
    """Other steps run as piecewise graph replays (a counter; ``dwdp.worker.engine.piecewise``)."""
    prefix_cache_queries: int = 0
    """Prompt tokens of requests looked up in the prefix cache (a counter; vLLM's name)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached and not computed again (a counter; vLLM's name)."""
    kv_blocks_cached: int = 0
    """Blocks the prefix cache holds, in use or free (a gauge)."""
    spec_drafts: int = 0
    """Speculative decoding (counters, vLLM's ``vllm:spec_decode_*``): request steps that
    proposed at least one draft token."""
    spec_draft_tokens: int = 0
    """Draft tokens proposed."""
    spec_accepted_tokens: int = 0
    """Draft tokens accepted (the target model chose them)."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Per draft position ``i``: drafts whose token ``i`` was accepted (a new tuple per
    change, so that a snapshot's copy never changes under its reader)."""

    def observe_draft(self, proposed: int, accepted: int) -> None:
        """One request's speculative step: ``proposed`` drafts, the first ``accepted`` of
        them taken."""
        if proposed == 0:
            return
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        per = list(self.spec_accepted_per_pos)
        per.extend([0] * (proposed - len(per)))
        for i in range(accepted):
            per[i] += 1
        self.spec_accepted_per_pos = tuple(per)

    def spec_accepted_at(self, positions: int) -> list[int]:
        """Accepted drafts per draft position ``0`` to ``positions - 1`` (0 where no draft
        reached yet)."""
        per = list(self.spec_accepted_per_pos[:positions])
        return per + [0] * (positions - len(per))

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; ``None`` before the first draft."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens \
            else None


@dataclass(frozen=True, slots=True)
class KvCacheShape:
    """An engine's paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens (vLLM's
    ``cache_config_info`` labels ``block_size`` and ``num_gpu_blocks``)."""

    block_size: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """An engine at one moment, as it publishes itself (module docstring).

    ``stats``: a copy of its counters; ``prefix_caching``: whether it caches prompt prefixes
    (``EngineConfig.prefix_caching``); ``kv_cache``: its paged KV cache's shape (``None``: it
    has none, as the wave engine); ``failure``: the error that killed it, as
    ``"Type: message"`` (``None`` while it can serve); ``speculative``: its speculative
    decoding (``EngineConfig.speculative``; ``None``: off).
    """

    stats: EngineStats
    prefix_caching: bool
    kv_cache: KvCacheShape | None = None
    failure: str | None = None
    speculative: SpeculativeConfig | None = None
