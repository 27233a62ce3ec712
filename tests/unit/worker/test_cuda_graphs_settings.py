"""``engine.cudaGraphs`` on the worker: resolved once (``resolve_cuda_graphs``), and the graphs'
memory taken out of the KV pool (``size_rank_memory``, the ledger's ``cuda_graphs`` part)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dwdp.api.enums import Role
from dwdp.api.launch import KvCacheConfig
from dwdp.api.support import CUDA_GRAPHS_WITH_DWDP
from dwdp.worker import memory
from dwdp.worker.memory import MemoryWatch, Placed, RankMemory, size_rank_memory
from dwdp.worker.settings import CudaGraphsError, resolve_cuda_graphs

GPU, CPU = "cuda:0", "cpu"


@pytest.mark.parametrize(
    ("role", "device", "dwdp", "on"),
    [
        (Role.GENERATION, GPU, False, True),  # the one case unset means on
        (Role.GENERATION, CPU, False, False),
        (Role.CONTEXT, GPU, False, False),
        (Role.CONTEXT, GPU, True, False),
        (Role.AGGREGATED, GPU, False, False),
        (None, GPU, False, False),
    ],
)
def test_unset_is_on_only_for_a_generation_server_on_cuda(role, device, dwdp, on) -> None:
    assert resolve_cuda_graphs(None, role=role, device=device, dwdp_enabled=dwdp) is on


@pytest.mark.parametrize("role", [Role.CONTEXT, Role.GENERATION])
def test_false_is_off_and_true_is_on_where_it_can_run(role) -> None:
    for device in (GPU, CPU):
        assert resolve_cuda_graphs(False, role=role, device=device, dwdp_enabled=True) is False
    assert resolve_cuda_graphs(True, role=role, device=GPU, dwdp_enabled=False) is True


def test_true_off_cuda_is_refused_naming_the_field_and_the_device() -> None:
    with pytest.raises(CudaGraphsError) as info:
        resolve_cuda_graphs(True, role=Role.GENERATION, device=CPU, dwdp_enabled=False)
    assert str(info.value) == (
        "engine.cudaGraphs: CUDA graphs need a CUDA device; this rank runs on cpu; leave it "
        "unset or false (got true)"
    )


def test_true_with_dwdp_is_refused_with_the_api_words() -> None:
    with pytest.raises(CudaGraphsError) as info:
        resolve_cuda_graphs(True, role=Role.CONTEXT, device=GPU, dwdp_enabled=True)
    assert str(info.value) == f"engine.cudaGraphs: {CUDA_GRAPHS_WITH_DWDP.rule} (got true)"
    assert "prefetch schedule runs host hooks" in str(info.value)


# -- the memory ledger -------------------------------------------------------------------------


class _Dwdp:
    committed = True

    def status(self) -> dict:
        return {}

    def buffer_ranges(self) -> list[tuple[int, int]]:
        return []


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    text = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=8
    )
    model.config = SimpleNamespace(get_text_config=lambda: text)  # type: ignore[assignment]
    model.dtype = torch.float32  # type: ignore[assignment]
    return model


@pytest.fixture
def on_a_fake_gpu(monkeypatch):
    """``size_rank_memory`` on a GPU without one: each profiling forward of N tokens "adds"
    1000 * N bytes, and the device has 1 MB free before the headroom it is told to keep."""
    forwards: list[int] = []
    kept: list[int] = []

    def headroom(model, tokens):
        forwards.append(tokens)
        return 1000 * tokens

    def free(device, *, dwdp_device_bytes, headroom, host_sharers=1, budget=None):
        kept.append(headroom)
        return 1_000_000 - headroom

    monkeypatch.setattr(memory, "activation_headroom", headroom)
    monkeypatch.setattr(memory, "free_for_kv_bytes", free)
    monkeypatch.setattr(memory, "warn_if_shared", lambda *a: False)
    return forwards, kept


def _size(cuda_graphs: bool):
    watch = MemoryWatch(GPU)
    watch.parts["peak_load"] = Placed(1, 2)
    return size_rank_memory(
        _model(),
        _Dwdp(),
        watch,
        kv=KvCacheConfig(freeMemoryFraction=1.0),
        max_num_tokens=256,
        max_model_len=128,
        cuda_graphs=cuda_graphs,
        max_batch_size=32,
    ), watch


def test_the_graphs_estimate_comes_out_of_the_kv_pool(on_a_fake_gpu) -> None:
    forwards, kept = on_a_fake_gpu
    (pool_off, ledger_off), _ = _size(cuda_graphs=False)
    assert forwards == [128] and kept == [128_000]
    assert ledger_off.cuda_graphs == Placed(0, 0)
    (pool_on, ledger_on), watch = _size(cuda_graphs=True)
    # a second forward, of the largest bucket's tokens: the piecewise graphs' (maxNumTokens
    # within maxModelLen, 128), above the decode graphs' (maxBatchSize, 32)
    assert forwards == [128, 128, 128] and kept[-1] == 128_000 + 128_000
    assert ledger_on.cuda_graphs == Placed(host=0, device=128_000)
    assert ledger_on.activations_headroom == ledger_off.activations_headroom
    assert pool_off.nbytes - pool_on.nbytes >= 128_000 - pool_on.bytes_per_token
    assert watch.parts["cuda_graphs"] == Placed(host=0, device=128_000)


def test_the_measured_graph_pool_replaces_the_estimate(on_a_fake_gpu) -> None:
    (pool, ledger), _ = _size(cuda_graphs=True)
    measured = ledger.with_cuda_graphs(20_480)
    assert measured.cuda_graphs == Placed(host=0, device=20_480)
    assert measured.kv_pool == ledger.kv_pool  # the pool was sized once, with the estimate
    shown = RankMemory(measured, pool).status(0)["memory"]
    assert shown["cuda_graphs"] == {"host": 0, "device": 20_480}
    assert list(shown)[-5:] == ["cuda_graphs", "kv_pool", "kv_staging", "runtime", "api_process"]


def test_an_engine_off_cuda_refuses_to_capture_graphs(tmp_path) -> None:
    """The engine's own guard (the worker refuses the setting earlier): no capture starts on
    the CPU, and the error is one line naming the device."""
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.graphs import CudaGraphError
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp_dev.worker.checkpoint import make_checkpoint

    model, tok = load_checkpoint(make_checkpoint("qwen3_moe", tmp_path / "m", num_experts=4))
    engine = ContinuousEngine(model, tok, model_name="tiny",
                              config=EngineConfig(max_model_len=32, cuda_graphs=True))
    with pytest.raises(CudaGraphError, match=r"^engine\.cudaGraphs: the model is on cpu; CUDA "
                                             r"graphs need a CUDA device$"):
        engine.capture_cuda_graphs()
    assert engine.runner.graphs is None and engine.runner.pieces is None
