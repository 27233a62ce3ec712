"""A vLLM generation tier (``spec.generation.vllm``): unmodified vLLM servers decode what the
dwdp context ranks prefilled, reading their KV through vLLM's NIXL connector
(docs/vllm-fleet.md).

What the context side speaks decides what the spec may say (``dwdp.worker.disagg.vllm_nixl``):
vLLM's CPU attention layout only, so the context runs the cpu backend (``handleType shm``) and
the vLLM servers run on CPU; one KV dtype on both sides (part of vLLM's compatibility hash), so
``model.dtype`` is given explicitly; the side channel answers tensor and pipeline rank 0 only,
so a vLLM server is one rank. The generation section's dwdp engine settings
(:data:`DWDP_ONLY_SETTINGS`) have no meaning for vLLM, whose own arguments go in
``generation.vllm.args``; the arguments the operator sets (:data:`OPERATOR_ARGS`) are refused
there. Every rule here is one line naming the field, the value and the rule, in the models and
in the CRD (the same words); the model itself is ``dwdp.api.deployment.VllmGenerationSpec``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dwdp.api.base import cel_literal, cel_rule
from dwdp.api.defaults import (
    KV_BLOCK_SIZE,
    KV_TRANSFER_LEASE_S,
    MAX_BATCH_SIZE,
    MAX_NUM_TOKENS,
    VLLM_VERSIONS,
)
from dwdp.api.errors import Problem

__all__ = [
    "ARGS_RULE",
    "DWDP_ONLY_SETTINGS",
    "FLAG_PATTERN",
    "OPERATOR_ARGS",
    "SHORT_ARGS",
    "SIDE_CHANNEL_RANGE_RULE",
    "SIDE_CHANNEL_RULE",
    "VERSION_RULE",
    "DwdpOnlySetting",
    "dwdp_only_problems",
    "dwdp_only_rules",
    "operator_arg",
    "side_channel_cel",
    "side_channel_problems",
    "vllm_spec_problems",
    "vllm_spec_rules",
]

_ONE_RANK = "the context ranks answer tensor and pipeline rank 0 only: one rank per server"

OPERATOR_ARGS: dict[str, tuple[int, str]] = {
    "model": (5, "the operator passes model.path, the checkpoint the context ranks load"),
    "served-model-name": (3, "the operator passes the name the context ranks answer to"),
    "host": (2, "the operator binds the pod's address"),
    "port": (3, "the operator passes server.port"),
    "uds": (2, "the operator serves on server.port"),
    "api-key": (5, "the key comes from server.apiKeySecretRef as VLLM_API_KEY, never the pod spec"),
    "kv-transfer-config": (4, "the operator passes the NIXL connector as kv_consumer"),
    "dtype": (2, "the operator passes model.dtype (both tiers cache KV in one dtype)"),
    "kv-cache-dtype": (14, "the context ranks cache KV in the model's dtype only (auto)"),
    "tensor-parallel-size": (2, _ONE_RANK),
    "pipeline-parallel-size": (2, _ONE_RANK),
    "disable-hybrid-kv-cache-manager": (
        9,
        "set generation.vllm.hybridKvCacheManager (the context ranks hash it too)",
    ),
    "config": (6, "arguments from a file escape these checks: give them in args"),
}
"""vLLM's long options ``generation.vllm.args`` must not give, with the length of their
shortest prefix vLLM 0.32.0's parser takes for them (argparse accepts any unambiguous prefix:
``--served-model`` is ``--served-model-name``; shorter ones are ambiguous there and refused by
vLLM itself), and why: the operator sets them, or the context ranks cannot serve another value.
A boolean's ``--no-`` form counts too."""
SHORT_ARGS = {"t": _ONE_RANK, "tp": _ONE_RANK, "pp": _ONE_RANK}
"""vLLM 0.32.0's short options refused likewise (``-t`` is a prefix of ``-tp``)."""


def _prefix_pattern(name: str, shortest: int) -> str:
    """A regex of every prefix of ``name`` at least ``shortest`` long, ``_`` for any ``-``
    (vLLM reads ``--served_model_name`` as ``--served-model-name``): ``mod(e(l)?)?``."""

    def char(ch: str) -> str:
        return "[-_]" if ch == "-" else re.escape(ch)

    tail = ""
    for ch in reversed(name[shortest:]):
        tail = f"({char(ch)}{tail})?"
    return "".join(char(ch) for ch in name[:shortest]) + tail


