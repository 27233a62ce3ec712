"""The launch configuration of one worker and the launch rules of docs/design.md §3.2.

A :class:`LaunchConfig` is what a worker process reads (the file ``DWDP_CONFIG`` names; the
operator renders it from the DwdpDeployment spec). :func:`validate_launch` applies the
launch rules in one fixed order and raises :class:`LaunchError` naming the *first*
requirement the launch breaks; :func:`launch_problems` lists every broken one, in the
same order, and :func:`launch_problem` gives the first one without raising. The rules run
when the launch is built (operator, ``dwdp validate``) and again on the worker's host,
which alone knows whether the model declares dense roots (``dense_roots``).

Rule order: role, the settings this worker does not run (:mod:`dwdp.api.support`), dense
DWDP mode, dense roots; one problem per field, the first rule that names it. Paths are
relative to the launch config (``dwdp.dwdpSize``); the DwdpDeployment prefixes them with
``spec.context``. Every rank serves one whole model: the launch has no parallel layout, and
its engine switches are ``engine.cudaGraphs`` and ``engine.speculative`` (the others are
:mod:`dwdp.api.dropped`).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from dwdp.api.base import ApiModel, Bool, PosInt, cel_rule, cel_rules
from dwdp.api.config import DwdpConfig
from dwdp.api.defaults import (
    KV_BLOCK_SIZE,
    KV_TRANSFER_LEASE_S,
    MAX_BATCH_SIZE,
    MAX_NUM_TOKENS,
    SERVER_PORT,
    VLLM_SIDE_CHANNEL_PORT,
    VLLM_VERSIONS,
)
from dwdp.api.enums import DenseMode, HandleType, Role, Transport
from dwdp.api.errors import Problem, RuleViolations, first_per_field
from dwdp.api.names import ABSOLUTE_PATH
from dwdp.api.support import Scope, SectionView, worker_limit_problems

__all__ = [
    "LEGACY_ROLES",
    "ROLE_ENV",
    "Dtype",
    "EngineSpec",
    "KvCacheConfig",
    "KvTransferConfig",
    "LaunchConfig",
    "LaunchError",
    "LaunchModel",
    "SpeculativeSpec",
    "StagingTokens",
    "VllmConnectorConfig",
    "dense_mode",
    "launch_message",
    "launch_problem",
    "launch_problems",
    "launch_warnings",
    "parse_role",
    "resolve_role",
    "validate_launch",
]

ROLE_ENV = "DWDP_ROLE"
"""The environment variable that carries a worker's role when the launch does not."""

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
"""The dtypes a worker can run; ``auto`` follows the checkpoint."""

LEGACY_ROLES: dict[str, Role] = {"ctx": Role.CONTEXT, "gen": Role.GENERATION}
"""Legacy role prefixes and the roles they mean: ``ctx<N>``/``gen<N>`` (any digits, any
letter case: ``ctx0``, ``CTX1``, ``Gen3``) name a context or generation server."""

StagingTokens = Annotated[int, Field(strict=True, ge=1, le=1 << 24)]
"""Tokens of a vLLM staging buffer (``kvTransfer.vllm.stagingTokens``,
``generation.vllm.stagingTokens``): a whole number from 1 to 2^24."""

_LEGACY_ROLE = re.compile(r"(ctx|gen)[0-9]+")


KV_EVENTS_TOPIC = "kv@{pod_ip}@{model}"
"""The default topic: llm-d's convention (its endpoint picker reads the pod and the model from
it); ``{pod_ip}`` and ``{model}`` are filled in by the worker."""

_ZMQ_TCP = r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+|\*):[0-9]{1,5}$"


_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")
_NO_WILDCARD = (
    "a wildcard address would listen on every interface, and the events carry prompt token "
    "ids: give the subscriber's address (the rank connects to it) or a loopback address"
)


