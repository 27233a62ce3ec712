"""The ``dwdp dev`` sub-commands: build, images, up, down, status, kubeconfig, env.

Top-level imports stay light (argparse only); the work happens in the other modules,
imported when a sub-command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dwdp.cli_types import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dwdp dev ...`` to the ``dwdp`` command line."""
    dev = subparsers.add_parser(
        "dev",
        help="local Kubernetes cluster for tests and the demo",
        description="A real local Kubernetes control plane (etcd, apiserver, controller-manager,"
        " scheduler) and a real node (kubelet, containerd + runc, kube-proxy, cluster DNS) in a"
        " network namespace of its own; or process kubelets (--node process). State:"
        " $DWDP_STATE_DIR or ~/.cache/dwdp/clusters/default.",
    )
    sub = dev.add_subparsers(dest="dev_command", metavar="ACTION")
    dev.set_defaults(func=lambda args: (dev.print_help(), 2)[1])

    def add(name: str, help_: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument(
            "--state-dir",
            type=Path,
            default=None,
            help="cluster state folder (default $DWDP_STATE_DIR or ~/.cache/dwdp/clusters/default)",
        )
        p.set_defaults(func=func)
        return p

    b = add("build", "build the control-plane binary if its inputs changed; print its path", _build)
    b.add_argument("-v", "--verbose", action="store_true", help="show go build output")
    b.add_argument("--tools", action="store_true", help="also fetch kubectl and helm")
    im = add(
        "images",
        "build images (default: the operator's) into the local OCI store ~/.cache/dwdp/images"
        " without a daemon (debootstrap, buildah, umoci built with Go) if their inputs changed;"
        " a real node imports them at `dwdp dev up`",
        _images,
    )
    im.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="image of images/NAME/Dockerfile, or of tools/images/NAME/Dockerfile for a test"
        " image (rank-standin) (repeatable; default operator; the worker image"
        " holds CUDA wheels: about 6.7 GB unpacked, about 5 minutes to build cold on 2 cores)",
    )
    up = add("up", "start the cluster (idempotent); waits for a Ready node", _up)
    up.add_argument(
        "--node",
        choices=("process", "real"),
        help="the node: real (default: containerd, the kubelet and kube-proxy in a network"
        " namespace of their own; needs root and apt-get install containerd runc"
        " containernetworking-plugins iptables; imports the images `dwdp dev images` built)"
        " or process (process kubelets: pods run as host processes). Kept for later `up`s of"
        " the cluster",
    )
    up.add_argument(
        "--images",
        metavar="NAMES",
        help="the local store's images a real node imports, comma-separated (operator,worker;"
        " '' for none; default: every current one). Kept for later `up`s of the cluster",
    )
    up.add_argument("--nodes", type=int, help="number of process-kubelet nodes (default 1)")
    up.add_argument("--cpu", help="cpu capacity per node (default 32)")
    up.add_argument("--memory", help="memory capacity per node (default 128Gi)")
    up.add_argument("--gpus", type=int, help="nvidia.com/gpu capacity per node (default 8)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    down = add("down", "stop every process of the cluster (pods included)", _down)
    down.add_argument(
        "--purge",
        action="store_true",
        help="also delete the state folder (certificates, etcd data, logs)",
    )
    add("status", "show which components run and whether the nodes are Ready", _status)
    add("kubeconfig", "print the path of the cluster's admin kubeconfig", _kubeconfig)
    add("env", "print shell exports (KUBECONFIG, PATH with kubectl and helm)", _env)


def _user_error(exc: Exception):
    """The one-line error ``dwdp`` prints for ``exc`` (its first line, on stderr); the lines
    after it (a log excerpt, the fix) are printed to stderr first, so nothing shows twice."""
    import sys

    first, _, rest = str(exc).partition("\n")
    if rest.strip():
        print(rest.rstrip(), file=sys.stderr)
    return UserError(first or type(exc).__name__)


def _build(args: argparse.Namespace) -> int:
    from dwdp_dev.devcluster import build, tools

    try:
        path = build.build(verbose=args.verbose)
        if args.tools:
            tools.ensure_tools()
    except (build.BuildError, tools.ToolsError) as exc:
        raise _user_error(exc) from None
    print(path)
    return 0


def _images(args: argparse.Namespace) -> int:
    import sys

    from dwdp_dev.devcluster import images

    for name in args.only or ["operator"]:
        try:
            stored = images.build_image(name, progress=lambda m: print(m, file=sys.stderr))
        except images.ImageError as exc:
            raise _user_error(exc) from None
        print(f"{stored.reference} oci:{stored.layout}:{stored.tag} {stored.digest}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from dwdp_dev.devcluster import build, cluster, tools

    overrides: dict = {}
    if args.node:
        overrides["node_kind"] = args.node
    if args.images is not None:
        from dwdp_dev.devcluster import images

        names = [n.strip() for n in args.images.split(",") if n.strip()]
        try:
            for name in names:
                images.dockerfile_path(name)  # an image this checkout builds
        except images.ImageError as exc:
            raise _user_error(exc) from None
        overrides["node_images"] = names
    if args.nodes:
        overrides["nodes"] = args.nodes
    node = {
        k: v
        for k, v in (("cpu", args.cpu), ("memory", args.memory), ("gpus", args.gpus))
        if v is not None
    }
    if node:
        overrides["node"] = node
    c = cluster.Cluster(args.state_dir)
    try:
        tools.ensure_tools()
        seconds = c.up(binary=build.build(), timeout_s=args.timeout, **overrides)
    except (build.BuildError, tools.ToolsError, cluster.ClusterError) as exc:
        raise _user_error(exc) from None
    print(f"cluster up in {seconds:.1f} s; state {c.state_dir}")
    print(f"export KUBECONFIG={c.kubeconfig}")
    print(f"export PATH={tools.tools_bin_dir()}:$PATH")
    return 0


def _down(args: argparse.Namespace) -> int:
    import shutil

    from dwdp_dev.devcluster import cluster

    c = cluster.Cluster(args.state_dir)
    if not c.config_path.exists():  # a folder without a cluster: not stopped, not deleted
        print(f"no cluster in {c.state_dir} (no {c.config_path.name}): nothing stopped or deleted")
        return 0
    c.down()
    if args.purge and c.state_dir.exists():
        shutil.rmtree(c.state_dir)
    print(f"cluster down; state {'removed' if args.purge else 'kept in ' + str(c.state_dir)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from dwdp_dev.devcluster import cluster

    st = cluster.Cluster(args.state_dir).status()
    print(json.dumps(st, indent=2))
    up = st["apiserver_ready"] and st["nodes_ready"] and all(st["nodes_ready"].values())
    return 0 if up else 3


def _existing(state_dir: Path | None):
    """The cluster of ``state_dir`` (``None``: the default folder); a ``UserError`` naming
    the folder when no cluster was ever started there (no admin kubeconfig)."""
    from dwdp_dev.devcluster import cluster

    c = cluster.Cluster(state_dir)
    if not c.kubeconfig.exists():
        raise _user_error(RuntimeError(f"no cluster in {c.state_dir}; run `dwdp dev up`"))
    return c


def _kubeconfig(args: argparse.Namespace) -> int:
    print(_existing(args.state_dir).kubeconfig)
    return 0


def _env(args: argparse.Namespace) -> int:
    from dwdp_dev.devcluster import tools

    c = _existing(args.state_dir)
    print(f"export KUBECONFIG={c.kubeconfig}")
    print(f"export PATH={tools.tools_bin_dir()}:$PATH")
    return 0
