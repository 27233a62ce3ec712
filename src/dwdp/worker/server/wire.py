"""The link between a rank's API server process and its engine core: its messages, typed.

The API server process (``dwdp.worker.server.api_process``, through ``dwdp.worker.server.
core_client``) parses HTTP and streams answers; the rank process runs the engine
(``dwdp.worker.server.engine_core``). They talk over one ZMQ ``ipc://`` socket in a directory
only the rank's user can enter (mode 0700): the API process holds a ``DEALER``, the engine core
a ``ROUTER``. Every message is one frame of msgpack (never pickle), one of the msgspec structs
below, defined here once for both ends: ``encode`` writes it, ``decode_request`` (the core)
and ``decode_answer`` (the API process) read it back, as a map whose ``op`` (API -> core) or
``kind`` (core -> API) names the struct. What a message carries are the engine protocol's own
values (``SamplingParams``, ``RequestOutput``, ``TokenLogprob``: dataclasses, written as maps of
their fields) and ``KvTransferParams`` (its JSON, validated by pydantic as it is read), so a
field added to one of them crosses the link with no change here.

API -> core (``Request``):

- ``Generate`` (``op`` ``generate``; ``id``, ``prompt`` [int], ``params`` SamplingParams,
  ``kv`` KvTransferParams | None, ``shared`` str | None): start a request; ``kv`` is its
  ``kv_transfer_params``, ``shared`` names the choices of one request that read one remote
  prefill.
- ``Abort`` (``abort``; ``id``): stop the request (the client left, or the stream was closed).
- a ``Call``, numbered by ``call`` (an int) and answered by one ``Reply``: ``Score``
  (``score``; ``prompt``, ``top``), ``Health`` (``health``), ``Release`` (``release``; ``kv``:
  the lease of a refused request ends).

Core -> API (``Answer``):

- ``Outs`` (``kind`` ``outs``; ``outs``): the updates of one engine step (or of one request
  that failed to start), each one of
  - ``Out`` (``out``; ``output`` RequestOutput, ``server`` map | None): one update of a
    request; ``server`` on a remote prefill's first update names the context server that
    prefilled it (``KvConnector.server_of``);
  - ``Failed`` (``error``; ``id``, ``error`` ErrorInfo): the request failed.
- ``Reply`` (``reply``; ``call``, ``value`` [TokenLogprob] | None, ``error`` ErrorInfo |
  None): a call's answer; ``value`` is ``score``'s.

A frame that is not one of these (a field a struct lacks, a wrong type, a missing field) does
not decode: ``WireError`` naming the field. Inside the engine's dataclasses an unknown field is
skipped (msgspec's rule for dataclasses). Errors cross as ``ErrorInfo``: ``type`` (one of
``ERROR_TYPES``), ``message`` and, for a ``LeaseError`` only, ``status``; ``error_of`` rebuilds
the exception the in-process engine would have raised.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dwdp.worker.engine.kv_connector import KvTransferParams, LeaseError, StagingFull, TransferError
from dwdp.worker.engine.protocol import (
    EngineDeadError,
    EngineError,
    RequestError,
    RequestOutput,
    SamplingParams,
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


class ErrorInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An exception as it crosses the link (module docstring)."""

    type: str
    message: str
    status: int | None = None


# -- API -> core -------------------------------------------------------------------------------
class Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="op"):
    """A message of the API process to the core."""


class Generate(Request, tag="generate"):
    """Start a request (module docstring)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    kv: KvTransferParams | None = None
    shared: str | None = None


class Abort(Request, tag="abort"):
    """Stop request ``id`` (an unknown one is ignored)."""

    id: str


class Call(Request):
    """A request answered by one ``Reply`` of the same ``call`` number (the client numbers
    it as it sends it)."""

    call: int = 0


class Score(Call, tag="score", kw_only=True):
    """``EngineClient.score_prompt``."""

    prompt: list[int]
    top: int


class Health(Call, tag="health"):
    """``EngineClient.check_health``."""


class Release(Call, tag="release", kw_only=True):
    """``KvServerSide.release``: the lease ``kv`` names ends."""

    kv: KvTransferParams


# -- core -> API -------------------------------------------------------------------------------
class Answer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """A message of the core to an API process, or one update inside ``Outs``."""


class Out(Answer, tag="out"):
    """One update of a request (module docstring)."""

    output: RequestOutput
    server: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        """The request's id."""
        return self.output.request_id


