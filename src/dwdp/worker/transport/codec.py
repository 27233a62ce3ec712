"""The wire format of the group collectives: msgpack with explicit types, never pickle.

A collective's bytes come from the rendezvous store, which any process that reaches its port
could once write; decoding them must never run code. So the payloads are plain values:

- ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``dict`` with ``str``
  keys (msgpack's own types);
- ``tuple`` (ext type :data:`EXT_TUPLE`: a msgpack array that decodes back to a tuple, so the
  hashable, comparable tuples of the setup phases survive the round trip);
- a *wire record*: a frozen dataclass that registered itself by name with
  :func:`wire_record` (ext type :data:`EXT_RECORD`: ``[name, [field values...]]``). Decoding
  looks the name up in this module's registry and calls that class with exactly its fields;
  an unknown name or a wrong field count is refused. There is no generic object decoder.

Every decoded blob is at most :data:`MAX_BLOB_BYTES`; anything malformed, oversized or of
an unknown type raises :class:`WireError` (the transport turns it into a ``TransportError``
naming the collective and the rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

MAX_BLOB_BYTES = 32 * 1024 * 1024
"""The largest encoded collective message (bytes): one rank's envelope in one exchange.
The largest real payloads (the scalar exchange, the expert handshake) are kilobytes."""

EXT_TUPLE = 1
"""msgpack ext code of a tuple (its data: a msgpack array of the items)."""
EXT_RECORD = 2
"""msgpack ext code of a wire record (its data: ``[name, [field values...]]``)."""

Payload = Any
"""What a collective carries: ``None | bool | int | float | str | bytes``, lists, tuples and
``str``-keyed dicts of payloads, and registered wire records. (Spelled ``Any`` because a
recursive union with records is not expressible for mypy; :func:`encode` enforces it.)"""

_T = TypeVar("_T")
_RECORDS: dict[str, type] = {}
_NAMES: dict[type, str] = {}


class WireError(ValueError):
    """A payload cannot be encoded, or a blob is not a well-formed message."""


def wire_record(name: str) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: let the dataclass travel in collectives under ``name``.

    The class is rebuilt on the receiving rank by calling it with its fields' values (in
    declaration order), so its own checks run there too. Raises ``TypeError`` for a
    non-dataclass or a name registered twice."""

    def register(cls: type[_T]) -> type[_T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"wire record {name!r}: {cls.__name__} is not a dataclass")
        if name in _RECORDS and _RECORDS[name] is not cls:
            raise TypeError(f"wire record {name!r} is registered twice")
        _RECORDS[name] = cls
        _NAMES[cls] = name
        return cls

    return register


def encode(value: Payload) -> bytes:
    """``value`` as msgpack bytes; raises :class:`WireError` for a type outside
    :data:`Payload` or a result over :data:`MAX_BLOB_BYTES`."""
    try:
        blob = msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise WireError(f"cannot encode the payload: {exc}") from None
    if len(blob) > MAX_BLOB_BYTES:
        raise WireError(f"the payload is {len(blob)} bytes, over the limit of "
                        f"{MAX_BLOB_BYTES} bytes")
    return blob


def decode(blob: bytes) -> Payload:
    """The value of msgpack bytes from :func:`encode`; raises :class:`WireError` for an
    oversized, truncated or malformed blob, a non-``str`` map key or an unknown ext type
    or record. Never executes code from the blob."""
    if len(blob) > MAX_BLOB_BYTES:
        raise WireError(f"{len(blob)} bytes, over the limit of {MAX_BLOB_BYTES} bytes")
    try:
        return _unpack(blob)
    except WireError:
        raise
    except Exception as exc:  # msgpack's own errors, and RecursionError on deep nesting
        raise WireError(f"not a well-formed message: {type(exc).__name__}: {exc}") from None


def _unpack(blob: bytes) -> Payload:
    return msgpack.unpackb(blob, ext_hook=_ext_hook, raw=False, strict_map_key=True,
                           use_list=True)


def _default(value: object) -> msgpack.ExtType:
    if type(value) is tuple:
        return msgpack.ExtType(EXT_TUPLE, encode(list(value)))
    name = _NAMES.get(type(value))
    if name is not None:
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]  # type: ignore[arg-type]
        return msgpack.ExtType(EXT_RECORD, encode([name, fields]))
    raise WireError(f"cannot encode a {type(value).__name__} (not a plain value, a tuple or "
                    "a registered wire record)")


def _ext_hook(code: int, data: bytes) -> object:
    if code == EXT_TUPLE:
        items = _unpack(data)
        if not isinstance(items, list):
            raise WireError("a tuple that is not an array")
        return tuple(items)
    if code == EXT_RECORD:
        body = _unpack(data)
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str)
                and isinstance(body[1], list)):
            raise WireError("a record that is not [name, [fields...]]")
        name, values = body
        cls = _RECORDS.get(name)
        if cls is None:
            raise WireError(f"unknown record type {name!r}")
        count = len(dataclasses.fields(cls))
        if len(values) != count:
            raise WireError(f"record {name!r} has {len(values)} fields, expected {count}")
        try:
            return cls(*values)
        except Exception as exc:
            raise WireError(f"record {name!r}: {type(exc).__name__}: {exc}") from None
    raise WireError(f"unknown ext type {code}")