def _flag_pattern(name: str) -> str:
    if name in SHORT_ARGS:
        return f"-{name}(=.*)?"
    shortest = OPERATOR_ARGS[name][0]
    return f"--(no[-_])?{_prefix_pattern(name, shortest)}([.][^=]*)?(=.*)?"


_PATTERNS = {name: _flag_pattern(name) for name in (*OPERATOR_ARGS, *SHORT_ARGS)}
FLAG_PATTERN = "^(" + "|".join(_PATTERNS.values()) + ")$"
"""An argument that is one of :data:`OPERATOR_ARGS` or :data:`SHORT_ARGS` (any prefix vLLM
takes for it, ``_`` for ``-``, ``--no-`` for a boolean, a dotted key of a JSON option, which
vLLM's parser folds into the option (``--kv-transfer-config.kv_role=...``, ``--X.key+`` to
append), ``=VALUE`` or not); RE2 (CEL's ``matches``) and Python read it alike."""

ARGS_RULE = "must not hold an argument the operator sets or the context ranks cannot serve"
"""The rule of ``generation.vllm.args`` (the CEL message adds the list, a refusal its reason)."""


def operator_arg(arg: str) -> str | None:
    """Why ``arg`` is refused in ``generation.vllm.args`` (None when it is not)."""
    for name, pattern in _PATTERNS.items():
        if re.fullmatch(pattern, arg):
            return SHORT_ARGS[name] if name in SHORT_ARGS else OPERATOR_ARGS[name][1]
    return None


VERSION_RULE = (
    f"must be one of {', '.join(VLLM_VERSIONS)}: the NIXL connector of that vLLM is the one the "
    "context ranks speak"
)
"""The rule of ``generation.vllm.version``."""


def vllm_spec_rules() -> list[dict[str, str]]:
    """The CEL rules of ``generation.vllm``: the version and the refused arguments."""
    versions = ", ".join(cel_literal(v) for v in VLLM_VERSIONS)
    return [
        cel_rule(f"self.version in [{versions}]", f"version {VERSION_RULE}", field_path=".version"),
        cel_rule(
            f"!has(self.args) || self.args.all(a, !a.matches({cel_literal(FLAG_PATTERN)}))",
            f"args {ARGS_RULE} (--{', --'.join(OPERATOR_ARGS)}, -tp, -pp, or a prefix "
            "vLLM takes for one)",
            field_path=".args",
        ),
    ]


def vllm_spec_problems(version: str, args: Sequence[str] | None) -> list[Problem]:
    """The version and the refused arguments of ``generation.vllm``; paths relative to it."""
    problems = []
    if version not in VLLM_VERSIONS:
        problems.append(Problem(("version",), version, VERSION_RULE))
    for i, arg in enumerate(args or ()):
        why = operator_arg(arg)
        if why is not None:
            problems.append(Problem(("args", i), arg, f"{ARGS_RULE}: {why}"))
    return problems


@dataclass(frozen=True, slots=True)
class DwdpOnlySetting:
    """A setting of the generation section that only dwdp generation servers read: its path
    (camelCase, relative to ``generation``), its default, and vLLM's own way to say it."""

    path: tuple[str, ...]
    default: object
    instead: str

    @property
    def where(self) -> str:
        return ".".join(self.path)

    def rule(self) -> str:
        """The refusal, in words."""
        return (
            f"is a setting of dwdp generation servers: with generation.vllm leave it unset "
            f"and give vLLM its own ({self.instead})"
        )


