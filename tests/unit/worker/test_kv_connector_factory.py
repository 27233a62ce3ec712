"""The KV connector factory (``dwdp.worker.disagg.factory``) through the worker's wiring
(``dwdp.worker.main.attach_kv_transfer``) without ``kvTransfer.vllm``: a context or generation
rank gets NIXL's ``KvTransfer`` alone, its side channel on the address the rank advertises.
(``kvTransfer.vllm``'s two sides: ``test_vllm_interop``.)"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from dwdp.api.launch import LaunchConfig  # noqa: E402
from dwdp.worker.apikey import ApiKey  # noqa: E402
from dwdp.worker.disagg.transfer import KvTransfer  # noqa: E402
from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.main import attach_kv_transfer  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import free_port  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4,
                           num_layers=2, hidden_size=64, head_dim=32, moe_width=32)


@pytest.mark.parametrize("role", ["context", "generation"])
def test_without_vllm_each_role_gets_nixls_connector_on_the_advertised_address(
    checkpoint, role, monkeypatch, caplog
):
    monkeypatch.setenv("DWDP_POD_IP", "127.0.0.1")
    model, tok = load_checkpoint(checkpoint)
    engine = ContinuousEngine(model, tok, model_name="m", config=EngineConfig(max_model_len=128))
    cfg = LaunchConfig.model_validate({"model": {"path": str(checkpoint)}, "role": role})
    port = free_port()
    with caplog.at_level(logging.INFO, logger="dwdp.worker.disagg.factory"):
        attach_kv_transfer(engine, cfg, "0.0.0.0", port, ApiKey(None), local_rank=1)
    kv = engine.kv
    try:
        assert isinstance(kv, KvTransfer)
        assert kv.vllm is None and kv.vllm_reader is None
        assert (kv.endpoint.host, kv.endpoint.port) == ("127.0.0.1", port)
        assert kv.lease_s == cfg.kv_cache.transfer_lease_seconds
        factory = [r for r in caplog.records if r.name == "dwdp.worker.disagg.factory"]
        assert [r.getMessage() for r in factory] == [
            f"KV transfer ready: NIXL agent {kv.endpoint.engine_id}, side channel "
            f"127.0.0.1:{port}"]
    finally:
        if kv is not None:
            kv.close()
