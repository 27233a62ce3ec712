"""The worker's sub-commands of ``dwdp``: ``worker``, ``launch`` and ``router-gate``.

Top-level imports stay light (no torch): each command imports its implementation when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dwdp.cli_types import UserError, port_number


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``worker`` and ``launch`` to the ``dwdp`` command line."""
    worker = subparsers.add_parser(
        "worker", help="run one DWDP worker rank: load, set up DWDP, serve HTTP"
    )
    _common(worker)
    worker.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="HTTP port of local rank 0 (default: the launch config's serverPort); "
        "local rank k serves port + k",
    )
    worker.set_defaults(func=_worker)

    launch = subparsers.add_parser(
        "launch",
        help="start one worker process per local rank of a pod and watch them",
        description=(
            "Start one worker process per local rank of a pod and watch them. The group's "
            "rendezvous secret: the file DWDP_RENDEZVOUS_SECRET_FILE names (the operator "
            "mounts one); when it is unset, launch makes a private one for this run (mode "
            "0600, removed at exit), which only the ranks of this one launch share: a "
            "group over several pods without the operator must give every pod the same "
            "file (at least 32 random bytes) in DWDP_RENDEZVOUS_SECRET_FILE."
        ),
    )
    _common(launch)
    launch.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: DWDP_LOCAL_WORLD_SIZE, else 1)",
    )
    launch.add_argument("--port", type=port_number, default=None, help="base HTTP port")
    launch.set_defaults(func=_launch)

    gate = subparsers.add_parser(
        "router-gate",
        help="the router pod's authenticating front: check the API key, forward to vllm-router",
        description=(
            "Listen on --host:--port, refuse every request but the probes' (/health, "
            "/liveness, /readiness) without 'Authorization: Bearer <key>' (401, OpenAI's error "
            "shape), and forward the others to the vllm-router command after '--', which the "
            "gate starts on a free loopback port with OPENAI_API_KEY set to the key. The key: "
            "the file DWDP_API_KEY_FILE names (re-read when it changes; a changed key restarts "
            "the router with it), else DWDP_API_KEY; neither: no key is checked."
        ),
    )
    gate.add_argument("--host", required=True, help="address to listen on (the pod's)")
    gate.add_argument("--port", type=port_number, required=True, help="port to listen on")
    gate.add_argument("router", nargs=argparse.REMAINDER,
                      help="-- vllm-router ARGS (without --host/--port)")
    gate.set_defaults(func=_router_gate)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="launch config YAML (default: DWDP_CONFIG)")
    parser.add_argument(
        "--role",
        default=None,
        help="context, generation or aggregated (legacy ctx<N>/gen<N> accepted); "
        "default: the config's role, else DWDP_ROLE",
    )
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    parser.add_argument(
        "--termination-log",
        default=None,
        help="where a fatal error's one-line cause goes "
        "(default: DWDP_TERMINATION_LOG, else /dev/termination-log)",
    )


def _worker(args: argparse.Namespace) -> int:
    from dwdp.worker.main import WorkerOptions, run_worker

    code = run_worker(
        WorkerOptions(
            config=args.config,
            role=args.role,
            host=args.host,
            port=args.port,
            termination_log=args.termination_log,
        )
    )
    # run_worker has stopped the engine and released the DWDP state and the group transport.
    # Leave without the interpreter's teardown: collecting a loaded model's objects can take
    # longer than the launcher's stop grace on a busy host, which would turn a clean stop
    # into a SIGKILL and a failed pod.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(args: argparse.Namespace) -> int:
    from dwdp.worker.launcher import LaunchOptions, run_launcher

    return run_launcher(
        LaunchOptions(
            config=args.config,
            role=args.role,
            host=args.host,
            port=args.port,
            nproc=args.nproc,
            termination_log=args.termination_log,
        )
    )


def _router_gate(args: argparse.Namespace) -> int:
    from dwdp.api.contract import Env
    from dwdp.worker.apikey import ApiKey, ApiKeyError
    from dwdp.worker.gate.run import main

    router = args.router[1:] if args.router[:1] == ["--"] else args.router
    if not router:
        raise UserError("router-gate: give the router command after '--' (-- vllm-router ...)")
    try:
        key = ApiKey.from_env(os.environ, file_var=Env.API_KEY_FILE, value_var=Env.API_KEY)
    except ApiKeyError as exc:
        raise UserError(str(exc)) from None
    return main(router, host=args.host, port=args.port, api_key=key)