class KvEventsConfig(ApiModel):
    """KV cache events in vLLM's format (``--kv-events-config``): every block the prefix cache
    stores or evicts, batched per engine step, msgpack over a ZMQ PUB socket, for a
    prefix-cache-aware router such as llm-d's precise prefix-cache scorer."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules([cel_rule(
            " && ".join(f"!self.endpoint.startsWith('tcp://{h}:')" for h in _WILDCARD_HOSTS),
            _NO_WILDCARD, field_path=".endpoint")])
    )

    endpoint: Annotated[str, Field(pattern=_ZMQ_TCP, max_length=256)] = Field(
        description="Where the events go: tcp://HOST:PORT. A subscriber's address (the rank "
        "connects to it, as llm-d's endpoint picker expects), or a loopback address the rank "
        "binds for a subscriber beside it. Wildcard addresses (*, 0.0.0.0, ::) are refused: "
        "the events carry prompt token ids, and a listening socket would hand them to any peer.",
    )
    topic: Annotated[str, Field(max_length=256)] = Field(
        default=KV_EVENTS_TOPIC,
        description="The topic frame of every message; {pod_ip} and {model} are replaced by "
        "the rank's address and served model name (default: llm-d's kv@{pod_ip}@{model}).",
    )

    @model_validator(mode="after")
    def _check(self) -> KvEventsConfig:
        if self.host in _WILDCARD_HOSTS:
            raise RuleViolations([Problem(("endpoint",), self.endpoint, _NO_WILDCARD)])
        return self

    @property
    def host(self) -> str:
        """The endpoint's host (brackets kept for IPv6)."""
        return self.endpoint[len("tcp://"):].rsplit(":", 1)[0]

    @property
    def binds(self) -> bool:
        """Whether the rank binds the endpoint (a loopback address) rather than connects."""
        host = self.host.strip("[]")
        return host == "localhost" or host == "::1" or host.startswith("127.")


_EVENTS_NEED_CACHE = (
    "events describe the prefix cache, and prefixCaching is false: set prefixCaching true "
    "or leave events unset"
)


