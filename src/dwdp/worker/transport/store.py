"""The rendezvous store: a small key-value server on rank 0 that only the group can use.

Authentication is the standard library's ``multiprocessing.connection`` challenge-response
(an HMAC of a random challenge keyed with the group incarnation's secret, in both directions:
the server proves the secret to the client too). Only its ``send_bytes``/``recv_bytes``
framing is used, never ``send``/``recv`` (which pickle). On top, our own protocol: every
request is a msgpack array ``[op, *args]`` and every answer ``["ok", result]``:

==============  ===========================  =========================================
op              args                         result
==============  ===========================  =========================================
``set``         key, value (bytes)           ``None``
``get``         key                          the value, or ``None`` when absent
``check``       [keys]                       ``True`` when every key is present
``multi_get``   [keys]                       [value or ``None``] per key
``compare_set`` key, expected, desired       the value after: ``desired`` is stored when
                                             the current value is ``expected`` (``b""``
                                             also matching an absent key)
``delete``      key                          ``True`` when the key existed
==============  ===========================  =========================================

Bounds: a frame is at most :data:`MAX_FRAME_BYTES`, a key at most :data:`MAX_KEY_BYTES`, the
server holds at most ``max_connections`` connections, and a connection that has not
authenticated within :data:`HANDSHAKE_TIMEOUT_S` is dropped. A connection that fails the
handshake, sends a malformed or oversized frame or an unknown op is dropped with one log
line; the server keeps serving everyone else.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Protocol

import msgpack

from dwdp.api.contract import Env
from dwdp.worker.transport.base import TransportError

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""The largest request or answer frame (bytes); a larger one drops its connection."""
MAX_KEY_BYTES = 1024
"""The longest key (UTF-8 bytes)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a new connection has to complete the secret handshake."""
_ACCEPT_POLL_S = 0.1


class SecretRefused(TransportError):
    """The rendezvous store refused this rank's secret (or proved a different one)."""


class KeyValueStore(Protocol):
    """What the TCP store transport needs of a store (keys: ``str``, values: ``bytes``)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def check(self, keys: Sequence[str]) -> bool: ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes | None: ...

    def delete(self, key: str) -> bool: ...


class Table:
    """The server's keys, safe across its connection threads (rank 0 uses it directly)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._data.get(k) for k in keys]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes | None:
        with self._lock:
            current = self._data.get(key)
            if current == expected or (current is None and expected == b""):
                self._data[key] = desired
            return self._data.get(key)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None


class BadRequest(ValueError):
    """A frame that is not a well-formed request of a known op."""


def _key(value: object) -> str:
    if not isinstance(value, str) or len(value.encode()) > MAX_KEY_BYTES:
        raise BadRequest(f"a key must be a str of at most {MAX_KEY_BYTES} bytes")
    return value


def _keys(value: object) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest("keys must be an array")
    return [_key(k) for k in value]


