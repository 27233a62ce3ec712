"""The KV connector a rank's launch config chooses: the one place that builds it (vLLM's
``KVConnectorFactory.create_connector`` in spirit).

A context or generation rank moves KV through NIXL: ``dwdp.worker.disagg.transfer.KvTransfer``
(its agent, the leases, the HTTP side channel on the rank's own address and port). With
``kvTransfer.vllm`` the other tier is vLLM, and the rank's role picks the side that speaks to
it: a context rank serves vLLM decode servers (``vllm_nixl.VllmProducer``: the staging buffer
and vLLM's ZMQ side channel on port ``sideChannelPort + local_rank``), a generation rank reads
from vLLM prefill servers (``vllm_reader.VllmReader``). The engine builds its connector once its
paged KV cache exists (``ContinuousEngine.attach_kv_transfer``, handed this factory by
``dwdp.worker.main``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dwdp.api.enums import Role
from dwdp.worker.apikey import ApiKey
from dwdp.worker.disagg.agent import KvAgent
from dwdp.worker.disagg.transfer import KvTransfer

if TYPE_CHECKING:
    from dwdp.api.launch import LaunchConfig
    from dwdp.worker.disagg.vllm_nixl import VllmProducer
    from dwdp.worker.disagg.vllm_reader import VllmReader
    from dwdp.worker.engine.paged import PagedKVCache
    from dwdp.worker.memory import Staging

log = logging.getLogger(__name__)


def create_kv_connector(
    cache: PagedKVCache,
    cfg: LaunchConfig,
    *,
    model_name: str,
    num_layers: int,
    host: str,
    port: int,
    api_key: ApiKey,
    local_rank: int = 0,
    staging: Staging | None = None,
    draft_layers: int = 0,
) -> KvTransfer:
    """The KV connector of a context or generation rank (``cfg.role``) over ``cache``: a
    ``KvTransfer`` whose side channel is ``host``:``port`` (the address the rank advertises),
    with ``kvTransfer.vllm`` its vLLM side too (module docstring). ``staging``: the vLLM
    staging buffer the pool was sized beside (``dwdp.worker.main.resolve_kv_staging``; given
    with ``kvTransfer.vllm``). ``draft_layers``: the MTP layer's cache layers after the
    model's ``num_layers`` (``engine.speculative.method: mtp``), moved with them. Logs what
    it built. Raises ``TransferError`` (NIXL, ZMQ) or ``VllmInteropError`` (a cache vLLM's
    servers cannot share), one line each."""
    lease_s = float(cfg.kv_cache.transfer_lease_seconds)
    producer, reader = _vllm_side(cache, cfg, num_layers=num_layers, host=host,
                                  lease_s=lease_s, local_rank=local_rank, staging=staging)
    kv = KvTransfer(
        KvAgent(cache, model=model_name, num_layers=num_layers, draft_layers=draft_layers),
        host=host, port=port, api_key=api_key, lease_s=lease_s, vllm=producer,
        vllm_reader=reader,
    )
    _log_ready(kv, cfg, local_rank)
    return kv


def _vllm_side(
    cache: PagedKVCache,
    cfg: LaunchConfig,
    *,
    num_layers: int,
    host: str,
    lease_s: float,
    local_rank: int,
    staging: Staging | None,
) -> tuple[VllmProducer | None, VllmReader | None]:
    """``(producer, reader)``: with ``kvTransfer.vllm`` a generation rank's ``VllmReader`` or
    a context rank's ``VllmProducer`` (the other one ``None``); without it neither."""
    vllm = cfg.kv_transfer.vllm
    if vllm is None:
        return None, None
    from dwdp.worker.disagg.vllm_layout import block_size_for
    from dwdp.worker.disagg.vllm_nixl import VllmInterop, VllmProducer
    from dwdp.worker.disagg.vllm_reader import VllmReader

    interop = VllmInterop(model=vllm.model or cfg.model.path, version=vllm.version,
                          port=vllm.side_channel_port + local_rank,
                          hma=vllm.hybrid_kv_cache_manager,
                          cpu_kernel=vllm.cpu_attention_kernel)
    assert staging is not None  # resolve_kv_staging gives one with kvTransfer.vllm
    if cfg.role is Role.GENERATION:
        return None, VllmReader(cache, interop, num_layers=num_layers,
                                staging_tokens=staging.tokens)
    return VllmProducer(
        cache, interop, num_layers=num_layers, host=host, lease_s=lease_s,
        staging_blocks=staging.tokens // block_size_for("cpu"),
        staging_setting=staging.setting), None


def _log_ready(kv: KvTransfer, cfg: LaunchConfig, local_rank: int) -> None:
    """Log the connector built: its NIXL agent and side channel; a vLLM producer's line names
    vLLM's ZMQ side channel instead, and a vLLM reader's agent and hash come first."""
    vllm = cfg.kv_transfer.vllm
    if vllm is not None and kv.vllm_reader is not None:
        log.info("KV transfer ready to read vLLM %s prefill servers: NIXL agent %s (vLLM), "
                 "compatibility hash %s", vllm.version, kv.vllm_reader.engine_id,
                 kv.vllm_reader.hash)
    elif vllm is not None and kv.vllm is not None:
        log.info("KV transfer ready for vLLM %s decode servers: NIXL agent %s, ZMQ side "
                 "channel %s:%d", vllm.version, kv.vllm.engine_id, kv.host,
                 vllm.side_channel_port + local_rank)
        return
    log.info("KV transfer ready: NIXL agent %s, side channel %s:%d",
             kv.endpoint.engine_id, kv.host, kv.port)
