"""The link between a rank's API server process and its engine core: messages and their bytes.

The API server process (``dwdp.worker.server.api_process``) parses HTTP and streams answers;
the rank process runs the engine (``dwdp.worker.server.engine_core``). They talk over one ZMQ
``ipc://`` socket in a directory only the rank's user can enter (mode 0700): the API process
holds a ``DEALER``, the engine core a ``ROUTER``. Every message is one frame of msgpack (never
pickle): a map whose ``op`` (API -> core) or ``kind`` (core -> API) says what it is.

API -> core:

- ``{"op": "generate", "id", "prompt": [int], "params": {SamplingParams fields,
  ``structured`` a map of StructuredOutput's or None}, "kv": {...} |
  None, "shared": str | None}``: start a request; ``kv`` is its ``kv_transfer_params`` as JSON,
  ``shared`` names the choices of one request that read one remote prefill.
- ``{"op": "abort", "id"}``: stop the request (the client left, or the stream was closed).
- ``{"op": <call>, "call": int, ...}``: a call answered by one ``reply``: ``score`` (``prompt``,
  ``top``), ``health``, ``release`` (``kv``: the lease of a refused request ends).

Core -> API:

- ``{"kind": "outs", "outs": [...]}``: the updates of one engine step (or of one request that
  failed to start), each one of
  - ``{"kind": "out", "id", ...RequestOutput fields, "server": {...} | None}``: one update of a
    request; ``server`` on a remote prefill's first update names the context server that
    prefilled it (``KvConnector.server_of``);
  - ``{"kind": "error", "id", "error": {"type", "message", "status"}}``: the request failed.
- ``{"kind": "reply", "call", "value" | "error"}``: a call's answer.

Errors cross as ``type`` (one of ``ERROR_TYPES``) and ``message``; ``status`` only for a
``LeaseError``. ``raise_error`` rebuilds the exception the in-process engine would have raised.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from dwdp.worker.engine.kv_connector import KvTransferParams, LeaseError, StagingFull, TransferError
from dwdp.worker.engine.protocol import (
    EngineDeadError,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)

ERROR_TYPES: dict[str, type[Exception]] = {
    "RequestError": RequestError,
    "LeaseError": LeaseError,
    "StagingFull": StagingFull,
    "TransferError": TransferError,
    "EngineDeadError": EngineDeadError,
    "EngineError": EngineError,
}
"""The exceptions that cross the link, by name (a subclass before its base)."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message either side accepts (ZMQ's ``MAXMSGSIZE``): a prompt of a million
token ids packs to under 5 MiB."""


class WireError(ValueError):
    """A message that does not have the shape this module writes (a bug or a stranger)."""


def pack(message: dict[str, Any]) -> bytes:
    """One message as msgpack bytes."""
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def unpack(data: bytes) -> dict[str, Any]:
    """The message of one frame; raises ``WireError`` for anything but a msgpack map."""
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"not a msgpack message: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError(f"a message is a map, got {type(message).__name__}")
    return message


# -- requests ----------------------------------------------------------------------------------
def generate_message(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    kv: KvTransferParams | None,
    shared: str | None,
) -> dict[str, Any]:
    """The ``generate`` message of one request (module docstring)."""
    fields = dataclasses.asdict(params)  # ``structured`` becomes a map of its fields
    fields["stop"], fields["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    fields["logit_bias"] = [list(pair) for pair in params.logit_bias]
    return {
        "op": "generate",
        "id": request_id,
        "prompt": prompt_token_ids,
        "params": fields,
        "kv": kv.model_dump(mode="json", exclude_none=True) if kv is not None else None,
        "shared": shared,
    }


def sampling_params(fields: Any) -> SamplingParams:
    """The ``SamplingParams`` of a ``generate`` message; ``WireError`` for unknown fields."""
    if not isinstance(fields, dict):
        raise WireError("params: not a map")
    try:
        structured = fields.get("structured")
        if structured is not None:
            fields = {**fields, "structured": StructuredOutput(**structured)}
        params = SamplingParams(**fields)
    except TypeError as exc:
        raise WireError(f"params: {exc}") from exc
    return dataclasses.replace(
        params, stop=tuple(params.stop), stop_token_ids=tuple(params.stop_token_ids),
        logit_bias=tuple((int(t), float(b)) for t, b in params.logit_bias),
    )


def kv_params(data: Any) -> KvTransferParams | None:
    """The ``KvTransferParams`` of a message's ``kv`` (``None`` stays ``None``)."""
    return None if data is None else KvTransferParams.model_validate(data)


# -- outputs -----------------------------------------------------------------------------------
def _logprob_fields(lp: TokenLogprob) -> list[Any]:
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank]


def _logprob(fields: list[Any]) -> TokenLogprob:
    token_id, logprob, top, rank = fields
    return TokenLogprob(token_id, logprob, tuple((int(t), float(v)) for t, v in top), rank)


def logprobs_value(entries: list[TokenLogprob]) -> list[list[Any]]:
    """``TokenLogprob``s as msgpack-able lists (``score``'s reply, an output's ``logprobs``)."""
    return [_logprob_fields(lp) for lp in entries]


def logprobs_of(value: list[list[Any]]) -> list[TokenLogprob]:
    """The inverse of ``logprobs_value``."""
    return [_logprob(f) for f in value]


def output_message(out: RequestOutput, server: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``out`` message of one update."""
    kv = out.kv_transfer_params
    return {
        "kind": "out",
        "id": out.request_id,
        "token_ids": out.token_ids,
        "text": out.text,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "logprobs": None if out.logprobs is None else logprobs_value(out.logprobs),
        "kv": kv.model_dump(mode="json", exclude_none=True) if kv is not None else None,
        "cached_tokens": out.cached_tokens,
        "server": server,
    }


def request_output(message: dict[str, Any]) -> RequestOutput:
    """The ``RequestOutput`` of an ``out`` message."""
    lps = message.get("logprobs")
    return RequestOutput(
        request_id=message["id"],
        token_ids=list(message["token_ids"]),
        text=message["text"],
        prompt_tokens=message["prompt_tokens"],
        completion_tokens=message["completion_tokens"],
        finished=message["finished"],
        finish_reason=message["finish_reason"],
        logprobs=None if lps is None else logprobs_of(lps),
        kv_transfer_params=kv_params(message.get("kv")),
        cached_tokens=message.get("cached_tokens", 0),
    )


# -- errors ------------------------------------------------------------------------------------
def error_fields(exc: BaseException) -> dict[str, Any]:
    """An exception as the ``error`` of a message: the first of ``ERROR_TYPES`` it is an
    instance of (``EngineError`` for any other), its message, a ``LeaseError``'s status."""
    kind = next((name for name, cls in ERROR_TYPES.items() if isinstance(exc, cls)),
                "EngineError")
    message = str(exc) if kind != "EngineError" or isinstance(exc, EngineError) else (
        f"engine core: {type(exc).__name__}: {exc}")
    return {"type": kind, "message": message, "status": getattr(exc, "status", None)}


def error_of(fields: Any) -> Exception:
    """The exception an ``error`` map describes (``EngineError`` for an unknown type)."""
    if not isinstance(fields, dict):
        return EngineError("engine core: a malformed error")
    cls = ERROR_TYPES.get(str(fields.get("type")), EngineError)
    message = str(fields.get("message", ""))
    if cls is LeaseError:
        return LeaseError(int(fields.get("status") or 410), message)
    return cls(message)
