"""The FastAPI app: short routers over ``OpenAIServing``, errors in the OpenAI error shape.

Every router takes the serving object from app state, awaits it and maps the result to JSON,
a streaming response or an error. Validation failures answer 400 with the field's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dwdp.worker.apikey import ApiKey
from dwdp.worker.engine.kv_connector import KV_AGENT_PATH, KvConnector, KvTransferParams, LeaseError
from dwdp.worker.engine.protocol import EngineClient
from dwdp.worker.server.fields import NOT_HONOURED
from dwdp.worker.server.guard import RequestGuard
from dwdp.worker.server.metrics import RequestCounter, ServerMetrics
from dwdp.worker.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from dwdp.worker.server.serving import OpenAIServing, ServingError, lease_refusal
from dwdp.worker.server.status import (
    engine_failure,
    kv_tokens_in_use,
    prefix_cache_status,
    speculative_status,
    with_identity,
)
from dwdp.worker.status_source import DwdpStatusSource, NoDwdp

if TYPE_CHECKING:
    from dwdp.worker.memory import RankMemory

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
    403: {"model": ErrorResponse, "description": "Another lease's kv_transfer_params token."},
    410: {"model": ErrorResponse, "description": "The KV lease is not held (any more)."},
    502: {"model": ErrorResponse, "description": "The KV transfer from the context server failed."},
    503: {"model": ErrorResponse, "description": "The engine cannot serve."},
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status)


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def _kv(request: Request) -> KvConnector:
    kv = _serving(request).engine.kv
    if not isinstance(kv, KvConnector):  # None, or an API process's part of one
        raise ServingError(404, "no KV transfer on this server", kind="not_found_error")
    return kv


def _leased(params: Any) -> KvTransferParams | None:
    """The ``kv_transfer_params`` of a request body (parsed, or the raw JSON of one that
    failed validation) when they name a remote lease, else ``None``."""
    if isinstance(params, dict):
        try:
            params = KvTransferParams.model_validate(params)
        except ValueError:
            return None
    if isinstance(params, KvTransferParams) and params.do_remote_prefill:
        return params
    return None


def _release_unread(request: Request, params: KvTransferParams | None) -> None:
    """This server refuses a request whose KV waits under a lease on a context server: end
    the lease there now (in the background; the answer does not wait for it)."""
    kv = _serving(request).engine.kv
    if params is None or kv is None:
        return
    tasks: set[asyncio.Task[None]] = request.app.state.releases
    task = asyncio.ensure_future(kv.release(params))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _answer(request: Request, body: Any, work: Any) -> Response:
    """Await ``work`` (``_unless_gone``); when it fails (an error answer, or the client
    left) and ``body`` named a remote lease that was not read, release that lease."""
    try:
        result = _respond(await _unless_gone(request, work))
    except BaseException:
        _release_unread(request, _leased(body.kv_transfer_params))
        raise
    if result.status_code >= 400:  # 499: the client left
        _release_unread(request, _leased(body.kv_transfer_params))
    return result


def _respond(result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump(exclude_none=True))


def _validation_message(errors: Sequence[Any]) -> str:
    """One line for a body that does not validate: the field and why. Of a union's branches,
    the one that got furthest, and among those one that is not a plain type mismatch (an
    empty token-id list is "too short", not "not a string")."""
    if not errors:
        return "invalid request"
    first = max(errors, key=lambda e: (len(e.get("loc", ())),
                                       not str(e.get("type", "")).endswith("_type")))
    if first.get("type") == "json_invalid":
        at = first.get("loc", ("body", "?"))[-1]
        reason = (first.get("ctx") or {}).get("error", "invalid")
        return f"body: not valid JSON ({reason} at character {at})"
    path = _field_path(first.get("loc", ()))
    if first.get("type") == NOT_HONOURED:  # a field the model does not declare: named in ctx
        path.append(str(first["ctx"]["field"]))
    return f"{'.'.join(path) or 'body'}: {first.get('msg', 'invalid')}"


def _field_path(loc: Any) -> list[str]:
    """A validation error's location without ``body`` and pydantic's union-branch tags
    (``constrained-str``, ``list[...]``, ``function-after[...]``)."""
    return [str(p) for p in loc if p != "body" and not ("[" in str(p) or "-" in str(p))]


async def _unless_gone(request: Request, work: Any) -> Any:
    """Await ``work`` (a response, or the SSE lines' iterator), cancelling it when the client
    disconnects first: its engine requests are then aborted, not computed for nobody."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and watch.exception() is None:  # the client left first
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return _error(499, "client closed the request", "client_closed")
        return await task  # done, or the watch failed: the answer decides
    finally:
        watch.cancel()


def build_app(
    engine: EngineClient,
    *,
    dwdp: DwdpStatusSource | None = None,
    served_name: str | None = None,
    on_shutdown: Any = None,
    identity: dict[str, Any] | None = None,
    memory: RankMemory | None = None,
    api_key: ApiKey | str | None = None,
    server: dict[str, Any] | None = None,
    openai: bool = True,
) -> FastAPI:
    """The app of one rank.

    ``identity`` (``group``, ``incarnation``, ``revision`` of the rank, see
    :func:`dwdp.worker.server.status.rank_identity`) is added to every ``/dwdp/status``
    answer, so the operator's commit gate can check that every rank of a group incarnation
    runs the same revision. A rank whose engine died answers phase ``failed``.
    ``memory`` (the rank's memory ledger and KV pool) adds ``memory`` and ``kv_cache`` to
    ``/dwdp/status`` and their gauges to ``/metrics``. With ``api_key`` every ``/v1/*``
    request needs ``Authorization: Bearer <api_key>`` (401 otherwise); request bodies are
    bounded either way (``dwdp.worker.server.guard``). ``server`` (``role``, ``group``,
    ``rank``, ..., see :func:`dwdp.worker.server.status.server_identity`) names this server in
    the ``dwdp`` field of every completion and chat answer and in the KV side channel's answer.

    ``openai=False`` builds the rank's own app behind an API server process
    (``dwdp.worker.server.api_process``): that process serves the OpenAI routes and counts the
    requests, so this app has neither; it keeps health, readiness, the side channel, status and
    the families ``/metrics`` reads from the engine.

    ``on_shutdown`` (a callable) runs in the lifespan shutdown, after uvicorn stopped
    accepting and its graceful-shutdown bound (if any) cancelled the remaining handlers; the
    worker passes the engine's ``stop``.
    """
    dwdp = dwdp or NoDwdp()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if on_shutdown is not None:
                log.info("server shutdown: stopping the engine")
                on_shutdown()

    app = FastAPI(title="dwdp worker", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(engine, dwdp, memory, requests=openai)
    app.state.serving = OpenAIServing(
        engine, dwdp, metrics, served_name=served_name, server=server
    )
    app.state.metrics = metrics
    app.state.releases = set()  # lease releases in flight (kept until done)
    app.add_middleware(RequestGuard, api_key=api_key)
    _add_error_handlers(app)
    if openai:
        app.add_middleware(RequestCounter, metrics=metrics)  # outermost: guard refusals count
        _add_openai_routes(app)
    _add_probe_routes(app)
    _add_kv_routes(app)
    _add_status_route(app, memory, identity)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape (``ServingError``, a body that does not
    validate: the field and why, an HTTP error)."""

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError) -> JSONResponse:
        return _error(exc.status_code, exc.message, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, dict):  # a refused request may still name a real lease
            _release_unread(request, _leased(exc.body.get("kv_transfer_params")))
        return _error(400, _validation_message(exc.errors()), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")


def _add_openai_routes(app: FastAPI) -> None:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE}},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(request, body, _serving(request).completion(body))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(request, body, _serving(request).chat(body))

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> ModelList:
        return _serving(request).models()


def _add_probe_routes(app: FastAPI) -> None:
    """``/health``, ``/ready`` and ``/metrics``."""

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health(request: Request) -> dict[str, str]:
        await _serving(request).health()
        return {"status": "ok"}

    @app.get("/ready", responses={503: _ERRORS[503]})
    async def ready(request: Request) -> dict[str, str]:
        await _serving(request).ready()
        return {"status": "ready"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(request: Request) -> Response:
        data = generate_latest(request.app.state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def _add_kv_routes(app: FastAPI) -> None:
    """The KV side channel of a disaggregated server (``KV_AGENT_PATH``): describe a lease,
    release one."""

    @app.get(KV_AGENT_PATH, responses={404: _ERRORS[404]})
    async def kv_agent(
        request: Request, claim: str | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """The NIXL side channel of a disaggregated server (behind the API key); ``claim``:
        a request id whose KV lease the caller is about to read, ``token``: that lease's
        (410 when it is not held, 403 for another token)."""
        kv = _kv(request)
        try:  # the agent's lock may wait
            described = await asyncio.to_thread(kv.describe, claim, token)
        except LeaseError as exc:
            raise lease_refusal(exc) from exc
        return {**described, "server": _serving(request).server}

    @app.delete(KV_AGENT_PATH, status_code=204, responses={404: _ERRORS[404]})
    async def kv_release(request: Request, claim: str, token: str | None = None) -> Response:
        """A generation server refused the request of lease ``claim`` (``token``: the
        lease's): the lease ends now and its blocks come back (410 / 403 as the GET)."""
        try:
            _kv(request).release_lease(claim, token)
        except LeaseError as exc:
            raise lease_refusal(exc) from exc
        return Response(status_code=204)


def _add_status_route(app: FastAPI, memory: RankMemory | None,
                      identity: dict[str, Any] | None) -> None:
    """``/dwdp/status`` (``build_app`` says what it holds)."""

    @app.get("/dwdp/status")
    async def dwdp_status(request: Request) -> dict[str, Any]:
        serving = _serving(request)
        snapshot = serving.engine.snapshot()  # one for every field of this answer
        status = serving.dwdp.status()
        if memory is not None:
            status.update(memory.status(kv_tokens_in_use(snapshot)))
        cache = prefix_cache_status(snapshot)
        if cache is not None:
            status["prefix_cache"] = cache
        speculative = speculative_status(snapshot)
        if speculative is not None:
            status["speculative"] = speculative
        kv = serving.engine.kv
        if isinstance(kv, KvConnector):  # a disaggregated server: its KV transfer counters
            status["kv_transfer"] = {
                **kv.status(),
                "remote_prefill_tokens": (
                    0 if snapshot is None else snapshot.stats.remote_prefill_tokens),
            }
        return with_identity(status, identity, engine_failure(snapshot))
