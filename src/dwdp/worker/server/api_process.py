"""The API server process of a rank: HTTP on the rank's port, the engine in the rank's process.

``dwdp worker`` starts one (``dwdp.worker.server.run.serve_with_api_process``), as vLLM starts
its API server apart from its engine core, so that parsing requests, rendering JSON and
streaming tokens never hold the interpreter lock the engine's step launches need. It serves:

- the OpenAI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) over an
  ``EngineCoreClient`` (``dwdp.worker.server.core_client``): tokenization, chat templates,
  stop strings' text, logprobs and the answers' JSON are done here;
- the rank's other routes (``/health``, ``/ready``, ``/dwdp/status``, the KV side channel)
  by passing the request to the rank's own app on its private Unix socket, answer unchanged;
- ``/metrics``: this process's request families and the rank's engine families, one page.

The API key and the body bound are checked here first (``RequestGuard``); the rank's app checks
them again. The launch comes on standard input in two parts (``dwdp.worker.server.run.
ApiProcess``): a first line naming the tokenizer, which the process loads while the rank loads
the model, then the rest (``ApiProcessSpec``) once the engine runs; an input that ends before
the rest (the rank stopped first) ends the process with status 0. The process exits when its
parent (the rank) is gone; exit status 3 means the port could not be bound. Either way it
removes the rank's socket directory, which a killed rank could not. The process runs in a
process group of its own: a terminal's Ctrl-C reaches the rank, which stops it (SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_STOPPED_EARLY: list[int] = []
"""The SIGTERMs that came while this process was still importing its server (launched with
``-m``, before ``main`` could take the signal with its directory known): ``main`` honours them
as soon as it can, so a rank stopped during its load leaves no socket directory behind."""
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, _frame: _STOPPED_EARLY.append(signum))

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # noqa: E402

from dwdp.worker.apikey import ApiKey  # noqa: E402
from dwdp.worker.engine.kv_connector import KV_AGENT_PATH, KvEndpoint  # noqa: E402
from dwdp.worker.server.core_client import EngineCoreClient  # noqa: E402
from dwdp.worker.server.guard import RequestGuard  # noqa: E402
from dwdp.worker.server.listen import listening_socket, uvicorn_kwargs  # noqa: E402
from dwdp.worker.server.metrics import RequestCounter, ServerMetrics  # noqa: E402
from dwdp.worker.server.serving import OpenAIServing  # noqa: E402
from dwdp.worker.status_source import NoDwdp  # noqa: E402

log = logging.getLogger(__name__)

EXIT_CANNOT_LISTEN = 3
"""The API process's exit status when its port cannot be bound."""
FAILURE_FILE = "api-process-failure"
"""Where, beside the rank's socket, the API process leaves the one-line cause of a failed start
(``failure_of`` reads it for the rank's termination message)."""
LOADED_FILE = "api-process-loaded"
"""Where, beside the rank's socket, the API process says it has imported its modules and loaded
the tokenizer: its memory is then all there, so the rank sizes its KV pool after it
(``ApiProcess.wait_loaded``)."""
PROXY_TIMEOUT_S = 60.0
"""How long a passed-on request may take in the rank (the side channel's describe waits for
the agent's lock)."""
CUT_AT_BOUND = ("the server is shutting down: the request was still running at its graceful "
                "shutdown bound (gracefulShutdownTimeoutSeconds)")
"""What a request still running at the graceful bound is answered (a 503; a stream's error
event)."""
END_BEFORE_BOUND_S = 1.0
"""How long before the graceful bound the requests still running are ended (so that a stream
sends its error event and ``[DONE]`` before uvicorn cancels it)."""
PARENT_POLL_S = 1.0
"""How often the process checks that the rank is still its parent."""
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
_RANK_ROUTES: list[tuple[str, list[str]]] = [
    ("/health", ["GET"]),
    ("/ready", ["GET"]),
    ("/dwdp/status", ["GET"]),
    (KV_AGENT_PATH, ["GET", "DELETE"]),
]
"""The rank's routes this process passes on, by path."""


