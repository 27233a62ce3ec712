"""vLLM's metric names for a rank's metrics, so that what reads a vLLM server reads a dwdp
rank without overrides: llm-d's endpoint picker (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``),
vllm-router and Grafana dashboards made for vLLM.

One collector re-exports the project's own families (``dwdp_*``, the one place they are
counted) under vLLM's names, each sample with vLLM's ``model_name`` label added; nothing is
counted twice. ``vllm:cache_config_info`` is an info gauge (value 1) whose labels carry the
KV cache's shape as vLLM's ``CacheConfig`` names it. With speculative decoding on (the
snapshot's ``speculative``), vLLM 0.32's ``vllm:spec_decode_*`` counters, with its help
strings, read from the snapshot's counters (they have no ``dwdp_*`` twin: counted once, here);
without it they are absent, as on a vLLM server without ``--speculative-config``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from dwdp.worker.engine.protocol import EngineClient
    from dwdp.worker.engine.stats import EngineSnapshot

VLLM_NAMES: dict[str, str] = {
    "dwdp_num_requests_running": "vllm:num_requests_running",
    "dwdp_num_requests_waiting": "vllm:num_requests_waiting",
    "dwdp_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "dwdp_prompt_tokens": "vllm:prompt_tokens",
    "dwdp_generation_tokens": "vllm:generation_tokens",
    "dwdp_num_preemptions": "vllm:num_preemptions",
    "dwdp_prefix_cache_queries": "vllm:prefix_cache_queries",
    "dwdp_prefix_cache_hits": "vllm:prefix_cache_hits",
    "dwdp_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "dwdp_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "dwdp_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
"""The project's family name -> vLLM's (families without a vLLM twin are not mirrored)."""

SPEC_DECODE_DOCS: dict[str, str] = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}
"""vLLM 0.32's speculative-decoding counters and their help strings (``SpecDecodingProm``)."""


class VllmNames:
    """A Prometheus collector: the families of ``sources`` named in :data:`VLLM_NAMES`,
    renamed, with ``model_name`` (``engine``'s) added to every sample; and
    ``vllm:cache_config_info`` of the paged KV cache ``engine`` publishes (its snapshot's
    ``kv_cache`` and ``prefix_caching``), when it has one; the ``vllm:spec_decode_*`` counters
    when its snapshot has ``speculative``."""

    def __init__(self, engine: EngineClient | None, sources: Iterable[Any]) -> None:
        self.engine = engine
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        model = "" if self.engine is None else self.engine.model_name
        for source in self.sources:
            for family in source.collect():
                name = VLLM_NAMES.get(family.name)
                if name is None:
                    continue
                renamed = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    renamed.add_sample(
                        name + sample.name[len(family.name):],
                        {**sample.labels, "model_name": model},
                        sample.value, sample.timestamp, sample.exemplar,
                    )
                yield renamed
        snapshot = None if self.engine is None else self.engine.snapshot()
        info = self._cache_config_info(snapshot)
        if info is not None:
            yield info
        yield from _spec_decode(snapshot, model)

    @staticmethod
    def _cache_config_info(snapshot: EngineSnapshot | None) -> GaugeMetricFamily | None:
        if snapshot is None or snapshot.kv_cache is None:
            return None
        labels = {
            "block_size": str(snapshot.kv_cache.block_size),
            "num_gpu_blocks": str(snapshot.kv_cache.num_blocks),
            "enable_prefix_caching": str(snapshot.prefix_caching),
        }
        family = GaugeMetricFamily("vllm:cache_config_info",
                                   "The KV cache's configuration, as vLLM's cache_config_info.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        return family


def _spec_decode(snapshot: EngineSnapshot | None, model: str) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (:data:`SPEC_DECODE_DOCS`) of ``snapshot``, none
    when it has no ``speculative``: one ``..._per_pos`` series per draft position ``0`` to
    ``num_speculative_tokens - 1``, those no draft reached yet at 0."""
    if snapshot is None or snapshot.speculative is None:
        return
    stats = snapshot.stats
    for name, value in (
        ("vllm:spec_decode_num_drafts", stats.spec_drafts),
        ("vllm:spec_decode_num_draft_tokens", stats.spec_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", stats.spec_accepted_tokens),
    ):
        family = CounterMetricFamily(name, SPEC_DECODE_DOCS[name], labels=["model_name"])
        family.add_metric([model], value)
        yield family
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_pos = CounterMetricFamily(name, SPEC_DECODE_DOCS[name], labels=["model_name", "position"])
    accepted = stats.spec_accepted_at(snapshot.speculative.num_speculative_tokens)
    for pos, count in enumerate(accepted):
        per_pos.add_metric([model, str(pos)], count)
    yield per_pos
