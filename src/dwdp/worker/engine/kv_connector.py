"""The KV connector seam: what the engine asks of whatever moves KV blocks in and out of it.

The continuous engine calls a ``KvConnector`` (its ``kv``; ``None`` on a server that moves no
KV); prefill/decode disaggregation (``dwdp.worker.disagg.transfer.KvTransfer``, NIXL) implements
it. The seam follows vLLM's ``KVConnectorBase_V1`` in spirit, with only the calls this engine
makes today:

- scheduler side: ``prepare_load`` before a remote-prefill request is queued (vLLM's
  ``get_num_new_matched_tokens``: here the whole prompt but its last token comes from
  outside, see ``dwdp.worker.engine.scheduler``); ``request_finished`` when a remote-decode
  prefill ends (vLLM's method of that name: the blocks stay held, the answer carries where);
  ``cancel_hold`` when such a request goes on after all;
- worker side: ``load`` (vLLM's ``start_load_kv`` + ``wait_for_layer_load``, all layers at
  once) before the request's first step; ``finished_blocks`` (vLLM's ``get_finished``): block
  tables the engine may free now;
- server side: ``describe`` (the side channel's answer), ``release_lease`` (a generation server
  refused the request: the lease ends now), ``release`` (the generation side of that),
  ``status`` (``/dwdp/status`` counters), ``endpoint`` and ``server_of`` (the ``dwdp``
  response field).

``KvTransferParams`` is vLLM's ``kv_transfer_params`` object. The HTTP request schema parses it
(``dwdp.worker.server.protocol``) and every rule of its own fields is checked there, once: a
refusal is a 400 naming ``kv_transfer_params.<field>``. From there it travels typed to the
engine and the connector, which check only what depends on them (the engine: the block count
against its block size; the connector: the remote side's lease).

The seam's errors (``TransferError`` and its subclasses ``LeaseError`` and ``StagingFull``,
``KvHoldFull``) and the side channel's path (``KV_AGENT_PATH``) are part of it: the engine and
the server name them from here, never from an implementation.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

BlockId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_BLOCKS = 1 << 20
"""The most block ids one ``remote_block_ids`` may carry."""

_NEEDED_FOR_REMOTE_PREFILL = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_lease_token",
)
"""The fields that name a lease: required with ``do_remote_prefill``, refused without it."""


class KvTransferParams(BaseModel):
    """The ``kv_transfer_params`` of a request or an answer (vLLM's NIXL-connector contract).

    A router first sends a request with ``do_remote_decode`` to a context server, which
    prefills it, holds its KV blocks under a lease and answers ``do_remote_prefill`` with
    where they are: ``remote_engine_id`` (its NIXL agent), ``remote_request_id`` (the lease),
    ``remote_block_ids`` (block ids, in token order), ``remote_host``/``remote_port`` (its HTTP
    side channel), ``tp_size``. The router copies that object unchanged into the request it
    sends a generation server, which reads the blocks and decodes. ``remote_lease_token``
    (dwdp's) is the lease's secret, which the generation server shows when it claims the
    blocks; vLLM's answers (``transfer_mode`` set, ``from_vllm``) carry none. The same rule
    holds on every role: a key that is none of vLLM 0.32.0's NIXL-connector keys nor dwdp's
    token is refused, naming it and the nearest known key (a misspelled ``do_remote_decod``
    would otherwise prefill and decode here without a word); a field of the wrong type is
    named before any rule that reads it. Validation errors name
    ``kv_transfer_params.<field>``: both flags true, ``do_remote_prefill`` without one of the
    lease's fields (the token but with ``transfer_mode``), or one of them without
    ``do_remote_prefill: true``, is refused.
    """

    # strict: "yes" is no bool, "8001" no port, true no block id (a 400 naming the field)
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    do_remote_decode: bool = Field(False, description="Prefill only; another server decodes.")
    do_remote_prefill: bool = Field(
        False, description="The KV cache comes from remote blocks.", validate_default=True
    )
    # vLLM's (before the lease fields, whose rules read it): set in vLLM 0.32.0's prefill
    # answers (dwdp.worker.disagg.vllm_nixl/vllm_reader); with it, remote_block_ids is written
    # as vLLM's one list per KV-cache group ([[...]]) and no remote_lease_token is needed
    transfer_mode: str | None = Field(default=None, max_length=16)
    remote_engine_id: str | None = Field(
        None, min_length=1, max_length=256, validate_default=True
    )
    remote_request_id: str | None = Field(
        None, min_length=1, max_length=256, validate_default=True
    )
    remote_block_ids: list[BlockId] | None = Field(
        None, max_length=MAX_BLOCKS, validate_default=True
    )
    remote_host: str | None = Field(None, min_length=1, max_length=253, validate_default=True)
    remote_port: int | None = Field(None, ge=1, le=65535, validate_default=True)
    remote_lease_token: str | None = Field(
        None, min_length=1, max_length=256, validate_default=True,
        description="The lease's secret: only the prefill answer carries it; the context "
        "server hands the lease's blocks to no one else (dwdp's field, beside vLLM's).",
    )
    tp_size: int = Field(1, ge=1, le=1, description="Tensor-parallel ranks of the context side.")
    # vLLM 0.32.0's other fields of a prefill answer (dwdp.worker.disagg.vllm_nixl): in the
    # answer of a vLLM prefill server or of a context rank that serves vLLM decode servers
    dcp_size: int | None = Field(default=None, ge=1, le=1)
    pp_size: int | None = Field(default=None, ge=1, le=1)
    remote_num_tokens: int | None = Field(default=None, ge=0)
    remote_blocks_expiry_time: float | None = None
    remote_prefill_cached_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """Refuse a key this contract does not know, naming the nearest known one."""
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    near = difflib.get_close_matches(str(key), cls.model_fields, n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise PydanticCustomError(
                        "kv_transfer_params",
                        "unknown key {key}{hint}: the keys are vLLM's NIXL connector's and "
                        "remote_lease_token", {"key": repr(key), "hint": hint})
        return data

    @field_validator("remote_block_ids", mode="before")
    @classmethod
    def _one_group(cls, value: Any) -> Any:
        """vLLM's shape, one list of block ids per KV-cache group: one group is taken as its
        list; more are refused (this engine has one KV-cache group)."""
        if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
            if len(value) != 1:
                raise PydanticCustomError(
                    "kv_transfer_params",
                    "{n} KV-cache groups of block ids; this engine has one",
                    {"n": len(value)},
                )
            return value[0]
        return value

    @field_validator("do_remote_prefill")
    @classmethod
    def _not_both(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("do_remote_decode"):
            raise PydanticCustomError("kv_transfer_params", "cannot be true with do_remote_decode")
        return value

    @field_validator(*_NEEDED_FOR_REMOTE_PREFILL)
    @classmethod
    def _lease_fields(cls, value: Any, info: ValidationInfo) -> Any:
        if "do_remote_prefill" not in info.data:
            return value  # its own type error names it; these rules read it
        given = value not in (None, [])
        vllm = info.field_name == "remote_lease_token" and info.data.get("transfer_mode")
        if not given and info.data.get("do_remote_prefill") and not vllm:
            raise PydanticCustomError("kv_transfer_params", "required with do_remote_prefill")
        if given and info.data.get("do_remote_prefill") is not True:
            raise PydanticCustomError(
                "kv_transfer_params",
                "only with do_remote_prefill: true (without it the prompt would be prefilled "
                "here while the lease it names waits unread); send do_remote_prefill: true or "
                "leave the remote_* fields out",
            )
        return value

    @field_serializer("remote_block_ids")
    def _groups(self, value: list[int] | None) -> list[int] | list[list[int]] | None:
        return [value] if value is not None and self.transfer_mode is not None else value

    @property
    def transfers(self) -> bool:
        """True when the request moves KV (either flag set)."""
        return self.do_remote_decode or self.do_remote_prefill

    @property
    def from_vllm(self) -> bool:
        """A prefill answer of vLLM's NIXL connector (``transfer_mode``, no dwdp lease token):
        its blocks are read through vLLM's ZMQ side channel, in vLLM's block size."""
        return self.transfer_mode is not None and self.remote_lease_token is None

    @property
    def block_ids(self) -> list[int]:
        """``remote_block_ids`` (empty when absent)."""
        return list(self.remote_block_ids or ())


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where other servers reach this connector: its ``engine_id`` (NIXL agent name) and the
    ``host``/``port`` of its side channel (this server's HTTP address)."""

    engine_id: str
    host: str
    port: int


KV_AGENT_PATH = "/v1/dwdp/kv_agent"
"""The KV side channel's HTTP path on a disaggregated server: ``GET`` answers ``describe``,
``DELETE`` ends a lease (``release_lease``)."""


@runtime_checkable
class KvServerSide(Protocol):
    """What an OpenAI server needs of a KV connector: its endpoint, who prefilled a request,
    and the release of a lease it will not read. An API server process
    (``dwdp.worker.server.core_client.RemoteKv``) has only this part."""

    @property
    def endpoint(self) -> KvEndpoint:
        """This connector's engine id and side-channel address."""

    async def release(self, params: KvTransferParams) -> None:
        """Generation side: tell the context server of ``params`` that this server will not
        read its lease (it refused the request); best effort, errors are logged."""

    def server_of(self, engine_id: str) -> dict[str, Any]:
        """The identity a connected remote server gave (``role``, ``group``, ``rank``,
        ``incarnation``, ``pod``; empty when unknown)."""


class KvHoldFull(RuntimeError):
    """``request_finished`` found no room to hold the request's KV now (vLLM interop: the
    staging buffer is full until the decode side reads or leases expire). The engine keeps the
    request, its blocks and its token, and asks again as holds end, for up to ``retry_s``
    seconds; then the request fails with this error (one line)."""

    def __init__(self, message: str, retry_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_s = retry_s


class TransferError(RuntimeError):
    """A KV transfer that cannot happen or failed (one line naming the cause): what a
    connector's calls raise (the server answers 502)."""


class StagingFull(TransferError, KvHoldFull):
    """A finished prefill found no room in the staging buffer its KV must pass through (vLLM
    interop). The engine keeps the request and stages it as soon as leases end, for up to
    ``retry_s`` (the lease time: a lease nobody reads or keeps alive has ended by then); past
    that it fails, answered 503 (vllm-router 0.1.17 in PD mode does not retry a prefill; the
    router gate in front of it sends the request again to other prefill servers, and a client
    gets a 500 carrying this message only when they all fail)."""


class LeaseError(TransferError):
    """``kv_transfer_params`` that name no lease this reader may read, found before any block
    is read: the client's error, answered ``status`` (400 contradictory params, 403 another
    lease's token, 410 no such lease) with a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@runtime_checkable
class KvConnector(KvServerSide, Protocol):
    """What the engine and the server call on a KV connector (see the module docstring).

    Blocks are ids in the engine's block table (``dwdp.worker.engine.blocks``), tokens in
    token order, ``block_size`` tokens each. Errors of a transfer raise ``TransferError``
    (the server answers 502); params that name no lease this server may read raise its
    subclass ``LeaseError`` (a 4xx naming the field).
    Thread use: ``prepare_load`` and ``describe`` run off the engine thread, the rest on it.
    """

    @property
    def leases(self) -> int:
        """Finished requests whose blocks the connector holds now (the engine polls it often
        while this is above 0, so the transfers it serves progress)."""

    # -- scheduler side ------------------------------------------------------------------------
    async def prepare_load(self, params: KvTransferParams) -> None:
        """Before a ``do_remote_prefill`` request is queued: reach the server of ``params``
        and claim its blocks. Raises ``TransferError`` when they cannot be read."""

    def request_finished(
        self, request_id: str, blocks: list[int], num_tokens: int | None = None
    ) -> KvTransferParams:
        """A ``do_remote_decode`` request produced its token: hold ``blocks`` (its
        ``num_tokens`` prompt tokens, when given) for the remote decoder (the engine frees them
        when ``finished_blocks`` returns them) and return the ``kv_transfer_params`` its answer
        carries. Raises ``KvHoldFull`` when there is no room to hold them yet."""

    def cancel_hold(self, request_id: str) -> None:
        """The request goes on after ``request_finished``: forget the hold, not its blocks
        (the request still owns them)."""

    # -- worker side ---------------------------------------------------------------------------
    def load(self, params: KvTransferParams, blocks: list[int]) -> None:
        """Read the blocks of ``params`` (after ``prepare_load``) into local ``blocks`` (the
        prompt's: as many as the params' unless they are vLLM's, in vLLM's block size), every
        layer, and release them on the remote side. Raises ``TransferError``."""

    def finished_blocks(self) -> list[list[int]]:
        """Block tables whose hold ended since the last call (read and released by the remote
        decoder, or expired): the engine frees them."""

    # -- server side ---------------------------------------------------------------------------
    def describe(self, claim: str | None = None, token: str | None = None) -> dict[str, Any]:
        """The side channel's JSON answer; with ``claim`` (a request id) and the lease's
        ``token``, that lease's blocks too (the hold is then extended). Raises ``LeaseError``
        (410 no such lease, 403 another token)."""

    def release_lease(self, request_id: str, token: str | None) -> None:
        """The decode side refused the request: end its lease now (the blocks come back at the
        engine's next ``finished_blocks``). Raises ``LeaseError`` as ``describe``."""

    def status(self) -> dict[str, int]:
        """Counters of ``/dwdp/status``'s ``kv_transfer`` (integers)."""

    def close(self) -> None:
        """Release what the connector registered (the server is stopping)."""
