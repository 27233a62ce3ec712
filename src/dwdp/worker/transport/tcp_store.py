"""The TCP store rendezvous: rank 0 hosts the group's store, every rank joins.

Keys live under ``dwdp/<group>/<incarnation>/`` (:attr:`RendezvousConfig.namespace`), so a
rank of an old incarnation that reaches a new incarnation's store never meets its keys.
Collective number ``k`` writes ``<ns>/c<k>/<rank>`` and polls for the peers' keys until
the timeout; a timeout names the ranks whose keys never appeared. The first collective is
the join: it carries every rank's host identity, and a loopback rendezvous address shared
by ranks on different hosts is refused on every rank (seed 004: a loopback store across
hosts would connect each host to a store of its own).

The store is our own (``store``), not ``torch.distributed.TCPStore``: torch's store takes
any client, so anything that reached the port could read or write the collectives. Every
connection to ours proves it knows the group incarnation's secret
(:attr:`RendezvousConfig.secret`); the collectives' bytes are msgpack (``codec``), never
pickle.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence

from dwdp.api.contract import Env
from dwdp.worker.transport.base import (
    GroupTransport,
    RendezvousConfig,
    RendezvousTimeout,
    TransportError,
)
from dwdp.worker.transport.store import (
    KeyValueStore,
    SecretRefused,
    StoreClient,
    StoreServer,
)

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.05
_CLOSE_WAIT_MAX_S = 60.0
"""Rank 0 keeps the store up at most this long (seconds) for the peers to finish."""
CONNECTIONS_PER_RANK = 4
"""Rank 0's store holds at most this many connections per rank of the group at once."""


class LoopbackAcrossHosts(TransportError):
    """The rendezvous address is a loopback address but the ranks run on several hosts."""


