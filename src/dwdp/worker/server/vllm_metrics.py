"""vLLM's metric names for a rank's metrics, so that what reads a vLLM server reads a dwdp
rank without overrides: llm-d's endpoint picker (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``),
vllm-router and Grafana dashboards made for vLLM.

One collector re-exports the project's own families (``dwdp_*``, the one place they are
counted) under vLLM's names, each sample with vLLM's ``model_name`` label added; nothing is
counted twice. ``vllm:cache_config_info`` is an info gauge (value 1) whose labels carry the
KV cache's shape as vLLM's ``CacheConfig`` names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from dwdp.worker.engine.protocol import EngineClient

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


class VllmNames:
    """A Prometheus collector: the families of ``sources`` named in :data:`VLLM_NAMES`,
    renamed, with ``model_name`` (``engine``'s) added to every sample; and
    ``vllm:cache_config_info`` of the paged KV cache ``engine`` publishes (its snapshot's
    ``kv_cache`` and ``prefix_caching``), when it has one."""

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
        info = self._cache_config_info()
        if info is not None:
            yield info

    def _cache_config_info(self) -> GaugeMetricFamily | None:
        snapshot = None if self.engine is None else self.engine.snapshot()
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
