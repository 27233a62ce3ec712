"""The worker's sub-commands of ``dwdp``: ``worker`` and ``launch``.

Top-level imports stay light (no torch): each command imports its implementation when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``worker`` and ``launch`` to the ``dwdp`` command line."""
    worker = subparsers.add_parser(
        "worker", help="run one DWDP worker rank: load, set up DWDP, serve HTTP"
    )
    _common(worker)
    worker.add_argument(
        "--port",
        type=int,
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
    launch.add_argument("--port", type=int, default=None, help="base HTTP port")
    launch.set_defaults(func=_launch)


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
