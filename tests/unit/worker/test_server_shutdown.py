"""Graceful shutdown of a rank: the bound reaches its API server process's uvicorn, a hung
handler is cancelled at it, and the engine is stopped afterwards; without a bound uvicorn's
default (wait) applies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from ports import free_port  # noqa: E402

from dwdp.worker.server.listen import uvicorn_kwargs  # noqa: E402

SERVER = textwrap.dedent(
    """
    import sys, types
    from pathlib import Path
    from dwdp.worker.server.app import build_app
    from dwdp.worker.server.run import ApiProcess, serve_with_api_process

    out = Path(sys.argv[1])
    bound = None if sys.argv[2] == "none" else int(sys.argv[2])

    class HungEngine:
        model_name = "hung"
        max_model_len = 64
        tokenizer = None
        kv = None

        async def check_health(self):
            return None

        def snapshot(self):
            return None

        async def abort(self, request_id):
            return None

        async def add_request(self, request_id, prompt, params, kv_transfer=None, *,
                              shared=None, emit):
            (out / "in-handler").write_text("1")
            return types.SimpleNamespace(aborted=False)  # a final update that never comes

    def stop_engine():
        with (out / "engine-stopped").open("a") as f:
            f.write("stop\\n")

    engine = HungEngine()
    api = {"host": "127.0.0.1", "port": int(sys.argv[3]), "model_name": "hung",
           "max_model_len": 64, "graceful_shutdown_timeout_s": bound}
    serve_with_api_process(build_app(engine, on_shutdown=stop_engine, openai=False), engine,
                           api, stop_engine=stop_engine, process=ApiProcess(sys.argv[4]))
    """
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from dwdp_dev.worker.checkpoint import make_checkpoint

    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "ck", num_experts=4)


def test_uvicorn_keywords():
    plain = uvicorn_kwargs(host="127.0.0.1", port=1, graceful_shutdown_timeout_s=None)
    assert "timeout_graceful_shutdown" not in plain
    bounded = uvicorn_kwargs(host="127.0.0.1", port=1, graceful_shutdown_timeout_s=3)
    assert bounded["timeout_graceful_shutdown"] == 3
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="graceful_shutdown_timeout_s"):
            uvicorn_kwargs(host="127.0.0.1", port=1, graceful_shutdown_timeout_s=bad)


def _start(tmp_path: Path, bound: str, tokenizer_dir: Path):
    """The rank's stand-in (a hung engine) serving through its API process, and one request
    that reached the engine."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), bound, str(port),
                             str(tokenizer_dir)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "server died at start"
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    responses = []

    def request():
        try:
            responses.append(
                httpx.post(base + "/v1/completions", json={"prompt": [1, 2]}, timeout=60)
            )
        except httpx.HTTPError as exc:
            responses.append(exc)

    client = threading.Thread(target=request, daemon=True)
    client.start()
    while not (tmp_path / "in-handler").is_file():
        assert time.monotonic() < deadline, "the request never reached the handler"
        time.sleep(0.05)
    return proc, client, responses


def test_a_request_hung_at_the_bound_is_ended_then_the_engine_stopped(tmp_path, tokenizer_dir):
    """A request still running near the bound (1 s: at half of it) is ended with a 503 in
    OpenAI's error shape naming the setting (uvicorn's cancellation answered a bare 500), then
    the engine stops."""
    proc, client, responses = _start(tmp_path, "1", tokenizer_dir)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took = time.monotonic() - start
    client.join(10)
    assert code == 0
    assert 0.4 <= took < 10, took
    (answer,) = responses
    assert isinstance(answer, httpx.Response) and answer.status_code == 503, answer
    assert "gracefulShutdownTimeoutSeconds" in answer.json()["error"]["message"]
    stops = (tmp_path / "engine-stopped").read_text().split()
    assert stops and set(stops) == {"stop"}  # the lifespan shutdown and the final stop


