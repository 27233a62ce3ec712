"""``dwdp router-gate``: the gate's process (listen, guard, forward; start and watch the child).

Exit status: 0 after a stop signal (the child stopped too); 1 when the child exits on its own
or cannot start (the kubelet restarts the container, the gate and a new child with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from dwdp.worker.apikey import ApiKey
from dwdp.worker.gate.child import GateError
from dwdp.worker.gate.proxy import Gate, needs_key
from dwdp.worker.server.guard import RequestGuard
from dwdp.worker.server.listen import ListenError, listening_socket

log = logging.getLogger(__name__)


async def serve(
    argv: Sequence[str], *, host: str, port: int, api_key: ApiKey,
    graceful_shutdown_s: int = 20,
) -> int:
    """Serve the gate on ``host:port`` in front of a vllm-router child (``argv``) until a stop
    signal (0) or the child's failure (1). After a stop signal, requests in flight get
    ``graceful_shutdown_s`` seconds, then the child 5 s to stop: within the router pod's
    termination grace (35 s, of which its preStop sleep takes the first 5)."""
    import uvicorn

    try:
        sock = listening_socket(host, port)
    except ListenError as refused:
        log.error("router gate: %s", refused)
        return 1
    gate = Gate(argv, api_key)
    app = RequestGuard(gate, api_key=api_key, protected=needs_key)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="info",
                       access_log=False, timeout_graceful_shutdown=graceful_shutdown_s)
    )

    async def supervise() -> None:
        await gate.start()
        await gate.watch()

    child = asyncio.ensure_future(supervise())
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    status = 0
    try:
        await asyncio.wait({child, serving}, return_when=asyncio.FIRST_COMPLETED)
        if child.done() and not child.cancelled():
            exc = child.exception()
            log.error("router gate stops: %s", exc if isinstance(exc, GateError) else repr(exc))
            status = 1
            server.should_exit = True
        await serving
        if not server.started:
            log.error("router gate: could not listen on %s:%d", host, port)
            status = 1
    finally:
        child.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await child
        await gate.close()
    return status


def main(argv: Sequence[str], *, host: str, port: int, api_key: ApiKey) -> int:
    """Run ``serve`` in this (main) thread. uvicorn re-raises a stop signal after its shutdown
    to the handlers it found: ``returning_on_stop_signals`` turns that into a normal return,
    so the child is stopped."""
    from dwdp.worker.server.run import returning_on_stop_signals

    with returning_on_stop_signals():
        return asyncio.run(serve(argv, host=host, port=port, api_key=api_key))