class KvCacheConfig(ApiModel):
    """How a rank sizes its KV cache pool after the DWDP commit: freeMemoryFraction of the
    memory left after weights, DWDP buffers and one forward's activations, bounded by
    maxTokens; a pool below one maxModelLen request is refused."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules([cel_rule(
            "!has(self.events) || !has(self.prefixCaching) || self.prefixCaching",
            _EVENTS_NEED_CACHE, field_path=".events")])
    )

    free_memory_fraction: float = Field(
        default=0.9,
        strict=True,
        gt=0,
        le=1,
        description="Fraction (0, 1] of the GPU memory left free after weights, DWDP "
        "buffers and activations that the KV cache pool takes (host memory on the cpu "
        "backend).",
    )
    max_tokens: PosInt | None = Field(
        default=None,
        description="Upper bound on the KV cache pool, in tokens; unset means no bound. "
        "Must be at least maxModelLen.",
    )
    transfer_lease_seconds: PosInt = Field(
        default=KV_TRANSFER_LEASE_S,
        le=3600,
        description="Disaggregated serving: how long a context rank holds a prefilled "
        "request's KV blocks for its generation server to read (vLLM's lease; released at "
        "once when the read is done).",
    )
    block_size: PosInt = Field(
        default=KV_BLOCK_SIZE,
        le=256,
        description="Tokens per block of the paged KV cache (vLLM's --block-size); the pool "
        "is cut into capacity / blockSize blocks.",
    )
    prefix_caching: Bool = Field(
        default=True,
        description="Automatic prefix caching (vLLM's --enable-prefix-caching): full KV "
        "blocks stay cached by their tokens' hash after their request ends, while the pool "
        "has room, and a later request with the same prefix (and cache_salt) skips their "
        "prefill; answers report usage.prompt_tokens_details.cached_tokens. False computes "
        "every prompt from its first token.",
    )
    events: KvEventsConfig | None = Field(
        default=None,
        description="Publish KV cache events (vLLM's BlockStored / BlockRemoved / "
        "AllBlocksCleared) for a prefix-cache-aware router; unset: none. Needs prefixCaching.",
    )

    @model_validator(mode="after")
    def _check(self) -> KvCacheConfig:
        if self.events is not None and not self.prefix_caching:
            raise RuleViolations([Problem(("events",), self.events.endpoint, _EVENTS_NEED_CACHE)])
        return self


class VllmConnectorConfig(ApiModel):
    """The other tier is vLLM: vLLM's NIXL connector spoken with unmodified vLLM servers
    (``--kv-transfer-config`` with ``NixlConnector``). A context rank serves vLLM decode
    servers (``kv_consumer``) the KV it prefilled (vLLM's ZMQ side channel, its compatibility
    hash and its KV layout); a generation server reads the KV vLLM prefill servers
    (``kv_producer``) computed, handshaking on the side channel their answers name."""

    version: str = Field(
        default=VLLM_VERSIONS[0],
        max_length=32,
        description="The vLLM servers' version; its NIXL connector is the one spoken. "
        f"Supported: {', '.join(VLLM_VERSIONS)}.",
    )
    side_channel_port: int = Field(
        default=VLLM_SIDE_CHANNEL_PORT,
        strict=True,
        ge=1,
        le=65535,
        description="Port of a context rank's ZMQ side channel (vLLM's "
        "VLLM_NIXL_SIDE_CHANNEL_PORT); local rank k listens on sideChannelPort + k, on the "
        "pod's address only (the channel authenticates no peer: keep it behind the "
        "NetworkPolicy). Unused on a generation server: each prefill answer names the vLLM "
        "server's side channel.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="The vLLM servers' --model string (decode servers for a context rank, "
        "prefill servers for a generation server), part of vLLM's compatibility hash; unset: "
        "model.path.",
    )
    hybrid_kv_cache_manager: Bool = Field(
        default=True,
        description="Whether the vLLM servers run vLLM's hybrid KV cache manager (its "
        "default with the NIXL connector); false with --disable-hybrid-kv-cache-manager. "
        "Part of the compatibility hash.",
    )
    staging_tokens: StagingTokens | None = Field(
        default=None,
        description="A context rank: tokens of prefilled KV its staging buffer holds for the "
        "vLLM decode servers to read (vLLM's layout, whole blocks of 128 tokens on the host; "
        "each request takes whole blocks until its reader is done). The buffer is taken out "
        "of the rank's memory before the KV cache pool is sized. A prefill that finds it full "
        "waits for room for up to kvCache.transferLeaseSeconds, then is answered 503 naming "
        "this setting (the operator's router sends it again to other context ranks, at most "
        "once per rank; when they are all full its client gets a 500 with that message). "
        "At least maxModelLen; unset: the larger of "
        "maxModelLen and 2 x maxNumTokens. Unused on a generation server (its READ buffer "
        "holds 2048 tokens).",
    )
    cpu_attention_kernel: Literal["auto", "vec", "amx"] = Field(
        default="auto",
        description="A context rank on the host: the CPU attention kernels of the decode "
        "servers' hosts, whose KV layout the rank stages (vLLM picks them by host; its "
        "handshake does not say which): amx for bfloat16 on hosts with AMX tiles, vec "
        "otherwise; auto: the one vLLM picks on the rank's own host. A rank on a GPU stages "
        "FLASH_ATTN's layout and ignores it.",
    )

    @model_validator(mode="after")
    def _check(self) -> VllmConnectorConfig:
        if self.version not in VLLM_VERSIONS:
            rule = (f"the NIXL connector of vLLM {', '.join(VLLM_VERSIONS)} is the one "
                    "spoken; other versions are refused")
            raise RuleViolations([Problem(("version",), self.version, rule)])
        return self


class KvTransferConfig(ApiModel):
    """Which servers the other tier runs: dwdp servers (NIXL agents and HTTP side channels
    with lease tokens), or with ``vllm`` unmodified vLLM servers."""

    vllm: VllmConnectorConfig | None = Field(
        default=None,
        description="The other tier is vLLM, spoken through vLLM's NIXL connector: a context "
        "server serves unmodified vLLM decode servers, a generation server reads from "
        "unmodified vLLM prefill servers (in place of dwdp servers; a generation server still "
        "reads dwdp context servers' answers, which carry a lease token). Unset: dwdp servers "
        "only. Refused on an aggregated server, which moves no KV.",
    )


PROMPT_LOOKUP_DEFAULT = 5
"""vLLM's n-gram suffix length when neither promptLookupMin nor promptLookupMax is set."""
PROMPT_LOOKUP_LIMIT = 64
"""The longest n-gram suffix ``promptLookupMax`` may ask for (vLLM sets no bound; the drafter
compares every suffix length from promptLookupMax down to promptLookupMin against the whole
request each step, and suffixes that long hardly ever recur but cost every step)."""
MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens ``numSpeculativeTokens`` may ask for per step and request."""

_LOOKUP_ORDER = (
    "the drafter looks up suffixes from promptLookupMax down to promptLookupMin tokens long"
)
LOOKUP_ORDER_RULE = cel_rule(
    "!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
    "self.promptLookupMin <= self.promptLookupMax",
    f"promptLookupMin must be at most promptLookupMax: {_LOOKUP_ORDER}",
    field_path=".promptLookupMin",
)
"""vLLM's ``prompt_lookup_min <= prompt_lookup_max``, in the CRD."""