@dataclass(frozen=True)
class ApiProcessSpec:
    """What the rank tells its API process at launch (JSON on standard input).

    ``core_address``: the engine core's ``ipc://`` address; ``control_socket``: the path of
    the rank app's Unix socket; ``kv_endpoint``:
    ``KvEndpoint``'s fields on a disaggregated server; ``server``: the rank's identity for the
    ``dwdp`` field; ``parent_pid``: the rank's pid; ``api_key_file`` or ``api_key``: the key the
    rank resolved (``key_fields``; the spec travels through a pipe, never the command line).
    """

    host: str
    port: int
    core_address: str
    control_socket: str
    model_name: str
    max_model_len: int
    parent_pid: int
    served_name: str | None = None
    kv_endpoint: dict[str, Any] | None = None
    server: dict[str, Any] | None = None
    graceful_shutdown_timeout_s: int | None = None
    api_key_file: str | None = None
    api_key: str | None = None

    def key(self) -> ApiKey:
        """The API key to check (re-read from its file when it is one)."""
        if self.api_key_file is not None:
            return ApiKey(path=self.api_key_file)
        return ApiKey(self.api_key)

    def to_json(self) -> str:
        """The spec as the JSON the process reads."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ApiProcessSpec:
        """The spec of ``to_json``'s text."""
        return cls(**json.loads(text))


def key_fields(key: ApiKey | str | None) -> dict[str, str | None]:
    """``ApiProcessSpec``'s key fields for the key a rank resolved: its file, when it has one
    (the API process re-reads it as the rank does), else its value."""
    if isinstance(key, ApiKey):
        if key.path is not None:
            return {"api_key_file": str(key.path), "api_key": None}
        return {"api_key_file": None, "api_key": key.current()}
    return {"api_key_file": None, "api_key": key}


def build_api_app(
    client: EngineCoreClient,
    *,
    control_socket: str,
    served_name: str | None = None,
    api_key: ApiKey | str | None = None,
    server: dict[str, Any] | None = None,
) -> FastAPI:
    """The API process's app (module docstring): ``client`` connects in the app's lifespan."""
    import httpx

    from dwdp.worker.server.app import _add_error_handlers, _add_openai_routes

    rank = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=control_socket),
        base_url="http://rank",
        timeout=PROXY_TIMEOUT_S,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.connect()
        try:
            yield
        finally:
            await client.close()
            await rank.aclose()

    app = FastAPI(title="dwdp worker", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(client, NoDwdp(), engine_families=False)
    app.state.serving = OpenAIServing(client, NoDwdp(), metrics, served_name=served_name,
                                      server=server)
    app.state.metrics = metrics
    app.state.releases = set()
    app.state.rank = rank
    app.add_middleware(RequestGuard, api_key=api_key)
    _add_error_handlers(app)
    app.add_middleware(RequestCounter, metrics=metrics)
    _add_openai_routes(app)
    for path, methods in _RANK_ROUTES:
        app.add_api_route(path, _pass_on, methods=methods, include_in_schema=False)
    app.add_api_route("/metrics", _metrics, methods=["GET"], response_class=PlainTextResponse)
    return app


async def _pass_on(request: Request) -> Response:
    """The rank app's answer to this request (503 in OpenAI's error shape when the rank does
    not answer)."""
    import httpx

    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    try:
        answer = await request.app.state.rank.request(
            request.method, request.url.path, params=request.url.query or None,
            headers=headers, content=await request.body(),
        )
    except httpx.HTTPError as exc:
        body = {"error": {"message": f"the rank's engine process does not answer: {exc}",
                          "type": "service_unavailable", "code": 503}}
        return JSONResponse(body, status_code=503)
    kept = {k: v for k, v in answer.headers.items()
            if k.lower() not in _HOP_HEADERS | {"content-encoding", "date", "server"}}
    return Response(answer.content, status_code=answer.status_code, headers=kept)


async def _metrics(request: Request) -> Response:
    """This process's families, then the rank's (``ServerMetrics``: none is in both)."""
    own = generate_latest(request.app.state.metrics.registry)
    try:
        answer = await request.app.state.rank.get("/metrics")
        rank = answer.content if answer.status_code == 200 else b""
    except Exception:  # the rank's families are missing from this page, not the page
        log.warning("the rank's /metrics did not answer", exc_info=True)
        rank = b""
    return Response(own + rank, media_type=CONTENT_TYPE_LATEST)


async def _end_before_bound(server: Any, client: EngineCoreClient, bound_s: int) -> None:
    """Once ``server`` is stopping, end the requests still running ``END_BEFORE_BOUND_S``
    before its graceful bound (at half the bound, for bounds under 2 s) with ``CUT_AT_BOUND``:
    each stream then ends with an error event and ``[DONE]``, each plain request with a 503,
    instead of the cut body and the bare 500 of uvicorn's cancellation."""
    while not server.should_exit:
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(bound_s - END_BEFORE_BOUND_S, bound_s / 2))
    client.fail(CUT_AT_BOUND)


