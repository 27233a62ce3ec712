"""One worker rank, start to finish: ``dwdp worker --config FILE``.

Startup order (docs/design.md §6.1): read and validate the launch (role rules first, so a
generation server refuses dense DWDP before anything loads) -> check the checkpoint's headers,
its architecture adapter and the expert partition (one line naming the tensor or field) -> with
``kvTransfer.vllm``, whether vLLM's decode servers can share the KV cache
(``check_vllm_interop``) -> with DWDP, the host gate (``dwdp.worker.host``: the backend, the
handle type, the copy operations) and the copy settings resolved once
(``dwdp.worker.settings``), and whether the engine captures CUDA graphs
(``resolve_cuda_graphs``: ``engine.cudaGraphs`` on a device that cannot run them stops the rank
here) -> start the API server process (``ApiProcess``: a TMPDIR with no room for its sockets
stops the rank here; it loads the tokenizer while the model loads) -> join the group
(rendezvous) -> load the model (with expert DWDP only what the rank
keeps: ``load_model``; with a group every rank votes on the load, and a rank that failed fails
the group together: ``dwdp.worker.loading.load_vote``) -> DWDP setup (dense first, then experts;
commit) -> size the KV pool (once the API process has loaded; on the host from the
container's budget, ``dwdp.worker.host_memory``; beside the graphs' memory when they are on
and the vLLM staging buffer) -> the engine: KV
transfer, the CUDA graph capture, start -> serve HTTP (the API process told where the engine
is) until a signal. A fatal error anywhere
writes a one-line cause to the termination message path and exits non-zero; the engine is
stopped whatever happens.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from dwdp.api.contract import Env, Stage
from dwdp.api.enums import HandleType, Role
from dwdp.api.errors import Problem, problems_from_validation_error
from dwdp.api.launch import (
    LaunchConfig,
    LaunchError,
    dwdp_active,
    launch_warnings,
    resolve_role,
    served_model_name,
    validate_launch,
)
from dwdp.worker import rendezvous
from dwdp.worker.apikey import ApiKey
from dwdp.worker.disagg.vllm_layout import block_size_for
from dwdp.worker.engine.kv_events import KvEventPublisher
from dwdp.worker.engine.kv_pool import KvPool, check_max_tokens
from dwdp.worker.engine.speculative import DraftLayer, SpeculativeConfig
from dwdp.worker.gpu.cuda_path import use_cuda_kernels
from dwdp.worker.host import check_copy_ops, probe_host
from dwdp.worker.host_memory import env_limit
from dwdp.worker.loading.checkpoint import load_checkpoint
from dwdp.worker.loading.load_vote import load_together
from dwdp.worker.loading.mtp import has_mtp_layer
from dwdp.worker.loading.validate import expert_count, validate_checkpoint
from dwdp.worker.memory import (
    MemoryLedger,
    MemoryWatch,
    RankMemory,
    Staging,
    size_rank_memory,
)
from dwdp.worker.models import adapter_for
from dwdp.worker.server.run import (
    ApiProcess,
    StopBeforeServing,
    StopRequested,
    serve_with_api_process,
)
from dwdp.worker.server.status import rank_identity, server_identity
from dwdp.worker.settings import (
    CopySettings,
    resolve_copy_settings,
    resolve_cuda_graphs,
    resolve_dense_min_bytes,
    resolve_torch_threads,
)
from dwdp.worker.termination import one_line, write_termination_message

if TYPE_CHECKING:
    # names only annotations use; a module that loads torch, transformers, FastAPI or the
    # engine is imported in the function that runs it (a rank's start stays light)
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from dwdp.api.launch import KvEventsConfig
    from dwdp.api.partition import ExpertPartition
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.expert.layout import LoadedExperts
    from dwdp.worker.models.base import ArchitectureAdapter
    from dwdp.worker.status_source import DwdpStatusSource
    from dwdp.worker.transport.base import GroupTransport

log = logging.getLogger(__name__)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> bool:
    """Log ``message`` as a warning the first time it is seen in this process; returns
    whether it was logged."""
    with _warned_lock:
        if message in _warned:
            return False
        _warned.add(message)
    log.warning("%s", message)
    return True


def phased(stage: str, exc: BaseException) -> str:
    """The termination line ``<phase>: <ErrorType>: <message>`` the operator classifies
    failures by (the first word before ':'). The phase is the setup phase a ``SetupError``
    names, ``rendezvous`` for a transport timeout, ``config`` for the rendezvous secret file,
    otherwise the startup stage."""
    phase = getattr(exc, "phase", None)
    if stage == Stage.SETUP and isinstance(phase, str) and phase:
        stage = str(phase)
    elif type(exc).__name__ in ("RendezvousTimeout", "LoopbackAcrossHosts"):
        stage = Stage.RENDEZVOUS
    elif type(exc).__name__ == "RendezvousSecretError":
        stage = Stage.CONFIG
    return f"{stage}: {one_line(exc)}"


def with_memory(line: str, watch: MemoryWatch) -> str:
    """The termination line plus the memory measured so far (``; memory GiB ...``)."""
    summary = watch.summary()
    return f"{line}; {summary}" if summary else line


class WorkerStartupError(RuntimeError):
    """The worker cannot start; the message is the one-line cause."""


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Command-line options of one rank (``None``: from the config or the environment)."""

    config: str | None = None
    role: str | None = None
    host: str = "0.0.0.0"
    port: int | None = None
    termination_log: str | None = None