LookupLength = Annotated[int, Field(strict=True, ge=1, le=PROMPT_LOOKUP_LIMIT)]
"""An n-gram suffix length: a whole number from 1 to :data:`PROMPT_LOOKUP_LIMIT`."""


BatchSizeRange = Annotated[list[Annotated[int, Field(strict=True, ge=0)]],
                          Field(min_length=3, max_length=3)]
"""``[first, last, tokens]``: running requests ``first`` to ``last`` draft ``tokens`` each."""

_SCHEDULE = "numSpeculativeTokensPerBatchSize"


def _batch_schedule_problem(schedule: list[list[int]]) -> Problem | None:
    """vLLM's rules of a batch-size schedule (``validate_and_normalize_dynamic_sd_schedule``):
    each range 1 <= first <= last; sorted by first, no two overlap; the first starts at 1.
    The first entry (its index as given) that breaks one."""
    for i, (first, last, tokens) in enumerate(schedule):
        if first < 1 or first > last:
            rule = "must be [first, last, tokens] with 1 <= first <= last"
            return Problem((_SCHEDULE, i), [first, last, tokens], rule)
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    for before, i in itertools.pairwise(order):
        if schedule[i][0] <= schedule[before][1]:
            rule = f"overlaps the range {schedule[before]}: each batch size in one range"
            return Problem((_SCHEDULE, i), schedule[i], rule)
    if order and schedule[order[0]][0] != 1:
        rule = "the first range must start at 1, so every batch size has its drafts"
        return Problem((_SCHEDULE, order[0]), schedule[order[0]], rule)
    return None


SCHEDULE_RANGE_RULE = cel_rule(
    f"!has(self.{_SCHEDULE}) || self.{_SCHEDULE}.all(e, e[0] >= 1 && e[0] <= e[1])",
    f"{_SCHEDULE}: each entry must be [first, last, tokens] with 1 <= first <= last",
    field_path=f".{_SCHEDULE}",
)
SCHEDULE_OVERLAP_RULE = cel_rule(
    f"!has(self.{_SCHEDULE}) || self.{_SCHEDULE}.all(a, self.{_SCHEDULE}.all(b, "
    "a == b || a[1] < b[0] || b[1] < a[0]))",
    f"{_SCHEDULE}: two ranges overlap; each batch size in one range",
    field_path=f".{_SCHEDULE}",
)
SCHEDULE_START_RULE = cel_rule(
    f"!has(self.{_SCHEDULE}) || size(self.{_SCHEDULE}) == 0 || "
    f"self.{_SCHEDULE}.exists(e, e[0] == 1)",
    f"{_SCHEDULE}: the first range must start at 1, so every batch size has its drafts",
    field_path=f".{_SCHEDULE}",
)
"""vLLM's batch-size schedule rules, in the CRD."""


