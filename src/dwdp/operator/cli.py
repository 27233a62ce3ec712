"""``dwdp operator``: run the DwdpDeployment operator (kopf) until interrupted.

Top-level imports stay light (argparse only); kopf and the kubernetes client are imported
when the command runs. Credentials: in a pod, the service account; elsewhere
``$KUBECONFIG``. Exit status 0 after SIGINT/SIGTERM, 1 on a bad option.
Webhook certificates made at start live in a temporary folder that is removed when the
command ends (SIGTERM included, also while a standby waits for the Lease).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
from types import FrameType
from typing import Any

from dwdp.cli_types import UserError

__all__ = ["register"]

ENV_WORKER_COMMAND = "DWDP_OPERATOR_WORKER_COMMAND"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``operator`` to the ``dwdp`` parser."""
    p = subparsers.add_parser(
        "operator",
        help="run the DwdpDeployment operator",
        description="Reconcile DwdpDeployments into DWDP groups of worker pods, services "
        "and launch configs, and report their state in status.",
    )
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable); default: every namespace",
    )
    p.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        metavar="URL",
        help=f"liveness endpoint to serve ('none': off; default {DEFAULT_LIVENESS})",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="run as one of several replicas: only the holder of a coordination.k8s.io Lease "
        "reconciles, the others wait to take over (needs RBAC on leases)",
    )
    p.add_argument(
        "--leader-elect-name",
        default="dwdp-operator",
        metavar="NAME",
        help="name of the Lease (default dwdp-operator)",
    )
    p.add_argument(
        "--leader-elect-namespace",
        default=None,
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    p.add_argument(
        "--worker-command",
        default=os.environ.get(ENV_WORKER_COMMAND),
        metavar="CMD",
        help="container command of the worker pods (shell words; default "
        f"'dwdp launch --host $(DWDP_POD_IP)'; env {ENV_WORKER_COMMAND})",
    )
    p.add_argument(
        "--gang",
        choices=("auto", "off"),
        default="auto",
        help="gang PodGroup per group incarnation where the apiserver serves "
        "scheduling.k8s.io/v1beta1 podgroups (auto, the default), or never (off)",
    )
    p.add_argument(
        "--compute-domains",
        choices=("auto", "off"),
        default="auto",
        help="handleType fabric groups across pods: one NVIDIA ComputeDomain per incarnation, "
        "refused where the API is not served (auto, the default); off: never (CPU test "
        "clusters, where fabric is nominal)",
    )
    p.add_argument(
        "--webhook-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve the validating webhook (HTTPS) here; default: no webhook",
    )
    p.add_argument(
        "--webhook-host",
        default=None,
        metavar="HOST",
        help="host name or address the apiserver uses for the webhook (default: the "
        "listen host); also the certificate's name",
    )
    p.add_argument(
        "--webhook-cert-dir",
        default=None,
        metavar="DIR",
        help="ca.crt, tls.crt and tls.key to serve with; default: made at start",
    )
    p.add_argument(
        "--webhook-manage",
        default=None,
        metavar="NAME",
        help="keep the ValidatingWebhookConfiguration NAME (a dotted domain such as "
        "validate.dwdp.io: kopf names the webhooks after it) up to date (needs RBAC on "
        "validatingwebhookconfigurations); default: configured elsewhere (Helm)",
    )
    p.set_defaults(func=_run)


def _webhook(args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    """The webhook's settings (None without ``--webhook-listen``); certificates made here
    are removed when ``stack`` closes."""
    if not args.webhook_listen:
        return None
    from pathlib import Path

    from dwdp.operator.certs import CertFiles, temporary_webhook_certs
    from dwdp.operator.handlers import WebhookConfig

    host, sep, port = args.webhook_listen.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--webhook-listen {args.webhook_listen!r} is not HOST:PORT")
    url_host = args.webhook_host or host
    if args.webhook_cert_dir:
        certs = CertFiles.in_dir(Path(args.webhook_cert_dir))
        for f in (certs.ca, certs.cert, certs.key):
            if not f.is_file():
                raise UserError(f"--webhook-cert-dir: {f} is missing")
    else:
        certs = stack.enter_context(temporary_webhook_certs([url_host]))
    return WebhookConfig(
        listen_host=host,
        port=int(port),
        url_host=url_host,
        certs=certs,
        managed=args.webhook_manage,
    )


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM before kopf installs its own handler (a standby waiting for the Lease):
    leave through ``SystemExit`` so that cleanups run, instead of dying in place."""
    raise SystemExit(0)


def _run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with contextlib.ExitStack() as stack:
        return _run_in(args, stack)


def _run_in(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    import asyncio

    import kopf

    from dwdp.operator import constants as c
    from dwdp.operator.handlers import OperatorConfig, build_registry, build_settings
    from dwdp.operator.kube import Kube
    from dwdp.operator.plan import PlanOptions
    from dwdp.operator.reconcile import Reconcilers

    try:
        command = (
            tuple(shlex.split(args.worker_command))
            if args.worker_command
            else c.DEFAULT_WORKER_COMMAND
        )
    except ValueError as exc:
        raise UserError(f"--worker-command: {exc}") from exc
    if not command:
        raise UserError("--worker-command is empty")
    import logging

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per event
    config = OperatorConfig(webhook=_webhook(args, stack))
    try:
        kube = Kube.from_environment()
    except Exception as exc:  # kubernetes.config.ConfigException, unreadable kubeconfig
        raise UserError(f"no cluster credentials (service account or KUBECONFIG): {exc}") from exc
    pod_namespace = os.environ.get("POD_NAMESPACE") or None  # the chart sets it
    options = PlanOptions(
        command=command,
        gang=args.gang == "auto",
        compute_domains=args.compute_domains == "auto",
        operator_namespace=pod_namespace,
    )
    reconcilers = Reconcilers(kube, options)
    registry = build_registry(reconcilers, config)
    settings = kopf.OperatorSettings()
    build_settings(settings, config)
    liveness = None if args.liveness.lower() == "none" else args.liveness

    def run_operator() -> Any:
        return kopf.operator(
            registry=registry,
            settings=settings,
            standalone=True,  # high availability is the Lease (--leader-elect), not peering
            liveness_endpoint=liveness,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
        )

    if not args.leader_elect:
        asyncio.run(run_operator())
        return 0
    from dwdp.operator.election import LeaderElector, LostLease, lead_then_run

    namespace = args.leader_elect_namespace or pod_namespace or "default"
    elector = LeaderElector(kube, namespace, args.leader_elect_name, _identity())
    try:
        asyncio.run(lead_then_run(elector, run_operator, liveness=liveness))
    except LostLease as exc:
        raise UserError(str(exc)) from exc
    return 0


def _identity() -> str:
    """This replica's candidate name: the pod's hostname and a random suffix (a restarted
    container is a new candidate)."""
    import secrets
    import socket

    return f"{socket.gethostname()}_{secrets.token_hex(4)}"
