"""Expert + dense DWDP over a block-scaled FP8 checkpoint (DeepSeek-V3's format) on 2 real
rank processes over the cpu backend: greedy tokens and logits bitwise equal to one process
serving the same checkpoint dequantized to bfloat16, with the expert stores holding FP8 bytes
and their scales (at most 0.6x the bfloat16 run's bytes); and the same through ``dwdp
launch`` (a pod of 2 ranks serving HTTP).

Per architecture (DeepSeek-V3, Qwen3-MoE, Mixtral) the ranks run two scenarios in one group:
the FP8 checkpoint, then its dequantized bfloat16 twin, each loaded sharded and attached with
every dense storage moving (``dense_min_bytes=0``: the FP8 weights and their scales too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from _pods import launched_pod  # noqa: E402
from conftest import RENDEZVOUS_SECRET, read_records, run_group  # noqa: E402
from ports import free_port  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.sharded import load_sharded  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint  # noqa: E402

WORLD = 2
NUM_EXPERTS = 6
ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
KINDS = ("fp8", "bf16")
SCENARIOS = [(arch, kind) for arch in ARCHS for kind in KINDS]
PROMPTS = ("Hello world, the", "What is the capital of France? Paris is", "a")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _batch(tokenizer, rank: int) -> list[list[int]]:
    order = PROMPTS[rank:] + PROMPTS[:rank]
    return [tokenizer(p)["input_ids"] for p in order]


def _rank_main(rank: int, out: Path, group: str, port: int, checkpoints: dict) -> None:
    torch.set_num_threads(1)
    from dwdp.worker.backend.cpu import CpuBackend
    from dwdp.worker.bringup import attach
    from dwdp.worker.loading.validate import load_config
    from dwdp.worker.models import adapter_for
    from dwdp.worker.transport.base import RendezvousConfig
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                              secret=RENDEZVOUS_SECRET, address=("127.0.0.1", port),
                              timeout_s=120)
    with TcpStoreTransport(config) as transport:
        for index, (arch, kind) in enumerate(SCENARIOS):
            path = checkpoints[(arch, kind)]
            adapter = adapter_for(load_config(path))
            partition = expert_partition(NUM_EXPERTS, WORLD)
            model, tok, loaded = load_sharded(path, adapter=adapter, partition=partition,
                                              rank=rank)
            attachment = attach(model, adapter, backend=CpuBackend(
                group=group, incarnation=f"s{index}", rank=rank), transport=transport,
                partition=partition, enable_dense=True, num_slots=2, dense_min_bytes=0,
                loaded=loaded)
            tables = {p: str(t.dtype) for p, t in adapter.moe_layers(model)[0]
                      .expert_tensors().items()}
            engine = ContinuousEngine(model, tok, model_name=arch)
            results = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
            torch.save([(r.token_ids, torch.stack(r.logits)) for r in results],
                       out / f"out.{index}.{rank}.pt")
            (out / f"s{index}.{rank}.json").write_text(
                json.dumps({"status": attachment.status(), "tables": tables}))
            attachment.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        src = make_checkpoint(arch, root / f"{arch}-src", num_experts=NUM_EXPERTS, seed=5,
                              hidden_size=256, moe_width=128, dtype="bfloat16")
        out[(arch, "fp8")] = str(quantize_checkpoint(src, root / f"{arch}-fp8"))
        out[(arch, "bf16")] = str(dequantize_checkpoint(out[(arch, "fp8")], root / f"{arch}-bf16"))
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    torch.set_num_threads(1)
    refs = {}
    for arch in ARCHS:
        model, tok = load_checkpoint(checkpoints[(arch, "bf16")])
        for rank in range(WORLD):
            engine = ContinuousEngine(model, tok, model_name=arch)
            results = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
            refs[(arch, rank)] = [(r.token_ids, torch.stack(r.logits)) for r in results]
    return refs


@pytest.fixture(scope="module")
def run(tmp_path_factory, checkpoints):
    import uuid

    out = tmp_path_factory.mktemp("ranks")
    group = f"f{uuid.uuid4().hex[:10]}"
    port = free_port()
    run_group(out, group, WORLD, lambda rank, out: _rank_main(rank, out, group, port, checkpoints))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_group_answers_as_the_dequantized_checkpoint(run, references, arch):
    index = SCENARIOS.index((arch, "fp8"))
    for rank in range(WORLD):
        got = torch.load(run / f"out.{index}.{rank}.pt")
        want = references[(arch, rank)]
        assert len(got) == len(want) == len(PROMPTS)
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
            assert tokens == ref_tokens, (arch, rank)
            assert torch.equal(logits, ref_logits), (arch, rank)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_stores_hold_fp8_bytes_and_scales(run, arch):
    fp8 = read_records(run, f"s{SCENARIOS.index((arch, 'fp8'))}", WORLD)
    bf16 = read_records(run, f"s{SCENARIOS.index((arch, 'bf16'))}", WORLD)
    for rank in range(WORLD):
        status, tables = fp8[rank]["status"], fp8[rank]["tables"]
        assert status["phase"] == "committed" and status["leaks"] == 0
        assert tables == {"gate_up_proj": "torch.float8_e4m3fn",
                          "down_proj": "torch.float8_e4m3fn",
                          "gate_up_proj_scale_inv": "torch.float32",
                          "down_proj_scale_inv": "torch.float32"}
        ratio = (status["resident"]["expert"]["store_bytes"]
                 / bf16[rank]["status"]["resident"]["expert"]["store_bytes"])
        assert ratio <= 0.6, (arch, rank, ratio)
        # dense DWDP moved the FP8 attention weights and scales: its rows hold the FP8 bytes
        dense, bf16_dense = status["resident"]["dense"], bf16[rank]["status"]["resident"]["dense"]
        assert 0 < dense["sharded_bytes"] < 0.6 * bf16_dense["sharded_bytes"], (arch, rank)


@pytest.fixture(scope="module")
def pod(tmp_path_factory, checkpoints):
    launch = {
        "model": {"path": checkpoints[("deepseek_v3", "fp8")], "servedName": "tiny-fp8"},
        "handleType": "shm",
        "transport": "tcpStore",
        "dwdp": {"dwdpSize": WORLD, "enableDense": True, "numPrefetchSlots": 2},
        "gracefulShutdownTimeoutSeconds": 5,
    }
    with launched_pod(tmp_path_factory.mktemp("pod"), launch, WORLD) as (_proc, urls, *_):
        yield urls


def test_a_pod_serves_the_fp8_checkpoint_as_its_dequantized_twin(pod, checkpoints):
    import httpx

    torch.set_num_threads(1)
    model, tok = load_checkpoint(checkpoints[("deepseek_v3", "bf16")])
    prompt = PROMPTS[1]
    want = ContinuousEngine(model, tok, model_name="ref").run_batch(
        [tok(prompt)["input_ids"]], PARAMS)[0]
    for url in pod:
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        status = httpx.get(url + "/dwdp/status", timeout=10).json()
        assert status["phase"] == "committed"
        assert status["memory"]["expert_store"]["host"] > 0