async def _watch_parent(parent_pid: int, rank_dir: Path, client: EngineCoreClient) -> None:
    """Once the rank that started this process is gone: end every open request with
    ``EngineDeadError`` (a stream gets its error event and ``[DONE]``, a plain request a 503),
    remove the rank's socket directory, which a killed rank could not, and stop (as SIGTERM
    does)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the rank (pid %d) is gone: the API server stops", parent_pid)
    client.fail(f"the rank's engine process (pid {parent_pid}) is gone")
    shutil.rmtree(rank_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)


def run(spec: ApiProcessSpec, tokenizer: Any) -> int:
    """Serve with ``tokenizer`` until SIGTERM/SIGINT or the rank's end; returns the exit
    status."""
    import uvicorn

    client = EngineCoreClient(
        spec.core_address,
        tokenizer=tokenizer,
        model_name=spec.model_name,
        max_model_len=spec.max_model_len,
        kv_endpoint=KvEndpoint(**spec.kv_endpoint) if spec.kv_endpoint else None,
    )
    app = build_api_app(client, control_socket=spec.control_socket,
                        served_name=spec.served_name, api_key=spec.key(), server=spec.server)
    config = uvicorn.Config(app, **uvicorn_kwargs(
        host=spec.host, port=spec.port,
        graceful_shutdown_timeout_s=spec.graceful_shutdown_timeout_s))
    server = uvicorn.Server(config)
    sock = listening_socket(spec.host, spec.port)  # ListenError: the failure file names it

    async def serve() -> None:
        tasks = [asyncio.ensure_future(
            _watch_parent(spec.parent_pid, Path(spec.control_socket).parent, client))]
        if spec.graceful_shutdown_timeout_s is not None:
            tasks.append(asyncio.ensure_future(
                _end_before_bound(server, client, spec.graceful_shutdown_timeout_s)))
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in tasks:
                task.cancel()

    asyncio.run(serve())
    return 0 if server.started else EXIT_CANNOT_LISTEN


def failure_of(control_socket: str) -> str | None:
    """The one-line cause an API process left when it failed (``None``: none left)."""
    path = Path(control_socket).parent / FAILURE_FILE
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def main() -> int:
    """``python -m dwdp.worker.server.api_process`` (the launch on standard input: module
    docstring). A failure is logged in one line and left for the rank (``failure_of``), never
    as a traceback."""
    from dwdp.worker.loading.tokenizer import load_tokenizer
    from dwdp.worker.termination import one_line

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per passed-on request
    first = json.loads(sys.stdin.readline())
    rank_dir = Path(first["control_socket"]).parent

    def stopped_before_serving(_signum: int, _frame: Any) -> None:
        # the rank stops this process while it may itself be killed next: the directory goes
        shutil.rmtree(rank_dir, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stopped_before_serving)  # uvicorn's handlers replace it
    if _STOPPED_EARLY:  # stopped while the imports ran
        stopped_before_serving(signal.SIGTERM, None)
    try:
        tokenizer = load_tokenizer(Path(first["tokenizer"]))
        import uvicorn  # noqa: F401  (imported while the rank loads, not after)

        (rank_dir / LOADED_FILE).touch()

        rest = sys.stdin.read()
        if not rest.strip():  # the rank stopped, or was killed, before it served
            shutil.rmtree(rank_dir, ignore_errors=True)
            return 0
        return run(ApiProcessSpec.from_json(rest), tokenizer)
    except Exception as exc:
        line = one_line(exc)
        log.error("the API server process failed: %s", line)
        (rank_dir / FAILURE_FILE).write_text(line, encoding="utf-8")
        return 1


if __name__ == "__main__":
    sys.exit(main())
