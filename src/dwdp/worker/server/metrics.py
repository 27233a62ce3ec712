"""Prometheus metrics of one rank, in a registry of the app (never the global one).

Request counts and latency histograms are observed by the serving class; token counters and
the DWDP counters (bytes moved, slot waits, store bytes, leaks) are read from the snapshot the
engine publishes (``EngineClient.snapshot``) and the DWDP status source at scrape time by a
custom collector, so the hot path does no bookkeeping twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dwdp.worker.server.status import kv_tokens_in_use
from dwdp.worker.server.vllm_metrics import VllmNames
from dwdp.worker.status_source import DwdpStatusSource

if TYPE_CHECKING:
    from dwdp.worker.engine.protocol import EngineClient
    from dwdp.worker.engine.stats import EngineSnapshot
    from dwdp.worker.memory import RankMemory

PREFIX_QUERIES_DOC = "Prompt tokens looked up in the prefix cache, as vLLM's prefix_cache_queries."
PREFIX_HITS_DOC = "Of those, tokens found cached (not prefilled again), as vLLM's hits."

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ScrapeCollector:
    def __init__(
        self, engine: EngineClient | None, dwdp: DwdpStatusSource, memory: RankMemory | None
    ) -> None:
        self.engine = engine
        self.dwdp = dwdp
        self.memory = memory

    def _memory(self, snapshot: EngineSnapshot | None) -> Iterator[Metric]:
        if self.memory is None:
            return
        parts = GaugeMetricFamily(
            "dwdp_memory_bytes",
            "The rank's memory ledger: bytes by part (peak_load, replicated_weights, "
            "expert_store, dense_store, slot_rings, activations_headroom, cuda_graphs, kv_pool) "
            "and where (host, device); parts not measured are left out.",
            labels=["part", "where"],
        )
        for part, placed in self.memory.ledger.as_dict().items():
            for where, value in placed.items():
                if value is not None:
                    parts.add_metric([part, where], float(value))
        yield parts
        capacity = self.memory.kv_pool.capacity_tokens
        yield GaugeMetricFamily(
            "dwdp_kv_cache_capacity_tokens",
            "Tokens the KV cache pool holds (sized after the DWDP commit).",
            value=capacity,
        )
        yield GaugeMetricFamily(
            "dwdp_kv_cache_usage_perc",
            "Fraction (0-1) of the KV cache pool the running requests reserve, as vLLM's "
            "kv_cache_usage_perc.",
            value=kv_tokens_in_use(snapshot) / capacity,
        )

    def collect(self) -> Iterator[Metric]:
        snapshot = None if self.engine is None else self.engine.snapshot()
        if snapshot is not None:
            stats = snapshot.stats
            for name, doc, value in (
                ("dwdp_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
                ("dwdp_generation_tokens", "Tokens generated.", stats.generation_tokens),
                ("dwdp_forward_passes", "Model forward passes.", stats.forward_passes),
                ("dwdp_forward_seconds", "Seconds in model forwards.", stats.forward_seconds),
                ("dwdp_num_preemptions", "Requests preempted for KV blocks (recomputed "
                 "later), as vLLM's num_preemptions.", stats.preemptions),
                ("dwdp_remote_prefill_tokens", "Prompt tokens whose KV was read from a context "
                 "server (disaggregated serving).", stats.remote_prefill_tokens),
                ("dwdp_prefix_cache_queries", PREFIX_QUERIES_DOC, stats.prefix_cache_queries),
                ("dwdp_prefix_cache_hits", PREFIX_HITS_DOC, stats.prefix_cache_hits),
            ):
                yield CounterMetricFamily(name, doc, value=value)
            for name, doc, value in (
                ("dwdp_num_requests_running", "Requests in the engine's running set, as "
                 "vLLM's num_requests_running.", stats.requests_running),
                ("dwdp_num_requests_waiting", "Requests waiting for a step, as vLLM's "
                 "num_requests_waiting.", stats.requests_waiting),
                ("dwdp_kv_leases", "Prefilled requests whose KV blocks wait for their "
                 "generation server.", stats.kv_leases),
                ("dwdp_kv_blocks_cached", "KV blocks the prefix cache holds (in use or free).",
                 stats.kv_blocks_cached),
            ):
                yield GaugeMetricFamily(name, doc, value=value)
        status = self.dwdp.status()
        yield CounterMetricFamily(
            "dwdp_bytes_moved",
            "Bytes copied into prefetch slots (expert and dense) since commit.",
            value=status.get("bytes_moved", 0),
        )
        yield CounterMetricFamily(
            "dwdp_slot_waits",
            "Times compute waited for a prefetch slot's copy.",
            value=status.get("slot_waits", 0),
        )
        for name, doc in (
            ("bytes_stored", "Bytes of this rank's DWDP stores."),
            ("bytes_freed", "Replicated weight bytes DWDP returned."),
            ("leaks", "Originals still referenced after commit."),
            ("sm_reserve", "SMs the gather kernel holds while it runs."),
        ):
            yield GaugeMetricFamily(f"dwdp_{name}", doc, value=status.get(name, 0))
        committed = GaugeMetricFamily("dwdp_committed", "1 once DWDP setup committed.")
        committed.add_metric([], 1.0 if self.dwdp.committed else 0.0)
        yield committed
        yield from self._memory(snapshot)


class ServerMetrics:
    """The metrics of one app; ``registry`` is what ``/metrics`` renders.

    A rank serving through an API server process splits them (``dwdp.worker.server.
    api_process``): the API process counts the requests (``engine=False``), the rank reads its
    engine, DWDP and memory (``requests=False``), and the API process's ``/metrics`` renders
    both; no family is in both registries.
    """

    def __init__(
        self,
        engine: EngineClient | None,
        dwdp: DwdpStatusSource,
        memory: RankMemory | None = None,
        *,
        requests: bool = True,
        engine_families: bool = True,
    ) -> None:
        """``engine``: read for the snapshot it publishes (token and forward counters,
        ``EngineClient.snapshot``), when it publishes one; ``dwdp``: the DWDP status source;
        ``memory``: the ledger and KV pool, when the rank measured them. ``requests``: the
        request counts and latency histograms; ``engine_families``: the families read at
        scrape time."""
        self.registry = CollectorRegistry(auto_describe=True)
        sources: list[Any] = []
        if requests:
            self._request_families()
            sources += [self.latency, self.ttft, self.itl]
        if engine_families:
            scrape = _ScrapeCollector(engine, dwdp, memory)
            self.registry.register(scrape)
            sources.insert(0, scrape)
        self.registry.register(VllmNames(engine, sources))

    def _request_families(self) -> None:
        self.requests = Counter(
            "dwdp_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dwdp_request_latency_seconds",
            "End-to-end latency of generation requests, seconds.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "dwdp_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "dwdp_inter_token_latency_seconds",
            "Seconds between consecutive output updates of a request, per token, as vLLM's "
            "inter_token_latency_seconds.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class RequestCounter:
    """ASGI middleware counting ``dwdp_requests`` by route and status code as each answer
    starts. Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would pass every chunk of a
    streamed answer through a memory stream and a task switch on the event loop, the loop that
    also streams every other request's tokens."""

    def __init__(self, app: Callable[[Message, Receive, Send], Awaitable[None]],
                 metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "other")  # set by the router
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