def is_loopback(host: str) -> bool:
    """True when ``host`` names this machine's loopback interface (127.0.0.0/8, ::1,
    ``localhost`` or a name that resolves only to loopback addresses)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host.lower() == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback
                                   for a in addresses)


def check_rendezvous_hosts(host: str, host_ids: Sequence[str]) -> None:
    """Refuse a loopback rendezvous ``host`` for ranks on more than one host.

    ``host_ids[r]`` identifies rank r's machine. Raises :class:`LoopbackAcrossHosts`.
    """
    distinct = sorted(set(host_ids))
    if len(distinct) > 1 and is_loopback(host):
        by_host = {h: [r for r, x in enumerate(host_ids) if x == h] for h in distinct}
        where = ", ".join(f"{h}: ranks {rs}" for h, rs in by_host.items())
        raise LoopbackAcrossHosts(
            f"{Env.RENDEZVOUS} host {host!r} is a loopback address, but the ranks run on "
            f"{len(distinct)} hosts ({where}); use an address of rank 0's host that every "
            "host can reach"
        )


class TcpStoreTransport(GroupTransport):
    """A group transport over the authenticated store that rank 0 hosts.

    ``host_id`` identifies this rank's machine for the loopback check (default: the host
    name). Construction joins the group (a collective): it returns once every rank
    arrived, or raises :class:`RendezvousTimeout` naming the missing ranks after
    ``config.timeout_s`` seconds, :class:`~dwdp.worker.transport.store.SecretRefused` when
    rank 0's store holds another secret, or :class:`LoopbackAcrossHosts`.
    """

    def __init__(self, config: RendezvousConfig, *, host_id: str | None = None) -> None:
        if config.address is None:
            raise ValueError(f"the TCP store rendezvous needs {Env.RENDEZVOUS}=host:port")
        super().__init__(rank=config.rank, world_size=config.world_size,
                         timeout_s=config.timeout_s)
        self.config = config
        self.host_id = host_id if host_id is not None else socket.gethostname()
        self._closed = False
        self._aborted_at: int | None = None
        self._server: StoreServer | None = None
        self._client: StoreClient | None = None
        host, port = config.address
        deadline = time.monotonic() + config.timeout_s
        self._store: KeyValueStore
        if config.rank == 0:
            try:
                self._server = StoreServer(
                    host, port, config.secret,
                    max_connections=CONNECTIONS_PER_RANK * config.world_size)
            except OSError as exc:
                raise TransportError(
                    f"rank 0 could not host the rendezvous store on {host}:{port}: {exc}"
                ) from exc
            self._store = self._server.table
        else:
            try:
                self._client = StoreClient.connect(host, port, config.secret,
                                                   deadline=deadline, timeout_s=config.timeout_s)
            except SecretRefused:
                raise
            except TransportError as exc:
                raise RendezvousTimeout(
                    f"group {config.group!r} incarnation {config.incarnation!r}: the "
                    f"rendezvous store at {host}:{port} (hosted by rank 0) was not reachable "
                    f"within {config.timeout_s:g} s ({Env.RENDEZVOUS_TIMEOUT_S}); missing "
                    f"rank(s) [0]: {exc}",
                    missing=(0,),
                ) from exc
            self._store = self._client
        try:
            host_ids = self.allgather(self.host_id, label="join")
            check_rendezvous_hosts(host, host_ids)
        except Exception:
            self.close()
            raise
        except BaseException:  # stopped (a signal): no peer waits on a verdict from here
            self.close(linger=False)
            raise
        self.host_ids: tuple[str, ...] = tuple(str(h) for h in host_ids)

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.config.namespace}/c{seq}/{rank}"

    def _allgather_bytes(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
        if self._closed:
            raise TransportError("the TCP store transport is closed")
        try:
            return self._allgather_on_store(data, seq=seq, label=label)
        except TransportError:
            raise
        except Exception as exc:  # the store's own errors: connection lost, store timeout
            self._closed = True
            raise TransportError(
                f"rank {self.rank} lost the rendezvous store (hosted by rank 0) in collective "
                f"#{seq} {label!r}: {exc}"
            ) from exc

    def _allgather_on_store(self, data: bytes, *, seq: int, label: str) -> list[bytes]:
        store = self._store
        abort_key = f"{self.config.namespace}/abort"
        store.set(self._key(seq, self.rank), data)
        keys = {r: self._key(seq, r) for r in range(self.world_size)}
        pending = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_MIN_S
        while pending:
            pending = [r for r in pending if not store.check([keys[r]])]
            if not pending:
                break
            if store.check([abort_key]):  # a peer timed out first: fail with its verdict
                message = (store.get(abort_key) or b"").decode(errors="replace")
                self._aborted_at = seq
                self.close()
                raise RendezvousTimeout(message, missing=_missing_from(message))
            if time.monotonic() >= deadline:
                message = (
                    f"group {self.config.group!r} incarnation {self.config.incarnation!r}: "
                    f"rank(s) {pending} did not arrive at collective #{seq} {label!r} within "
                    f"{self.timeout_s:g} s ({Env.RENDEZVOUS_TIMEOUT_S})"
                )
                # The first rank to time out publishes its verdict, so the ranks that are
                # present fail with the same message instead of losing rank 0's store.
                verdict = store.compare_set(abort_key, b"", message.encode())
                message = (verdict or message.encode()).decode(errors="replace")
                self._aborted_at = seq
                self.close()
                raise RendezvousTimeout(message, missing=_missing_from(message))
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        values = store.multi_get([keys[r] for r in range(self.world_size)])
        if seq > 0:  # every rank wrote #seq, so every rank finished reading #seq - 1
            store.delete(self._key(seq - 1, self.rank))
        return [v if v is not None else b"" for v in values]

    def close(self, *, linger: bool = True) -> None:
        """Leave the group. With ``linger`` rank 0 keeps hosting the store until every peer
        left (at most min(timeout, 60) seconds), so no peer loses the store in its last
        collective; without (after serving: no collective follows) it stops at once, so a
        peer killed without leaving does not hold rank 0's exit (and its pod) for a minute."""
        if self._closed:
            return
        self._closed = True
        ns = self.config.namespace
        try:
            if self.rank != 0:
                self._store.set(f"{ns}/left/{self.rank}", b"1")
            elif linger:
                keys = [f"{ns}/left/{r}" for r in range(1, self.world_size)]
                if self._aborted_at is not None:  # wait only for the ranks that are present
                    keys = [k for r, k in enumerate(keys, 1)
                            if self._store.check([self._key(self._aborted_at, r)])]
                deadline = time.monotonic() + min(self.timeout_s, _CLOSE_WAIT_MAX_S)
                while keys and time.monotonic() < deadline:
                    keys = [k for k in keys if not self._store.check([k])]
                    if keys:
                        time.sleep(_POLL_MAX_S / 5)
        except Exception:  # the peers are gone already: nothing to wait for
            pass
        finally:
            if self._client is not None:
                self._client.close()
            if self._server is not None:
                self._server.stop()


def _missing_from(message: str) -> tuple[int, ...]:
    """The rank list of a timeout message ("rank(s) [3, 5] did not arrive ...")."""
    start = message.find("rank(s) [")
    if start < 0:
        return ()
    inner = message[start + len("rank(s) [") : message.find("]", start)]
    return tuple(int(x) for x in inner.split(",") if x.strip())


def from_env() -> TcpStoreTransport:
    """Join the group the environment describes (docs/design.md §5.1) over the TCP store."""
    return TcpStoreTransport(RendezvousConfig.from_env())