def test_without_a_bound_uvicorn_waits(tmp_path, tokenizer_dir):
    proc, _client, _responses = _start(tmp_path, "none", tokenizer_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # uvicorn's default: wait for every handler
        assert not (tmp_path / "engine-stopped").exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


class _IdleEngine:
    model_name = "idle"
    max_model_len = 64
    tokenizer = None
    kv = None

    async def check_health(self):
        return None

    def snapshot(self):
        return None


def test_an_api_process_that_cannot_start_names_its_cause(tmp_path):
    from dwdp.worker.server.app import build_app
    from dwdp.worker.server.run import ApiProcess, serve_with_api_process

    engine, stops = _IdleEngine(), []
    api = {"host": "127.0.0.1", "port": free_port(), "model_name": "idle", "max_model_len": 64}
    with pytest.raises(RuntimeError, match=r"the API server process exited with status 1: "
                       r"CheckpointError: checkpoint .*missing: tokenizer"):
        serve_with_api_process(build_app(engine, openai=False), engine, api,
                               stop_engine=lambda: stops.append(1),
                               process=ApiProcess(str(tmp_path / "missing")))
    assert stops == [1]


def _loading_rank(tmp_path: Path, tokenizer_dir: Path) -> tuple[subprocess.Popen, str, str]:
    """A stand-in rank that started its API process and then loads for ever:
    ``(rank, socket directory, API process pid)``."""
    rank_code = ("import sys, time\n"
                 "from dwdp.worker.server.run import ApiProcess\n"
                 "p = ApiProcess(sys.argv[1])\n"
                 "print(p.workdir, p.proc.pid, flush=True)\n"
                 "time.sleep(600)\n")
    rank = subprocess.Popen([sys.executable, "-c", rank_code, str(tokenizer_dir)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    workdir, api = rank.stdout.readline().split()  # type: ignore[union-attr]
    assert Path(workdir).is_dir()
    return rank, workdir, api


def test_an_api_process_stopped_before_serving_removes_the_socket_directory(
    tmp_path, tokenizer_dir
):
    """A rank that stops during its load sends SIGTERM to its API process and may be killed
    itself before it removes its directory (the launcher's SIGTERM follows a Ctrl-C): the API
    process removes it."""
    rank, workdir, api = _loading_rank(tmp_path, tokenizer_dir)
    try:
        time.sleep(1)  # the API process is waiting for the spec's rest
        os.kill(int(api), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(workdir).exists() or _running(int(api)):
            assert time.monotonic() < deadline, "the socket directory or the API process"
            time.sleep(0.1)
    finally:
        rank.kill()
        rank.wait()


def test_a_rank_killed_before_it_serves_leaves_no_socket_directory(tmp_path, tokenizer_dir):
    """The API process starts while the rank loads its model; a rank killed then (its input
    ends before the spec's rest) cannot remove its socket directory, so the API process does,
    and exits."""
    rank, workdir, api = _loading_rank(tmp_path, tokenizer_dir)
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 60
    while Path(workdir).exists() or _running(int(api)):
        assert time.monotonic() < deadline, "the killed rank's socket directory or API process"
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which no parent may reap here, does not)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_stop_signal_just_as_serving_begins_stops_the_rank_once_it_serves(tokenizer_dir):
    """A SIGTERM after the rank's stage turned ``serve`` but before ``serve_with_api_process``
    took the signals over is kept by ``StopBeforeServing`` (not raised: the rank is past its
    load, not ignored: the pod is being deleted), and serving stops at once through its usual
    teardown, with no second signal and no launcher SIGKILL."""
    from dwdp.worker.server.app import build_app
    from dwdp.worker.server.run import ApiProcess, StopBeforeServing, serve_with_api_process

    stop_signals = StopBeforeServing(lambda: True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # delivered to the main thread at its next bytecode: this one
        assert stop_signals.pending == signal.SIGTERM
        engine, stops, holder = _IdleEngine(), [], {}
        forced = threading.Event()

        def force_stop() -> None:  # only if the kept signal was lost: serving would go on
            forced.set()
            holder["stop"]()

        watchdog = threading.Timer(60, force_stop)
        watchdog.start()
        api = {"host": "127.0.0.1", "port": free_port(), "model_name": "idle",
               "max_model_len": 64}
        try:
            serve_with_api_process(build_app(engine, openai=False), engine, api,
                                   stop_engine=lambda: stops.append(1), server_holder=holder,
                                   process=ApiProcess(str(tokenizer_dir)),
                                   stop_pending=lambda: stop_signals.pending is not None)
        finally:
            watchdog.cancel()
        assert not forced.is_set(), "the signal that came before serving was lost"
        assert stops == [1]
    finally:
        stop_signals.quiet()
        stop_signals.restore()


def test_a_port_in_use_stops_the_rank_naming_the_address_and_the_cause(tokenizer_dir):
    """The API process binds before uvicorn does, so the rank's one-line failure says why it
    could not listen (uvicorn only logged it, and the line said 'could not start')."""
    import socket

    from dwdp.worker.server.app import build_app
    from dwdp.worker.server.run import ApiProcess, serve_with_api_process

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine, stops = _IdleEngine(), []
        api = {"host": "127.0.0.1", "port": port, "model_name": "idle", "max_model_len": 64}
        with pytest.raises(RuntimeError, match=rf"ListenError: cannot listen on 127\.0\.0\.1:"
                           rf"{port}: Address already in use"):
            serve_with_api_process(build_app(engine, openai=False), engine, api,
                                   stop_engine=lambda: stops.append(1),
                                   process=ApiProcess(str(tokenizer_dir)))
    assert stops == [1]