def load_launch_config(path: str | None) -> LaunchConfig:
    """Read the launch config YAML (``path`` or ``DWDP_CONFIG``) into a ``LaunchConfig``.

    Raises ``WorkerStartupError`` naming the file, or the first invalid field.
    """
    path = path or os.environ.get(Env.CONFIG)
    if not path:
        raise WorkerStartupError(f"no launch config: pass --config FILE or set {Env.CONFIG}")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkerStartupError(f"launch config {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise WorkerStartupError(
            f"launch config {path}: not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from exc
    except yaml.YAMLError as exc:
        raise WorkerStartupError(f"launch config {path}: {_yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise WorkerStartupError(f"launch config {path}: expected a mapping at the top level")
    try:
        return LaunchConfig.model_validate(data, by_name=False)
    except ValidationError as exc:
        first = problems_from_validation_error(exc, model=LaunchConfig)[0]
        raise WorkerStartupError(f"launch config {path}: {first}") from exc


def _yaml_problem(exc: Exception) -> str:
    """A YAML error in one line: ``line L column C: <problem>``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["invalid YAML"])[0]
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def check_launch(
    cfg: LaunchConfig, role_flag: str | None, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """Resolve the role (flag, config, ``DWDP_ROLE``; legacy ctx<N>/gen<N> in any case) and apply
    the launch rules that need no model. Returns the config with the role set.

    Raises ``WorkerStartupError`` (unknown role) or ``LaunchError`` (a broken rule; a
    generation server with enable_dense is refused here, before the model loads). A dense
    launch without the context role is warned about once.
    """
    try:
        role = resolve_role(role_flag if role_flag else cfg.role, environ)
    except ValueError as exc:
        raise WorkerStartupError(f"role: {exc}") from exc
    cfg = cfg.model_copy(update={"role": role})
    validate_launch(cfg)
    for message in launch_warnings(cfg, role):
        warn_once(message)
    return cfg


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """What the checkpoint check learned before any weight is read."""

    config: PretrainedConfig
    adapter: ArchitectureAdapter
    num_experts: int
    partition: ExpertPartition | None
    max_model_len: int
    kv_staging: Staging | None = None
    """The buffer the KV of the other tier passes through (vLLM interop), if any."""


def check_model(cfg: LaunchConfig) -> ModelPlan:
    """Check the checkpoint headers, the adapter (dense roots) and the expert partition.

    Raises ``CheckpointError`` (a tensor named), ``LaunchError`` (enable_dense on an
    architecture without dense roots) or ``PartitionError`` (a config the partition cannot
    split), each one line.
    """
    config = validate_checkpoint(cfg.model.path)
    adapter = adapter_for(config)  # the generic expert-only adapter without a match
    assert adapter is not None
    validate_launch(cfg, dense_roots=adapter.has_dense_roots)
    check_draft_layer(cfg, config)
    num_experts = expert_count(config)
    partition = None
    if cfg.dwdp.expert_dwdp:
        if num_experts == 0:
            raise WorkerStartupError(
                "dwdp.enableExperts: the model has no fused-experts MoE layer to distribute"
            )
        partition = cfg.dwdp.partition(num_experts)
    max_model_len = resolve_max_model_len(cfg, config)
    return ModelPlan(config, adapter, num_experts, partition, max_model_len,
                     resolve_kv_staging(cfg, max_model_len))


def mtp_drafts(cfg: LaunchConfig) -> bool:
    """Whether the rank drafts with the checkpoint's MTP layer (``engine.speculative``)."""
    spec = cfg.engine.speculative
    return spec is not None and spec.method == "mtp"


def check_draft_layer(cfg: LaunchConfig, config: PretrainedConfig) -> None:
    """``engine.speculative.method: mtp`` needs the checkpoint's MTP layer: ``LaunchError``
    naming the field when it holds none (``dwdp.worker.loading.mtp.has_mtp_layer``)."""
    if mtp_drafts(cfg) and not has_mtp_layer(cfg.model.path, config):
        kind = getattr(config, "model_type", "?")
        raise LaunchError(Problem(
            ("engine", "speculative", "method"), "mtp",
            f"needs the checkpoint's multi-token prediction layer; {cfg.model.path} ({kind}) "
            "holds none (num_nextn_predict_layers in config.json and the layer's tensors); "
            "use ngram"))


def load_draft_layer(cfg: LaunchConfig, model: PreTrainedModel) -> DraftLayer | None:
    """The checkpoint's MTP layer on the model's device and dtype, with the GPU kernels the
    model has (``use_cuda_kernels``), when ``engine.speculative.method`` is mtp
    (``dwdp.worker.loading.mtp``), else ``None``."""
    spec = cfg.engine.speculative
    if spec is None or not mtp_drafts(cfg):
        return None
    from dwdp.worker.loading.mtp import load_mtp  # torch

    layer = load_mtp(cfg.model.path, model.config, dtype=model.dtype, device=str(model.device))
    kernels = use_cuda_kernels(layer.block)  # the model's GPU kernels, as load_rank's
    log.info("engine: MTP layer %d loaded for drafts (%d per step)%s",
             model.config.num_hidden_layers, spec.num_speculative_tokens,
             f"; GPU path: {', '.join(kernels)}" if kernels else "")
    return layer


def resolve_kv_staging(cfg: LaunchConfig, max_model_len: int) -> Staging | None:
    """With ``kvTransfer.vllm``, the staging buffer the KV transfer allocates on the host
    beside the pool (``memory.Staging``): a context rank's holds ``stagingTokens`` (default
    the larger of ``max_model_len`` and 2 x ``maxNumTokens``) rounded up to whole blocks of
    vLLM's CPU layout; a generation rank's READ buffer ``STAGING_TOKENS``. Raises
    ``WorkerStartupError`` for a ``stagingTokens`` below one ``max_model_len`` request."""
    from dwdp.worker.disagg.vllm_reader import STAGING_TOKENS  # only with kvTransfer.vllm

    vllm = cfg.kv_transfer.vllm
    if vllm is None:
        return None
    if cfg.role is Role.GENERATION:
        return Staging(STAGING_TOKENS, f"the vLLM READ buffer of {STAGING_TOKENS} tokens")
    field = "kvTransfer.vllm.stagingTokens"
    tokens = vllm.staging_tokens or max(max_model_len, 2 * cfg.max_num_tokens)
    if tokens < max_model_len:
        raise WorkerStartupError(
            f"{field}: {tokens} tokens is less than one request of maxModelLen "
            f"{max_model_len} tokens (a prefill whose KV cannot be staged whole fails); raise "
            f"stagingTokens or lower maxModelLen"
        )
    block = block_size_for("cpu")  # check_vllm_interop: vLLM interop ranks are on the host
    setting = f"{field} {tokens}" if vllm.staging_tokens else f"{field} unset: {tokens}"
    return Staging(-(-tokens // block) * block, setting)


def check_vllm_interop(cfg: LaunchConfig, config: PretrainedConfig, device: str) -> None:
    """With ``kvTransfer.vllm``: the refusals of a KV cache vLLM's decode servers cannot
    share that the checkpoint's config shows, before the rendezvous and before any weight
    loads (``vllm_nixl.check_model_config`` for the model's dtype: ``model.dtype``, or the
    checkpoint's for ``auto``), and a rank whose cache would not be on the host (vLLM's CPU
    attention layout is the one staged). Raises ``VllmInteropError`` (one line)."""
    if cfg.kv_transfer.vllm is None:
        return
    from dwdp.worker.disagg.vllm_nixl import VllmInteropError, check_model_config

    if device != "cpu":
        raise VllmInteropError(
            f"kvTransfer.vllm: this rank's KV cache would be on {device}; only vLLM's CPU "
            "attention layout is staged: serve vLLM from a rank on the host (handleType shm)"
        )
    dtype: str = cfg.model.dtype
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
                    or "float32")
    check_model_config(config.get_text_config(), f"torch.{dtype.removeprefix('torch.')}",
                       cfg.kv_transfer.vllm.cpu_attention_kernel)


DEFAULT_MAX_MODEL_LEN = 2048
"""The context of a model whose config gives no ``max_position_embeddings``."""


def resolve_max_model_len(cfg: LaunchConfig, config: PretrainedConfig) -> int:
    """Prompt plus generated tokens of one request, at most: ``maxModelLen`` or the model's
    ``max_position_embeddings``; a ``kvCache.maxTokens`` below it is refused here, before
    the rendezvous. Raises ``WorkerStartupError`` (``maxModelLen`` above the model's
    context) or ``KvPoolError``."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if cfg.max_model_len is None:
        length = int(context or DEFAULT_MAX_MODEL_LEN)
    elif context and cfg.max_model_len > int(context):
        raise WorkerStartupError(
            f"maxModelLen: {cfg.max_model_len} is more than the model's "
            f"max_position_embeddings {context}"
        )
    else:
        length = cfg.max_model_len
    check_max_tokens(cfg.kv_cache, length)
    return length


def resolve_host_settings(
    cfg: LaunchConfig, local_rank: int, stage: dict[str, str]
) -> CopySettings:
    """With DWDP: the host gate, then the copy settings resolved once from the config and
    the host (``stage["now"]`` names the step for the termination message: ``host`` for
    the gate, ``config`` for a setting the host cannot run). Without DWDP: the defaults.

    Raises ``HostGateError`` or ``CopySettingsError``."""
    if not dwdp_active(cfg):
        return CopySettings()
    stage["now"] = Stage.HOST
    host = probe_host(cfg, device=local_rank)
    stage["now"] = Stage.CONFIG
    settings = resolve_copy_settings(cfg.dwdp, host)
    stage["now"] = Stage.HOST
    check_copy_ops(settings, host, device=local_rank)
    return settings


def _torch_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _device_for(cfg: LaunchConfig, local_rank: int) -> str:
    """``cpu`` for the shm handle type (the cpu backend); otherwise the local rank's GPU
    when CUDA is available."""
    if cfg.handle_type == HandleType.SHM:
        return "cpu"
    import torch

    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def load_model(
    cfg: LaunchConfig, plan: ModelPlan, group: GroupTransport | None, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, LoadedExperts | None]:
    """``(model, tokenizer, loaded)`` on ``device``. With expert DWDP (``plan.partition``
    and a group) a sharded load: the model without the managed experts, and ``loaded`` the
    rows of this rank's range (``dwdp.worker.loading.sharded``); otherwise the whole
    checkpoint and ``None``. Raises ``CheckpointError`` naming the file and the tensor."""
    if plan.partition is not None and group is not None:
        from dwdp.worker.loading.sharded import load_sharded  # torch

        return load_sharded(
            cfg.model.path,
            adapter=plan.adapter,
            partition=plan.partition,
            rank=group.rank,
            dtype=cfg.model.dtype,
            device=device,
        )
    model, tokenizer = load_checkpoint(cfg.model.path, dtype=cfg.model.dtype)
    if device != "cpu":
        model.to(device)
    return model, tokenizer, None


def advertised_host(host: str) -> str:
    """The rank's address for its peers: ``DWDP_POD_IP``; outside a pod the bind address, or
    loopback for a wildcard bind."""
    return os.environ.get(Env.POD_IP) or (
        host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    )


def attach_kv_events(engine: ContinuousEngine, events: KvEventsConfig | None,
                     host: str) -> Callable[[], None] | None:
    """Publish the engine's KV cache events (``kvCache.events``) before it starts; returns
    the publisher's ``close`` (None when unset). ``{pod_ip}`` and ``{model}`` in the topic
    become the rank's address and served name. Raises ``KvEventsError`` naming the endpoint
    when it cannot bind or connect."""
    if events is None:
        return None
    topic = events.topic.replace("{pod_ip}", advertised_host(host)).replace(
        "{model}", engine.model_name)
    medium = "GPU" if str(engine.model.device).startswith("cuda") else "CPU"
    publisher = KvEventPublisher(events.endpoint, topic, bind=events.binds,
                                 block_size=engine.allocator.block_size, medium=medium)
    engine.attach_kv_events(publisher)
    return publisher.close


def attach_kv_transfer(engine: ContinuousEngine, cfg: LaunchConfig, host: str, port: int,
                       api_key: ApiKey, local_rank: int = 0,
                       staging: Staging | None = None) -> None:
    """Give a context or generation rank the KV connector its launch config chooses
    (``dwdp.worker.disagg.factory.create_kv_connector``: NIXL, with ``kvTransfer.vllm`` a
    context rank's side for vLLM decode servers or a generation rank's reader of vLLM prefill
    servers); it advertises the pod's address (``DWDP_POD_IP``; the bind address, or loopback
    for a wildcard bind, outside a pod). ``staging``: the vLLM staging buffer the pool was
    sized beside (``resolve_kv_staging``)."""
    from dwdp.worker.disagg.factory import create_kv_connector  # NIXL's agent, asyncio

    advertise = advertised_host(host)
    layers = int(engine.model.config.get_text_config().num_hidden_layers)
    engine.attach_kv_transfer(lambda cache: create_kv_connector(
        cache, cfg, model_name=engine.model_name, num_layers=layers, host=advertise, port=port,
        api_key=api_key, local_rank=local_rank, staging=staging,
        draft_layers=0 if engine.mtp is None else 1))


def capture_cuda_graphs(engine: ContinuousEngine, ledger: MemoryLedger,
                        watch: MemoryWatch) -> MemoryLedger:
    """Capture the engine's decode graphs (after the KV transfer, before ``start``) and put
    their measured pool in the ledger in place of the estimate the KV pool was sized beside;
    ``watch`` keeps it. Raises ``CudaGraphError`` (one line)."""
    stats = engine.capture_cuda_graphs()
    estimate = ledger.cuda_graphs.device or 0
    ledger = ledger.with_cuda_graphs(stats.pool_bytes)
    watch.record(ledger)
    log.info(
        "CUDA graphs: decode buckets %s, piecewise token buckets %s, pool %d bytes (%.2f GiB; "
        "%.2f GiB reserved before the KV pool was sized)",
        ",".join(map(str, stats.buckets)),
        ",".join(map(str, stats.token_buckets)),
        stats.pool_bytes,
        stats.pool_bytes / 2**30,
        estimate / 2**30,
    )
    return ledger


def rank_settings(cfg: LaunchConfig, local_rank: int) -> tuple[bool, int, ApiKey]:
    """The settings this rank resolves once from its launch config and environment:
    ``engine.cudaGraphs`` (``resolve_cuda_graphs``), the dense storage threshold (bytes), the
    API key (a mounted file or a value); sets torch's threads (``DWDP_TORCH_THREADS``).
    Raises ``CudaGraphsError`` or ``WorkerEnvError`` naming the setting."""
    cuda_graphs = resolve_cuda_graphs(
        cfg.engine.cuda_graphs,
        role=cfg.role,
        device=_device_for(cfg, local_rank),
        dwdp_enabled=dwdp_active(cfg),
    )
    dense_min_bytes = resolve_dense_min_bytes(os.environ)
    api_key = ApiKey.from_env(os.environ, file_var=Env.API_KEY_FILE, value_var=Env.API_KEY)
    _torch_threads(resolve_torch_threads(os.environ))
    return cuda_graphs, dense_min_bytes, api_key


def load_rank(
    cfg: LaunchConfig, plan: ModelPlan, group: GroupTransport | None, watch: MemoryWatch
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, LoadedExperts | None]:
    """``(model, tokenizer, loaded)``: the checkpoint loaded with the group
    (``load_together``) under ``watch`` (a failed load's peak still goes into the
    termination message), with the GPU kernels in place (logged)."""
    watch.start()
    try:
        model, tokenizer, loaded = load_together(
            group, lambda: load_model(cfg, plan, group, watch.device), device=watch.device
        )
    finally:
        watch.end()
    for change in use_cuda_kernels(model):
        log.info("GPU path: %s", change)
    return model, tokenizer, loaded


def speculative_config(cfg: LaunchConfig) -> SpeculativeConfig | None:
    """``engine.speculative`` resolved once, vLLM's prompt-lookup defaults applied
    (``SpeculativeSpec.lookup_range``); None: off."""
    spec = cfg.engine.speculative
    if spec is None:
        return None
    low, high = spec.lookup_range()
    return SpeculativeConfig(
        method=spec.method,
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        per_batch_size=tuple(sorted((first, last, tokens) for first, last, tokens
                                    in spec.num_speculative_tokens_per_batch_size or ())),
    )


def engine_config(cfg: LaunchConfig, max_model_len: int, capacity_tokens: int,
                  cuda_graphs: bool) -> EngineConfig:
    """The engine's ``EngineConfig``: the launch config's limits and KV cache settings, the
    resolved context length, the sized pool (tokens), the resolved ``engine.cudaGraphs`` and
    ``engine.speculative`` (:func:`speculative_config`)."""
    from dwdp.worker.engine.base import EngineConfig  # the engine: asyncio, threads

    return EngineConfig(
        max_batch_size=cfg.max_batch_size,
        max_num_tokens=cfg.max_num_tokens,
        max_model_len=max_model_len,
        kv_capacity_tokens=capacity_tokens,
        block_size=cfg.kv_cache.block_size,
        cuda_graphs=cuda_graphs,
        prefix_caching=cfg.kv_cache.prefix_caching,
        speculative=speculative_config(cfg),
    )


def api_process_fields(cfg: LaunchConfig, engine: ContinuousEngine, host: str, port: int,
                       server: Mapping[str, object], api_key: ApiKey) -> dict[str, object]:
    """What the rank's API server process is told once the engine runs (``ApiProcessSpec``'s
    fields but the link's addresses; its tokenizer it loaded when it started): where to listen,
    the served names and limits, the KV endpoint, the rank's identity, the graceful-shutdown
    bound and the API key."""
    from dwdp.worker.server.api_process import key_fields  # FastAPI

    return {
        **key_fields(api_key),
        "host": host,
        "port": port,
        "model_name": engine.model_name,
        "served_name": cfg.model.served_name,
        "max_model_len": engine.max_model_len,
        "kv_endpoint": asdict(engine.kv.endpoint) if engine.kv is not None else None,
        "server": server,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
    }


def size_memory(model: PreTrainedModel, dwdp: DwdpStatusSource, watch: MemoryWatch,
                cfg: LaunchConfig, plan: ModelPlan,
                cuda_graphs: bool) -> tuple[KvPool, MemoryLedger]:
    """The rank's KV pool and memory ledger (``size_rank_memory``) from the launch config
    and the model plan (its context length and staging buffer): the pods' ranks on one host
    share its memory (``LOCAL_WORLD_SIZE``)."""
    return size_rank_memory(
        model,
        dwdp,
        watch,
        kv=cfg.kv_cache,
        max_num_tokens=cfg.max_num_tokens,
        max_model_len=plan.max_model_len,
        host_sharers=int(os.environ.get(Env.LOCAL_WORLD_SIZE) or 1),
        cuda_graphs=cuda_graphs,
        max_batch_size=cfg.max_batch_size,
        staging=plan.kv_staging,
        draft_layers=1 if mtp_drafts(cfg) else 0,
        draft_tokens=spec.num_speculative_tokens if (spec := cfg.engine.speculative) else 0,
    )


def make_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: LaunchConfig,
    config: EngineConfig,
    *,
    on_fatal_line: Callable[[BaseException], object],
    server_holder: dict[str, Callable[[], None]],
) -> tuple[ContinuousEngine, list[BaseException]]:
    """The rank's ``ContinuousEngine`` (not started) and the list its fatal error lands in:
    on one, ``on_fatal_line`` writes the termination message and serving is stopped
    (``server_holder["stop"]``, once ``serve_with_api_process`` set it)."""
    from dwdp.worker.engine.continuous import ContinuousEngine  # the engine: asyncio, threads

    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        on_fatal_line(exc)
        stop = server_holder.get("stop")
        if stop is not None:
            stop()

    engine = ContinuousEngine(
        model,
        tokenizer,
        model_name=served_model_name(cfg.model.served_name, cfg.model.path),
        config=config,
        on_fatal=on_fatal,
    )
    return engine, fatal


def run_worker(opts: WorkerOptions) -> int:
    """Run one rank until it is stopped; returns the exit status (0 clean, 1 fatal)."""
    stop_engine: Callable[[], None] | None = None
    api_process: ApiProcess | None = None
    close_events: Callable[[], None] | None = None
    group: GroupTransport | None = None
    stage: dict[str, str] = {"now": Stage.CONFIG}
    watch = MemoryWatch("cpu")
    stop_signals = StopBeforeServing(lambda: stage["now"] == Stage.SERVE)
    stopped = False
    try:
        cfg = check_launch(load_launch_config(opts.config), opts.role)
        env_limit()  # a DWDP_MEMORY_LIMIT that is no number of bytes stops the rank here
        local_rank = int(os.environ.get(Env.LOCAL_RANK, "0"))
        port = (opts.port if opts.port is not None else cfg.server_port) + local_rank
        stage["now"] = Stage.CHECKPOINT
        plan = check_model(cfg)
        stage["now"] = Stage.CONFIG
        check_vllm_interop(cfg, plan.config, _device_for(cfg, local_rank))
        settings = resolve_host_settings(cfg, local_rank, stage)
        stage["now"] = Stage.CONFIG
        cuda_graphs, dense_min_bytes, api_key = rank_settings(cfg, local_rank)
        # the API server process imports and loads the tokenizer while the model loads
        api_process = ApiProcess(str(cfg.model.path))
        from dwdp.worker.bringup import setup_dwdp  # torch
        from dwdp.worker.server.app import build_app  # FastAPI

        stage["now"] = Stage.RENDEZVOUS
        group = rendezvous.join_group(cfg)
        stage["now"] = Stage.LOAD
        watch = MemoryWatch(_device_for(cfg, local_rank))
        model, tokenizer, loaded = load_rank(cfg, plan, group, watch)
        draft = load_draft_layer(cfg, model)
        api_process.check()
        stage["now"] = Stage.SETUP
        dwdp = setup_dwdp(
            model,
            plan.adapter,
            cfg,
            group=group,
            settings=settings,
            dense_min_bytes=dense_min_bytes,
            loaded=loaded,
        )
        stage["now"] = Stage.ENGINE
        api_process.wait_loaded()  # its memory counts in what the pool is sized from
        pool, ledger = size_memory(model, dwdp, watch, cfg, plan, cuda_graphs)
        ledger = ledger.with_api_process(api_process.proc.pid)
        watch.record(ledger)
        server_holder: dict[str, Callable[[], None]] = {}
        engine, fatal = make_engine(
            model, tokenizer, cfg,
            engine_config(cfg, plan.max_model_len, pool.capacity_tokens, cuda_graphs),
            on_fatal_line=lambda exc: write_termination_message(
                with_memory(phased(Stage.ENGINE, exc), watch), opts.termination_log),
            server_holder=server_holder,
        )
        if draft is not None:
            engine.attach_draft_layer(draft)
        if cfg.role in (Role.CONTEXT, Role.GENERATION):
            attach_kv_transfer(engine, cfg, opts.host, port, api_key, local_rank,
                               plan.kv_staging)
        stop_engine = engine.stop
        close_events = attach_kv_events(engine, cfg.kv_cache.events, opts.host)
        if cuda_graphs:
            ledger = capture_cuda_graphs(engine, ledger, watch)
        engine.start()
        server = server_identity(cfg.role.value if cfg.role else None)
        app = build_app(engine, dwdp=dwdp, served_name=cfg.model.served_name,
                        on_shutdown=engine.stop, identity=rank_identity(),
                        memory=RankMemory(ledger, pool), api_key=api_key, server=server,
                        openai=False)
        stage["now"] = Stage.SERVE
        log.info("rank serving on %s:%d (role %s, %s)", opts.host, port,
                 cfg.role.value if cfg.role else "unset", dwdp.status().get("phase"))
        serve_with_api_process(
            app,
            engine,
            api_process_fields(cfg, engine, opts.host, port, server, api_key),
            stop_engine=engine.stop,
            server_holder=server_holder,
            process=api_process,
            stop_pending=lambda: stop_signals.pending is not None,
        )
        close = getattr(dwdp, "close", None)  # the DWDP state, then the group transport
        if close is not None:
            close()
        if group is not None:  # served: no collective follows, rank 0 need not linger
            group.close(linger=False)
        if fatal:
            return 1
        return 0
    except StopRequested as stop:
        log.info("rank stopped by signal %d during stage %s, before serving", stop.signum,
                 stage["now"])
        stopped = True
        return 0
    except Exception as exc:
        line = write_termination_message(
            with_memory(phased(stage["now"], exc), watch), opts.termination_log
        )
        log.error("worker failed: %s", line)
        return 1
    finally:
        stop_signals.quiet()
        if stop_engine is not None:
            stop_engine()
        if api_process is not None:  # a rank that failed before it served
            api_process.close()
        if close_events is not None:
            close_events()
        if group is not None:
            # after a failure too: rank 0 hosts the rendezvous store, and the other ranks
            # still read the collective that failed (they must see its SetupError, not a
            # lost store); closing twice is safe. Stopped by a signal, it does not wait for
            # the peers to leave: none is reading a verdict of this rank's
            group.close(linger=not stopped)
        stop_signals.restore()