DWDP_ONLY_SETTINGS: tuple[DwdpOnlySetting, ...] = (
    DwdpOnlySetting(("transport",), "tcpStore", "a vLLM server is one rank"),
    DwdpOnlySetting(("maxNumTokens",), MAX_NUM_TOKENS, "--max-num-batched-tokens in args"),
    DwdpOnlySetting(("maxBatchSize",), MAX_BATCH_SIZE, "--max-num-seqs in args"),
    DwdpOnlySetting(("maxModelLen",), None, "--max-model-len in args"),
    DwdpOnlySetting(
        ("kvCache", "freeMemoryFraction"), 0.9, "VLLM_CPU_KVCACHE_SPACE in spec.env"
    ),
    DwdpOnlySetting(("kvCache", "maxTokens"), None, "VLLM_CPU_KVCACHE_SPACE in spec.env"),
    DwdpOnlySetting(
        ("kvCache", "transferLeaseSeconds"),
        KV_TRANSFER_LEASE_S,
        "the context ranks' kvCache.transferLeaseSeconds holds the lease",
    ),
    DwdpOnlySetting(("kvCache", "blockSize"), KV_BLOCK_SIZE, "--block-size in args"),
    DwdpOnlySetting(("kvCache", "prefixCaching"), True, "--no-enable-prefix-caching in args"),
    DwdpOnlySetting(("kvCache", "events"), None, "--kv-events-config in args"),
    DwdpOnlySetting(("engine", "cudaGraphs"), None, "--enforce-eager in args"),
    DwdpOnlySetting(("engine", "speculative"), None, "--speculative-config in args"),
)
"""The generation section's settings a vLLM server does not read; with ``vllm`` each must
keep its default (the apiserver fills defaults in, so "unset" is "at its default")."""


def dwdp_only_rules() -> list[dict[str, str]]:
    """The CEL rules of :data:`DWDP_ONLY_SETTINGS`, on the generation section."""
    rules = []
    for s in DWDP_ONLY_SETTINGS:
        field = "self." + ".".join(s.path)
        test = f"!has({field})" if s.default is None else f"{field} == {cel_literal(s.default)}"
        message = f"{s.where} {s.rule()}"
        rules.append(cel_rule(f"!has(self.vllm) || {test}", message, field_path="." + s.where))
    return rules


def dwdp_only_problems(section: Any) -> list[Problem]:
    """The settings of ``section`` (a validated generation section with ``vllm`` set) that
    differ from their defaults; paths relative to the section."""
    data = section.to_yaml_dict()
    problems = []
    for s in DWDP_ONLY_SETTINGS:
        value: Any = data
        for part in s.path:
            value = value.get(part) if isinstance(value, dict) else None
        if value != s.default:
            problems.append(Problem(s.path, value, s.rule()))
    return problems


SIDE_CHANNEL_RULE = (
    "the context pods' side-channel ports (sideChannelPort up to sideChannelPort + "
    "context.ranksPerPod - 1) must not meet their server ports (server.port up to server.port "
    "+ context.ranksPerPod - 1) or rendezvous.port"
)


SIDE_CHANNEL_RANGE_RULE = (
    "must leave room for every local rank (sideChannelPort + context.ranksPerPod - 1 at most "
    "65535): local rank k listens on sideChannelPort + k"
)


def side_channel_problems(
    port: int, *, ranks_per_pod: int, server_port: int, rendezvous_port: int
) -> list[Problem]:
    """The context pods' side-channel ports ``port .. port + ranks_per_pod - 1`` meeting their
    server ports or the rendezvous port; path relative to ``generation.vllm``."""
    last = port + ranks_per_pod - 1
    if last > 65535:
        return [Problem(("sideChannelPort",), port, SIDE_CHANNEL_RANGE_RULE)]
    apart = last < server_port or port > server_port + ranks_per_pod - 1
    if apart and not port <= rendezvous_port <= last:
        return []
    return [Problem(("sideChannelPort",), port, SIDE_CHANNEL_RULE)]


def side_channel_cel() -> list[dict[str, str]]:
    """:data:`SIDE_CHANNEL_RANGE_RULE` and :data:`SIDE_CHANNEL_RULE` in CEL, on the spec."""
    s, k = "self.generation.vllm.sideChannelPort", "self.context.ranksPerPod"
    p, r = "self.server.port", "self.rendezvous.port"
    vllm = "!has(self.generation) || !has(self.generation.vllm) || "
    return [
        cel_rule(
            f"{vllm}{s} + {k} - 1 <= 65535",
            f"generation.vllm.sideChannelPort {SIDE_CHANNEL_RANGE_RULE}",
            field_path=".generation.vllm.sideChannelPort",
        ),
        cel_rule(
            f"{vllm}({s} + {k} - 1 > 65535) || "
            f"(({s} + {k} - 1 < {p} || {s} > {p} + {k} - 1) && ({r} < {s} || {r} > {s} + {k} - 1))",
            f"generation.vllm.sideChannelPort: {SIDE_CHANNEL_RULE}",
            field_path=".generation.vllm.sideChannelPort",
        ),
    ]