class Failed(Answer, tag="error"):
    """Request ``id`` failed with ``error``."""

    id: str
    error: ErrorInfo


class Outs(Answer, tag="outs"):
    """The updates of one engine step for one API process."""

    outs: list[Out | Failed]


class Reply(Answer, tag="reply"):
    """The answer to call ``call``: its ``value``, or the ``error`` it raised."""

    call: int
    value: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None


# -- bytes -------------------------------------------------------------------------------------
def _enc_hook(value: Any) -> Any:
    if isinstance(value, KvTransferParams):
        return value.model_dump(mode="json", exclude_none=True)
    raise NotImplementedError(f"the link does not carry a {type(value).__name__}")


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is KvTransferParams:  # a ValueError here becomes msgspec's ValidationError
        return KvTransferParams.model_validate(value)
    raise NotImplementedError(f"the link does not carry a {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_REQUESTS: msgspec.msgpack.Decoder[Generate | Abort | Score | Health | Release] = (
    msgspec.msgpack.Decoder(Generate | Abort | Score | Health | Release, dec_hook=_dec_hook))
_ANSWERS: msgspec.msgpack.Decoder[Outs | Reply] = msgspec.msgpack.Decoder(
    Outs | Reply, dec_hook=_dec_hook)


class _Addressed(msgspec.Struct):
    op: Any = None
    id: Any = None


_ADDRESSED = msgspec.msgpack.Decoder(_Addressed)


def encode(message: Request | Answer) -> bytes:
    """One message as the bytes of its frame."""
    return _ENCODER.encode(message)


def decode_request(frame: bytes) -> Generate | Abort | Score | Health | Release:
    """The message of a frame the API process sent; ``WireError`` naming what is wrong."""
    try:
        return _REQUESTS.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise WireError(f"a malformed message: {exc}") from exc


def decode_answer(frame: bytes) -> Outs | Reply:
    """The message of a frame the core sent; ``WireError`` naming what is wrong."""
    try:
        return _ANSWERS.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"a malformed message: {exc}") from exc


def generate_id(frame: bytes) -> str | None:
    """The ``id`` of a frame that is a map with ``op`` ``generate`` and a string ``id``, even
    when the rest does not decode (so the core can refuse that request); ``None`` otherwise."""
    try:
        found = _ADDRESSED.decode(frame)
    except msgspec.DecodeError:
        return None
    return found.id if found.op == "generate" and isinstance(found.id, str) else None


# -- errors ------------------------------------------------------------------------------------
def error_fields(exc: BaseException) -> ErrorInfo:
    """An exception as ``ErrorInfo``: the first of ``ERROR_TYPES`` it is an instance of
    (``EngineError`` for any other), its message, a ``LeaseError``'s status."""
    kind = next((name for name, cls in ERROR_TYPES.items() if isinstance(exc, cls)),
                "EngineError")
    message = str(exc) if kind != "EngineError" or isinstance(exc, EngineError) else (
        f"engine core: {type(exc).__name__}: {exc}")
    status = exc.status if isinstance(exc, LeaseError) else None
    return ErrorInfo(kind, message, status)


def error_of(info: ErrorInfo) -> Exception:
    """The exception ``info`` describes (``EngineError`` for an unknown type)."""
    cls = ERROR_TYPES.get(info.type, EngineError)
    if cls is LeaseError:
        return LeaseError(info.status or 410, info.message)
    return cls(info.message)