def _value(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise BadRequest("a value must be bytes")
    return value


def apply_request(table: Table, frame: bytes) -> object:
    """Decode one request frame and apply it to ``table``; returns the result.
    Raises :class:`BadRequest` for a malformed frame, an unknown op or bad arguments."""
    try:
        request = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack's errors: not a well-formed frame
        raise BadRequest(f"malformed frame ({type(exc).__name__})") from None
    if not isinstance(request, list) or not request or not isinstance(request[0], str):
        raise BadRequest("a request must be [op, *args]")
    op, args = request[0], request[1:]
    shapes = {"set": 2, "get": 1, "check": 1, "multi_get": 1, "compare_set": 3, "delete": 1}
    if op not in shapes:
        raise BadRequest(f"unknown op {op[:40]!r}")
    if len(args) != shapes[op]:
        raise BadRequest(f"op {op!r} takes {shapes[op]} argument(s), got {len(args)}")
    if op == "set":
        table.set(_key(args[0]), _value(args[1]))
        return None
    if op == "get":
        return table.get(_key(args[0]))
    if op == "check":
        return table.check(_keys(args[0]))
    if op == "multi_get":
        return table.multi_get(_keys(args[0]))
    if op == "compare_set":
        return table.compare_set(_key(args[0]), _value(args[1]), _value(args[2]))
    return table.delete(_key(args[0]))


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel receive/send timeouts (0: none) that hold for every descriptor of ``sock``
    (``settimeout`` would make the shared descriptor non-blocking instead)."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class StoreServer:
    """The store rank 0 hosts on ``host:port`` (``host``'s own address when it is one of this
    machine's, else every address), for clients that know ``secret``.

    Serves from daemon threads: one accept loop and one thread per connection, at most
    ``max_connections`` at once. :attr:`table` is the data (rank 0's own access). Raises
    ``OSError`` when the port cannot be bound. :meth:`stop` ends it (safe to call twice).
    """

    def __init__(self, host: str, port: int, secret: bytes, *, max_connections: int) -> None:
        self.table = Table()
        self.secret = secret
        self.max_connections = max_connections
        self._listener = _bind_listener(host, port)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._open: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accepting = threading.Thread(target=self._accept_loop, daemon=True,
                                           name=f"dwdp-store-{port}")
        self._accepting.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._selector.select(_ACCEPT_POLL_S) or self._stopping.is_set():
                continue
            try:
                sock, peer = self._listener.accept()
            except OSError:
                continue
            where = f"{peer[0]}:{peer[1]}"
            with self._lock:
                full = len(self._open) >= self.max_connections
                if not full:
                    self._open[sock.fileno()] = sock
            if full:
                log.warning("rendezvous store: connection from %s dropped: %d connections "
                            "already open (the limit)", where, self.max_connections)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, where), daemon=True,
                             name=f"dwdp-store-conn-{where}").start()

    def _serve(self, sock: socket.socket, where: str) -> None:
        fd = sock.fileno()
        conn = None
        try:
            _set_timeouts(sock, HANDSHAKE_TIMEOUT_S)
            conn = Connection(os.dup(fd))
            try:
                deliver_challenge(conn, self.secret)
                answer_challenge(conn, self.secret)
            except (AuthenticationError, EOFError, OSError) as exc:
                if not self._stopping.is_set():
                    log.warning("rendezvous store: connection from %s dropped: authentication "
                                "failed (%s)", where, exc or type(exc).__name__)
                return
            _set_timeouts(sock, 0)
            self._answer(conn, where)
        finally:
            if conn is not None:
                conn.close()
            with self._lock:
                self._open.pop(fd, None)
            sock.close()

    def _answer(self, conn: Connection, where: str) -> None:
        while not self._stopping.is_set():
            try:
                frame = conn.recv_bytes(MAX_FRAME_BYTES)
            except EOFError:
                return  # the client left
            except OSError as exc:
                if not self._stopping.is_set():
                    log.warning("rendezvous store: connection from %s dropped: %s (frames are "
                                "at most %d bytes)", where, exc, MAX_FRAME_BYTES)
                return
            try:
                result = apply_request(self.table, frame)
            except BadRequest as exc:
                log.warning("rendezvous store: connection from %s dropped: %s", where, exc)
                return
            try:
                conn.send_bytes(msgpack.packb(["ok", result], use_bin_type=True))
            except OSError:
                return

    def stop(self) -> None:
        """Stop accepting, drop every connection, wait for the accept loop."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._accepting.join(timeout=5 * _ACCEPT_POLL_S + 1)
        self._selector.close()
        self._listener.close()
        with self._lock:
            open_now = list(self._open.values())
        for sock in open_now:  # wakes the connection threads out of recv
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class StoreClient:
    """A connection to rank 0's store, authenticated with ``secret``.

    :meth:`connect` retries until ``deadline`` (monotonic seconds) while rank 0 starts.
    Every call waits at most ``timeout_s`` for the answer. Raises :class:`TransportError`
    when the connection fails or the server answers out of protocol.
    """

    def __init__(self, conn: Connection, where: str) -> None:
        self._conn = conn
        self._where = where
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, secret: bytes, *, deadline: float,
                timeout_s: float) -> StoreClient:
        """Connect and authenticate; raises :class:`SecretRefused` when the secrets differ
        and ``TransportError`` when nothing answered by ``deadline``."""
        pause = 0.01
        while True:
            try:
                conn = Client((host, port), family="AF_INET", authkey=secret)
                break
            except AuthenticationError as exc:
                raise SecretRefused(
                    f"the rendezvous store at {host}:{port} and this rank hold different "
                    f"secrets ({Env.RENDEZVOUS_SECRET_FILE}): {exc}") from None
            except (OSError, EOFError) as exc:
                if time.monotonic() >= deadline:
                    raise TransportError(f"nothing answered on {host}:{port}: {exc}") from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            _set_timeouts(sock, timeout_s)
        return cls(conn, f"{host}:{port}")

    def _call(self, op: str, *args: object) -> object:
        with self._lock:
            self._conn.send_bytes(msgpack.packb([op, *args], use_bin_type=True))
            frame = self._conn.recv_bytes(MAX_FRAME_BYTES)
        try:
            answer = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:
            raise TransportError(f"the rendezvous store at {self._where} answered a malformed "
                                 f"frame ({type(exc).__name__})") from None
        if not (isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok"):
            raise TransportError(f"the rendezvous store at {self._where} answered out of "
                                 "protocol")
        return answer[1]

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes | None:
        return _optional_bytes(self._call("get", key))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self._call("multi_get", list(keys))
        if not isinstance(values, list) or len(values) != len(keys):
            raise TransportError(f"the rendezvous store at {self._where} answered out of "
                                 "protocol")
        return [_optional_bytes(v) for v in values]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes | None:
        return _optional_bytes(self._call("compare_set", key, expected, desired))

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def close(self) -> None:
        self._conn.close()


def _optional_bytes(value: object) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    raise TransportError("the rendezvous store answered a value that is not bytes")


def _bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket bound to ``host``'s own address when it is one of this machine's
    (stores of several groups on one host, each pod with its own address, do not clash on
    the port), else to every address. Raises ``OSError`` when the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    candidates = [addr for *_, addr in infos if not ipaddress.ip_address(addr[0]).is_unspecified]
    last: OSError | None = None
    for addr in [*candidates, ("0.0.0.0", port)]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(512)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:  # the port is taken: another address won't help
                raise
            last = exc
    assert last is not None
    raise last
