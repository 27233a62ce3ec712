"""/metrics under vLLM's names too (llm-d's endpoint picker and vLLM dashboards read them):
each mirrored family has the same samples as the project's own, with model_name added, and
vllm:cache_config_info describes the KV cache. A real server on 127.0.0.1. And what
``/metrics`` and ``/dwdp/status`` read of an engine: the snapshot it publishes, nothing else."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families

from dwdp.worker.engine.stats import EngineSnapshot, EngineStats, KvCacheShape
from dwdp.worker.server.vllm_metrics import VLLM_NAMES
from dwdp_dev.worker.checkpoint import make_checkpoint
from dwdp_dev.worker.servers import EngineServer


def test_every_mirrored_family_reads_as_the_projects_own(tmp_path):
    ckpt = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=5)
    with EngineServer(ckpt, api_key="k", kv=False, max_model_len=64, block_size=4,
                      kv_capacity_tokens=256, model_name="tiny") as server:
        for _ in range(2):
            r = server.client.post("/v1/completions", json={
                "prompt": "hello there, how are you", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
        text = server.client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    mirrored = [ours for ours in VLLM_NAMES if ours in families]
    # the KV usage gauge needs the memory ledger (a worker's), which this server has not
    assert set(VLLM_NAMES) - set(mirrored) == {"dwdp_kv_cache_usage_perc"}
    for ours in mirrored:
        theirs = families[VLLM_NAMES[ours]]
        assert theirs.type == families[ours].type, ours
        want = sorted((s.name.replace(ours, VLLM_NAMES[ours], 1),
                       tuple(sorted({**s.labels, "model_name": "tiny"}.items())), s.value)
                      for s in families[ours].samples)
        got = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in theirs.samples)
        assert got == want, ours
    assert families["vllm:generation_tokens"].samples[0].value == 6
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels == {"block_size": "4", "num_gpu_blocks": "64",
                           "enable_prefix_caching": "True"}
    assert info.value == 1


class _Published:
    """An engine that publishes a given snapshot (the server reads nothing else of it)."""

    model_name = "pub"
    max_model_len = 64
    tokenizer = None
    kv = None

    def __init__(self, snapshot: EngineSnapshot) -> None:
        self.published = snapshot

    def snapshot(self) -> EngineSnapshot:
        return self.published


def test_status_and_metrics_read_the_snapshot_the_engine_publishes():
    from fastapi.testclient import TestClient

    from dwdp.worker.server.app import build_app

    stats = EngineStats(prompt_tokens=7, generation_tokens=5, prefix_cache_queries=8,
                        prefix_cache_hits=2, kv_blocks_cached=3, requests_running=1)
    engine = _Published(EngineSnapshot(stats, prefix_caching=False,
                                       kv_cache=KvCacheShape(block_size=16, num_blocks=9)))
    with TestClient(build_app(engine)) as client:
        status = client.get("/dwdp/status").json()
        families = {f.name: f for f in text_string_to_metric_families(
            client.get("/metrics").text)}
    assert status["prefix_cache"] == {"enabled": False, "cached_blocks": 3, "queries": 8,
                                      "hits": 2, "hit_rate": 0.25}
    assert "error" not in status and status["phase"] == "disabled"
    assert families["vllm:prompt_tokens"].samples[0].value == 7
    assert families["vllm:num_requests_running"].samples[0].labels == {"model_name": "pub"}
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "9",
                           "enable_prefix_caching": "False"}
    engine.published = EngineSnapshot(stats, prefix_caching=True, failure="RuntimeError: x")
    with TestClient(build_app(engine)) as client:
        status = client.get("/dwdp/status").json()
        text = client.get("/metrics").text
    assert (status["phase"], status["error"]) == ("failed", "RuntimeError: x")
    assert "vllm:cache_config_info" not in text  # no paged KV cache published


SPEC_HELP = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


def test_speculative_counters_and_status_read_the_snapshot():
    """With speculative decoding on, vLLM 0.32's spec_decode counters (its names, help strings
    and labels, a position series for every draft position from the start) and the status's
    ``speculative`` books come from the snapshot's counters; off, neither is there."""
    from fastapi.testclient import TestClient

    from dwdp.worker.engine.speculative import SpeculativeConfig
    from dwdp.worker.server.app import build_app

    stats = EngineStats()
    stats.observe_draft(3, 2)  # positions 0 and 1 accepted
    stats.observe_draft(2, 0)
    stats.observe_draft(3, 1)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    engine = _Published(EngineSnapshot(stats, prefix_caching=True, speculative=spec))
    with TestClient(build_app(engine)) as client:
        status = client.get("/dwdp/status").json()
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, doc in SPEC_HELP.items():
        assert families[name].type == "counter", name
        assert families[name].documentation == doc, name
    assert "vllm:spec_decode_num_drafts_total{model_name=\"pub\"} 3.0" in text
    values = {name: [(s.name, s.labels, s.value) for s in families[name].samples]
              for name in SPEC_HELP}
    assert values["vllm:spec_decode_num_drafts"] == [
        ("vllm:spec_decode_num_drafts_total", {"model_name": "pub"}, 3)]
    assert values["vllm:spec_decode_num_draft_tokens"][0][2] == 8
    assert values["vllm:spec_decode_num_accepted_tokens"][0][2] == 3
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos"] == [
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
         {"model_name": "pub", "position": str(pos)}, value)
        for pos, value in enumerate([2, 1, 0, 0])]
    assert status["speculative"] == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 3, "drafts": 3, "draft_tokens": 8, "accepted_tokens": 3,
        "acceptance_rate": 3 / 8, "accepted_per_position": [2, 1, 0, 0]}

    engine.published = EngineSnapshot(EngineStats(), prefix_caching=True, speculative=spec)
    with TestClient(build_app(engine)) as client:
        status = client.get("/dwdp/status").json()
        families = {f.name: f for f in text_string_to_metric_families(
            client.get("/metrics").text)}
    assert status["speculative"]["acceptance_rate"] is None  # no draft yet
    assert status["speculative"]["accepted_per_position"] == [0, 0, 0, 0]
    assert [s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples] \
        == [0, 0, 0, 0]

    engine.published = EngineSnapshot(stats, prefix_caching=True)  # off
    with TestClient(build_app(engine)) as client:
        status = client.get("/dwdp/status").json()
        text = client.get("/metrics").text
    assert "speculative" not in status
    assert "spec_decode" not in text