class SpeculativeSpec(ApiModel):
    """Speculative decoding (vLLM's ``--speculative-config``): before each step a decoding
    request proposes up to numSpeculativeTokens draft tokens without a forward, and the step
    verifies them in the same forward that computes its next token; the output is what
    decoding without drafts gives."""

    model_config = ConfigDict(json_schema_extra=cel_rules(
        [LOOKUP_ORDER_RULE, SCHEDULE_RANGE_RULE, SCHEDULE_OVERLAP_RULE, SCHEDULE_START_RULE]))

    method: Literal["ngram", "mtp"] = Field(
        default="ngram",
        description="How drafts are proposed: ngram (vLLM's prompt lookup): the tokens that "
        "followed the earliest earlier occurrence of the request's last promptLookupMin to "
        "promptLookupMax tokens in its prompt and output; mtp (vLLM's deepseek_mtp): the "
        "checkpoint's multi-token prediction layer (DeepSeek-V3's num_nextn_predict_layers), "
        "run after every step on the model's last hidden states; a checkpoint without one is "
        "refused when the rank starts.",
    )
    num_speculative_tokens: int = Field(
        strict=True,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Draft tokens proposed per step and decoding request, at most "
        f"(1 to {MAX_SPECULATIVE_TOKENS}; vLLM's num_speculative_tokens). Required.",
    )
    prompt_lookup_min: LookupLength | None = Field(
        default=None,
        description="Shortest suffix the ngram method looks up, in tokens "
        f"(1 to {PROMPT_LOOKUP_LIMIT}). Unset: promptLookupMax when that is set, else "
        f"{PROMPT_LOOKUP_DEFAULT} (vLLM's rule).",
    )
    prompt_lookup_max: LookupLength | None = Field(
        default=None,
        description="Longest suffix the ngram method looks up, in tokens "
        f"(1 to {PROMPT_LOOKUP_LIMIT}); at least promptLookupMin. Unset: promptLookupMin when "
        f"that is set, else {PROMPT_LOOKUP_DEFAULT} (vLLM's rule).",
    )

    num_speculative_tokens_per_batch_size: list[BatchSizeRange] | None = Field(
        default=None,
        max_length=64,
        description="Fewer drafts under load (vLLM's num_speculative_tokens_per_batch_size): "
        "[first, last, tokens] inclusive ranges of running requests, not overlapping, the "
        "lowest starting at 1; a step with that many requests drafts at most "
        "tokens per request, never more than numSpeculativeTokens (0: none, so speculation "
        "costs no throughput when the batch is large); a gap or the tail keeps the range "
        "before's tokens. Unset: numSpeculativeTokens at every batch size.",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSpec:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            rule = f"must be at most promptLookupMax ({high}): {_LOOKUP_ORDER}"
            raise RuleViolations([Problem(("promptLookupMin",), low, rule)])
        problem = _batch_schedule_problem(self.num_speculative_tokens_per_batch_size or [])
        if problem is not None:
            raise RuleViolations([problem])
        return self

    def lookup_range(self) -> tuple[int, int]:
        """``(promptLookupMin, promptLookupMax)`` resolved by vLLM's rules: both unset: 5 and
        5; one set: the other takes its value."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:
            low = PROMPT_LOOKUP_DEFAULT if high is None else high
        return low, low if high is None else high


class EngineSpec(ApiModel):
    """Engine switches of a rank: cudaGraphs and speculative; the other switches of earlier
    specs (torchCompile, overlapScheduler, lora, speculativeDecoding, sleepMode) are refused as
    dropped fields."""

    cuda_graphs: Bool | None = Field(
        default=None,
        description="Replay steps from CUDA graphs captured at startup: decode-only steps per "
        "batch-size bucket, other steps up to 4096 tokens piecewise per token-count bucket "
        "(attention eager between the pieces); their memory comes out of the KV cache pool. "
        "Unset: on for a generation "
        "server on CUDA, off otherwise. True needs CUDA and is refused with DWDP on (the "
        "prefetch schedule runs host hooks around every MoE layer).",
    )
    speculative: SpeculativeSpec | None = Field(
        default=None,
        description="Speculative decoding: decoding requests propose draft tokens that one "
        "forward verifies, several tokens per step where the drafts are right, with the same "
        "output as without them (greedy token for token, sampled by the same distribution). "
        "Unset: off.",
    )


def served_model_name(served_name: str | None, path: str) -> str:
    """The model name a rank answers to: ``served_name``, else the checkpoint folder's name."""
    return served_name or path.rstrip("/").rsplit("/", 1)[-1]


class LaunchModel(ApiModel):
    """Where a worker finds the checkpoint (a local Hugging Face directory)."""

    path: Annotated[str, ABSOLUTE_PATH] = Field(
        description="Directory of the checkpoint inside the worker (absolute path).",
    )
    architecture: str | None = Field(
        default=None,
        max_length=128,
        description="Architecture name when the checkpoint's config.json does not give it.",
    )
    served_name: str | None = Field(
        default=None, max_length=253, description="Model name the HTTP API answers to."
    )
    dtype: Dtype = Field(
        default="auto", description="Weight and activation dtype; auto follows the checkpoint."
    )


class LaunchConfig(ApiModel):
    """Everything one worker rank needs to start (rendezvous details come from env)."""

    role: Role | None = Field(
        default=None,
        description="context, generation or aggregated; unset: from the DWDP_ROLE "
        "environment variable.",
    )
    model: LaunchModel
    transport: Transport = Field(
        default=Transport.TCP_STORE, description="How the group's ranks run their collectives."
    )
    handle_type: HandleType = Field(
        default=HandleType.FABRIC, description="How a rank's store is shared with its peers."
    )
    dwdp: DwdpConfig = Field(default_factory=DwdpConfig)
    graceful_shutdown_timeout_s: PosInt | None = Field(
        default=None,
        alias="gracefulShutdownTimeoutSeconds",
        description="Bound, in seconds, on the server's graceful stop; unset: no bound.",
    )
    max_num_tokens: PosInt = Field(
        default=MAX_NUM_TOKENS, description="Tokens per forward pass, at most."
    )
    max_batch_size: PosInt = Field(
        default=MAX_BATCH_SIZE, description="Requests per forward pass, at most."
    )
    max_model_len: PosInt | None = Field(
        default=None,
        description="Prompt plus generated tokens of one request, at most; unset: the "
        "model's max_position_embeddings.",
    )
    kv_cache: KvCacheConfig = Field(default_factory=KvCacheConfig)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    server_port: int = Field(
        default=SERVER_PORT,
        strict=True,
        ge=1,
        le=65535,
        description="HTTP port of local rank 0; local rank k serves serverPort + k.",
    )


class LaunchError(ValueError):
    """A launch that breaks a rule of docs/design.md §3.2; ``problem`` is the first one broken."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        super().__init__(f"launch refused: {problem}")


def dwdp_active(cfg: LaunchConfig) -> bool:
    """True when the launch asks for expert or dense DWDP (the ranks then form a group)."""
    return bool(cfg.dwdp.expert_dwdp or cfg.dwdp.enable_dense)


def opens_rendezvous_store(cfg: LaunchConfig) -> bool:
    """True when the ranks meet at rank 0's TCP store: DWDP on and transport ``tcpStore``
    (the store every rank must prove the incarnation's secret to; MPI never opens it)."""
    return dwdp_active(cfg) and cfg.transport is Transport.TCP_STORE


def dense_mode(cfg: LaunchConfig) -> DenseMode | None:
    """The dense DWDP mode this launch qualifies for, or None (dense off or no mode): attached
    needs enableExperts with dwdpSize > 1 (standalone needs a tensor-parallel instance,
    which this worker has not)."""
    d = cfg.dwdp
    if d.enable_dense and d.enable_experts and d.dwdp_size > 1:
        return DenseMode.ATTACHED
    return None


def launch_problems(cfg: LaunchConfig, *, dense_roots: bool | None = None) -> list[Problem]:
    """Every launch rule ``cfg`` breaks, in rule order, one problem per field (the first
    rule that names it).

    Args:
        cfg: the launch.
        dense_roots: whether the model's architecture declares dense roots; None (not
            known yet, as when the operator builds the launch) skips that rule.
    """
    view = SectionView(cfg.transport, cfg.dwdp, cfg.handle_type, cfg.engine.cuda_graphs)
    return first_per_field(
        [
            *_role_problems(cfg),
            *_vllm_kernel_problems(cfg),
            *worker_limit_problems(view, Scope.LAUNCH),
            *_dense_mode_problems(cfg),
            *_dense_roots_problems(cfg, dense_roots),
        ]
    )


def _role_problems(cfg: LaunchConfig) -> list[Problem]:
    """Dense DWDP on a generation server; vLLM's NIXL connector on an aggregated one."""
    problems = []
    if cfg.dwdp.enable_dense and cfg.role is Role.GENERATION:
        problems.append(Problem(
            ("dwdp", "enableDense"),
            True,
            "dense DWDP is for context (prefill) servers; a generation server refuses it",
        ))
    if cfg.kv_transfer.vllm is not None and cfg.role is Role.AGGREGATED:
        problems.append(Problem(
            ("kvTransfer", "vllm"),
            cfg.kv_transfer.vllm.version,
            "vLLM's NIXL connector moves KV between a prefill and a decode tier; an "
            "aggregated server prefills and decodes itself and moves none: leave "
            "kvTransfer.vllm unset",
        ))
    return problems


def _vllm_kernel_problems(cfg: LaunchConfig) -> list[Problem]:
    """vLLM's AMX attention layout asked of a model whose dtype is not bfloat16."""
    vllm, dtype = cfg.kv_transfer.vllm, cfg.model.dtype
    if vllm is None or vllm.cpu_attention_kernel != "amx" or dtype in ("auto", "bfloat16"):
        return []
    why = (f"vLLM runs its AMX attention for bfloat16 only and model.dtype is {dtype}: "
           "use vec or auto")
    return [Problem(("kvTransfer", "vllm", "cpuAttentionKernel"), "amx", why)]


def _dense_mode_problems(cfg: LaunchConfig) -> list[Problem]:
    """Attached dense DWDP (with enableExperts) on a group of one rank; dense DWDP without
    enableExperts is a limit of this worker (:mod:`dwdp.api.support`)."""
    d = cfg.dwdp
    if not (d.enable_dense and d.enable_experts) or dense_mode(cfg) is not None:
        return []
    why = "dense DWDP with enableExperts runs attached, which needs dwdpSize > 1"
    return [Problem(("dwdp", "dwdpSize"), d.dwdp_size, why)]


def _dense_roots_problems(cfg: LaunchConfig, dense_roots: bool | None) -> list[Problem]:
    """Dense DWDP needs an architecture that declares dense roots."""
    if not cfg.dwdp.enable_dense or dense_roots is not False:
        return []
    arch = cfg.model.architecture or "of this checkpoint"
    return [
        Problem(
            ("dwdp", "enableDense"),
            True,
            f"the model architecture {arch} declares no dense roots, so dense DWDP "
            "cannot shard it",
        )
    ]


def launch_problem(cfg: LaunchConfig, *, dense_roots: bool | None = None) -> Problem | None:
    """The first launch rule ``cfg`` breaks, or None; ``str()`` of it is the message."""
    problems = launch_problems(cfg, dense_roots=dense_roots)
    return problems[0] if problems else None


def launch_message(cfg: LaunchConfig, *, dense_roots: bool | None = None) -> str | None:
    """The first broken requirement as one line (``path: rule (got value)``), or None."""
    problem = launch_problem(cfg, dense_roots=dense_roots)
    return None if problem is None else str(problem)


def validate_launch(cfg: LaunchConfig, *, dense_roots: bool | None = None) -> None:
    """Apply the launch rules of docs/design.md §3.2.

    Raises:
        LaunchError: naming the first requirement the launch breaks (its ``problem``
            holds the field path, the value and the rule).
    """
    problem = launch_problem(cfg, dense_roots=dense_roots)
    if problem is not None:
        raise LaunchError(problem)


def launch_warnings(cfg: LaunchConfig, role: Role | None = None) -> list[str]:
    """Warnings a valid launch still deserves (log each once).

    ``role`` is the resolved role (:func:`resolve_role`); defaults to ``cfg.role``.
    """
    role = role if role is not None else cfg.role
    warnings = []
    if cfg.dwdp.enable_dense and role is not Role.CONTEXT:
        shown = role.value if role else "unset"
        warnings.append(
            f"dense DWDP is meant for context (prefill) servers, but the role is {shown}; "
            f"set role: context (or {ROLE_ENV}=context)"
        )
    return warnings


def parse_role(text: str) -> Role:
    """A role from text: context, generation, aggregated, or legacy ``ctx<N>``/``gen<N>``
    (``ctx0``, ``gen3``: any digits), in any letter case, surrounding blanks ignored.

    Raises ``ValueError`` naming the accepted spellings.
    """
    key = text.strip().lower()
    legacy = _LEGACY_ROLE.fullmatch(key)
    if legacy:
        return LEGACY_ROLES[legacy.group(1)]
    try:
        return Role(key)
    except ValueError:
        accepted = ", ".join([*(r.value for r in Role), *(f"{p}<N>" for p in LEGACY_ROLES)])
        raise ValueError(
            f"unknown role {text!r}; accepted: {accepted} (N: digits, as in ctx0), any case"
        ) from None


def resolve_role(
    launch_role: Role | str | None, environ: Mapping[str, str] | None = None
) -> Role | None:
    """The worker's role: the launch's (``--role``) if given, else ``DWDP_ROLE`` (empty:
    unset), else None.

    Raises ``ValueError`` for an unknown spelling in either place (blanks only included).
    """
    if launch_role is not None and launch_role != "":
        return launch_role if isinstance(launch_role, Role) else parse_role(launch_role)
    env = os.environ if environ is None else environ
    value = env.get(ROLE_ENV, "")
    return parse_role(value) if value else None  # blanks only: refused, as for --role
