"""The group transport interface: allgather with a status in every exchange.

A transport connects the ``world_size`` ranks of one DWDP group incarnation. Its one
primitive is an allgather of bytes; on top of it, :meth:`GroupTransport.exchange` sends every
rank's payload *and* its status (``None`` or an error message) together, so a failing rank
still takes part in the collective and its error reaches every rank there (docs/design.md §6.3,
fail-together). Every exchange also carries a label and a sequence number; ranks that
disagree on either raise :class:`CollectiveMismatch` on every rank instead of pairing
unrelated collectives.

Invariant: after each exchange every rank holds the same :class:`Exchange` (the same
payloads, the same errors), so any verdict computed from it is the same on every rank.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from dwdp.api.contract import RENDEZVOUS_SECRET_BYTES, Env
from dwdp.worker.transport.codec import Payload, WireError, decode, encode

DEFAULT_RENDEZVOUS_TIMEOUT_S = 1800.0
"""Seconds a rank waits for its peers at the rendezvous and at each collective."""



class TransportError(RuntimeError):
    """A group transport could not complete a collective."""


class RendezvousSecretError(ValueError):
    """The rendezvous secret file is not configured, not readable or too short (a
    configuration error: the worker's termination line starts ``config:``)."""


class RendezvousTimeout(TransportError):
    """Some ranks did not arrive within the timeout; ``missing`` names them."""

    def __init__(self, message: str, *, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.missing = missing


class CollectiveMismatch(TransportError):
    """Ranks entered different collectives (labels or sequence numbers differ)."""


class GroupFailure(TransportError):
    """One or more ranks reported an error in an exchange; raised on every rank alike.

    ``label`` names the collective and ``errors`` maps each failing rank to its message.
    """

    def __init__(self, label: str, errors: Mapping[int, str]) -> None:
        self.label = label
        self.errors = dict(sorted(errors.items()))
        detail = "; ".join(f"rank {r}: {m}" for r, m in self.errors.items())
        super().__init__(
            f"collective {label!r} failed on rank(s) {list(self.failed_ranks)}: {detail}")

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(self.errors)


@dataclass(frozen=True, slots=True)
class Exchange:
    """The result of one collective: every rank's payload and every rank's error.

    ``payloads[r]`` is what rank ``r`` sent (``None`` where it sent nothing);
    ``errors`` holds only the ranks that reported a failure.
    """

    label: str
    payloads: tuple[Payload, ...]
    errors: Mapping[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no rank reported an error."""
        return not self.errors

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.errors))

    def raise_if_failed(self) -> None:
        """Raise :class:`GroupFailure` (on every rank alike) if any rank reported an error."""
        if self.errors:
            raise GroupFailure(self.label, self.errors)


@dataclass(frozen=True, slots=True)
class RendezvousConfig:
    """Where and how a rank joins its group (the environment of docs/design.md §5.1).

    ``address`` is ``(host, port)`` of the store that rank 0 hosts, or ``None`` where the
    transport needs none (MPI). ``timeout_s`` is in seconds. ``secret`` is the group
    incarnation's rendezvous secret (at least ``RENDEZVOUS_SECRET_BYTES`` raw bytes): every
    connection to the store proves it knows it. Raises ``ValueError`` naming a bad field.
    """

    group: str
    incarnation: str
    rank: int
    world_size: int
    secret: bytes = field(repr=False)
    address: tuple[str, int] | None = None
    timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"{Env.WORLD_SIZE} must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{Env.RANK}={self.rank} is outside [0, {self.world_size})")
        if self.timeout_s <= 0:
            raise ValueError(f"{Env.RENDEZVOUS_TIMEOUT_S} must be > 0 s, got {self.timeout_s}")
        if len(self.secret) < RENDEZVOUS_SECRET_BYTES:
            raise ValueError(
                f"the rendezvous secret is {len(self.secret)} bytes; it must be at least "
                f"{RENDEZVOUS_SECRET_BYTES} random bytes ({Env.RENDEZVOUS_SECRET_FILE})")
        for name, value in (("group", self.group), ("incarnation", self.incarnation)):
            if not value or "/" in value:
                raise ValueError(f"the {name} name {value!r} must be non-empty without '/'")

    @property
    def namespace(self) -> str:
        """The key prefix of this group incarnation: a rank of an old incarnation never
        meets the keys of a new one."""
        return f"dwdp/{self.group}/{self.incarnation}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Read the rendezvous contract; raises ``ValueError`` naming a missing or bad
        variable (:class:`RendezvousSecretError` for the secret file).
        ``DWDP_RENDEZVOUS`` (``host:port``) is optional here."""
        env = os.environ if environ is None else environ

        def need(name: str) -> str:
            value = env.get(name)
            if value is None or value == "":
                raise ValueError(f"environment variable {name} is not set")
            return value

        def integer(name: str) -> int:
            try:
                return int(need(name))
            except ValueError as exc:
                if "not set" in str(exc):
                    raise
                raise ValueError(f"{name}={env.get(name)!r} is not an integer") from None

        address = None
        if env.get(Env.RENDEZVOUS):
            address = parse_address(env[Env.RENDEZVOUS])
        timeout_text = env.get(Env.RENDEZVOUS_TIMEOUT_S) or str(DEFAULT_RENDEZVOUS_TIMEOUT_S)
        try:
            timeout_s = float(timeout_text)
        except ValueError:
            raise ValueError(
                f"{Env.RENDEZVOUS_TIMEOUT_S}={timeout_text!r} is not a number of seconds"
            ) from None
        return cls(
            group=need(Env.GROUP),
            incarnation=need(Env.INCARNATION),
            rank=integer(Env.RANK),
            world_size=integer(Env.WORLD_SIZE),
            secret=read_secret(env),
            address=address,
            timeout_s=timeout_s,
        )


def read_secret(environ: Mapping[str, str]) -> bytes:
    """The rendezvous secret: the raw bytes of the file ``DWDP_RENDEZVOUS_SECRET_FILE``
    names. Raises :class:`RendezvousSecretError` (one line naming the variable and the
    path) when it is unset, unreadable or shorter than ``RENDEZVOUS_SECRET_BYTES``."""
    name = Env.RENDEZVOUS_SECRET_FILE
    path = environ.get(name)
    if not path:
        raise RendezvousSecretError(
            f"environment variable {name} is not set: it names the file of the group's "
            "rendezvous secret (the operator mounts one; dwdp launch makes one)")
    try:
        secret = Path(path).read_bytes()
    except OSError as exc:
        raise RendezvousSecretError(
            f"{name}={path!r} cannot be read: {exc.strerror or exc}") from None
    if len(secret) < RENDEZVOUS_SECRET_BYTES:
        raise RendezvousSecretError(
            f"{name}={path!r} holds {len(secret)} bytes; a rendezvous secret is at least "
            f"{RENDEZVOUS_SECRET_BYTES} random bytes")
    return secret


def make_secret_file(directory: str | os.PathLike[str] | None = None) -> Path:
    """A new private file (mode 0600) in ``directory`` (default: the temp directory) holding
    ``RENDEZVOUS_SECRET_BYTES`` random bytes: a local run's rendezvous secret. The caller
    removes it."""
    fd, name = tempfile.mkstemp(prefix="dwdp-rendezvous-", dir=directory)
    try:
        os.write(fd, os.urandom(RENDEZVOUS_SECRET_BYTES))
    finally:
        os.close(fd)
    return Path(name)


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) -> ``(host, port)``; raises ``ValueError``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{Env.RENDEZVOUS}={text!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class _Envelope:
    """One rank's message in one collective; on the wire ``[seq, label, error, payload]``."""

    seq: int
    label: str
    error: str | None
    payload: Payload

    def to_bytes(self) -> bytes:
        """The envelope encoded; a payload that cannot travel (a type outside
        :data:`~dwdp.worker.transport.codec.Payload`, too large) becomes this rank's error,
        so every rank still reaches the same verdict."""
        try:
            return encode([self.seq, self.label, self.error, self.payload])
        except WireError as exc:
            error = f"{self.error}; " if self.error else ""
            error += f"its payload could not be sent: {exc}"
            return encode([self.seq, self.label, error, None])

    @classmethod
    def from_bytes(cls, blob: bytes, *, rank: int, label: str) -> _Envelope:
        """Decode rank ``rank``'s message of collective ``label``; raises
        :class:`TransportError` naming both for a malformed or oversized blob."""
        try:
            value = decode(blob)
        except WireError as exc:
            raise TransportError(
                f"collective {label!r}: the message of rank {rank} was refused: {exc}") from None
        if not (isinstance(value, list) and len(value) == 4 and type(value[0]) is int
                and isinstance(value[1], str) and (value[2] is None or isinstance(value[2], str))):
            raise TransportError(
                f"collective {label!r}: the message of rank {rank} was refused: not an "
                "envelope [seq, label, error, payload]")
        return cls(value[0], value[1], value[2], value[3])


class GroupTransport(ABC):
    """The collectives of one DWDP group incarnation, with a status in every exchange.

    Subclasses implement :meth:`_allgather_bytes`; everything else is shared. Every rank
    must call the same collectives in the same order; a rank that fails keeps calling
    them with its error (``exchange(..., error=msg)``) until the verdict is reached.
    """

    rank: int
    world_size: int

    def __init__(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seq = 0

    @abstractmethod
    def _allgather_bytes(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
        """Every rank's ``data`` for collective number ``seq`` (named ``label`` in errors),
        in rank order. Raises :class:`RendezvousTimeout` naming the ranks still missing
        after ``timeout_s`` seconds."""

    def exchange(self, payload: Payload, *, label: str, error: str | None = None) -> Exchange:
        """Send ``payload`` and this rank's status; return what every rank sent.

        ``payload`` is a :data:`~dwdp.worker.transport.codec.Payload` (plain values, tuples,
        registered wire records; one that cannot be encoded is sent as this rank's error).
        ``error`` is ``None`` for success or a one-line message. Never raises for another
        rank's error (see :meth:`Exchange.raise_if_failed`); raises
        :class:`CollectiveMismatch` when ranks are in different collectives and
        :class:`TransportError` when the group cannot be reached or a rank's message is
        malformed (naming the collective and the rank).
        """
        seq = self._seq
        self._seq += 1
        blob = _Envelope(seq, label, error, payload).to_bytes()
        raw = self._allgather_bytes(blob, seq=seq, label=label)
        envelopes = [_Envelope.from_bytes(b, rank=r, label=label) for r, b in enumerate(raw)]
        seen = {(e.seq, e.label) for e in envelopes}
        if len(seen) != 1:
            where = ", ".join(f"rank {r}: #{e.seq} {e.label!r}" for r, e in enumerate(envelopes))
            raise CollectiveMismatch(f"ranks are in different collectives ({where})")
        errors = {r: e.error for r, e in enumerate(envelopes) if e.error is not None}
        return Exchange(label, tuple(e.payload for e in envelopes), errors)

    def allgather(self, payload: Payload, *, label: str) -> list[Payload]:
        """Every rank's ``payload``; raises :class:`GroupFailure` if any rank failed."""
        result = self.exchange(payload, label=label)
        result.raise_if_failed()
        return list(result.payloads)

    def barrier(self, *, label: str = "barrier") -> None:
        """Return once every rank reached this barrier (no payload)."""
        self.exchange(None, label=label).raise_if_failed()

    def close(self, *, linger: bool = True) -> None:  # noqa: B027 - optional hook
        """Leave the group; safe to call twice. ``linger``: a collective may still be in
        flight on the peers (setup, a failure), so a rank that hosts what they read keeps
        it until they left; ``False`` once no collective can follow (after serving)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
