"""Operator steady state: API writes per minute of a Ready DwdpDeployment, and time to pods.

Runs on the local control plane (a private test cluster, or ``--kubeconfig``). The operator
runs in this process (same code as ``dwdp operator``: kopf registry, reconcile loops, the
test rank program as worker) so its write counter (every POST/PATCH/DELETE it sends, by verb
and kind) can be read directly. Measured:

1. time from ``apply`` of a DwdpDeployment (G groups x P pods) until all its pods exist,
   against a baseline in the same run: the same number of bare pods created directly
   through the API (ratio = operator / direct);
2. time from apply until ``status.phase`` is Ready;
3. over a window (default 60 s) at rest: the operator's writes (target 0) and, cross-checked
   from a watch, changes of the DwdpDeployment object and new Events about it.

Prints a table last and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "charts" / "dwdp-operator" / "crds" / "dwdp.io_dwdpdeployments.yaml"


def kubectl(env: dict, *args: str, input: str | None = None) -> str:
    proc = subprocess.run(
        ["kubectl", *args], env=env, input=input, text=True, capture_output=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr}")
    return proc.stdout


def start_operator(namespace: str, kubeconfig: str):
    """Run the operator in a thread; return (kube, stop)."""
    import kopf
    from kubernetes.config import kube_config

    from dwdp.operator.handlers import OperatorConfig, build_registry, build_settings
    from dwdp.operator.kube import Kube
    from dwdp.operator.plan import PlanOptions
    from dwdp.operator.reconcile import Reconcilers
    from dwdp_dev.operator.process import RANKPROG_COMMAND

    os.environ["KUBECONFIG"] = kubeconfig
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig  # read at import; kopf's login uses it
    kube = Kube.from_environment(kubeconfig)
    config = OperatorConfig()
    reconcilers = Reconcilers(kube, PlanOptions(command=tuple(RANKPROG_COMMAND.split())))
    registry = build_registry(reconcilers, config)
    settings = kopf.OperatorSettings()
    build_settings(settings, config)
    flag = threading.Event()

    def run() -> None:
        asyncio.run(
            kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=False,
                namespaces=[namespace],
                stop_flag=flag,
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop() -> None:
        flag.set()
        thread.join(15)

    return kube, stop


def wait_pods(env: dict, ns: str, selector: str, n: int, timeout: float = 120) -> None:
    """Poll until ``n`` pods match ``selector``; raises RuntimeError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while count_pods(env, ns, selector) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} pods {selector} after {timeout} s")
        time.sleep(0.05)


def count_pods(env: dict, ns: str, selector: str) -> int:
    out = kubectl(env, "get", "pods", "-n", ns, "-l", selector, "-o", "name")
    return len(out.split())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/operator_writes.json")
    ap.add_argument("--kubeconfig", default=None, help="use this cluster (default: a new one)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--pods-per-group", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=60.0)
    args = ap.parse_args()

    owned = None
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
        tools_env = dict(os.environ)
    else:
        from dwdp_dev.devcluster.testing import start_test_cluster

        owned, _ = start_test_cluster()
        kubeconfig = str(owned.kubeconfig)
        tools_env = owned.env
    env = {**tools_env, "KUBECONFIG": kubeconfig}
    ns = f"bench-writes-{int(time.time())}"
    result: dict = {"groups": args.groups, "pods_per_group": args.pods_per_group}
    stop = None
    try:
        kubectl(env, "apply", "--server-side", "-f", str(CRD))
        kubectl(env, "wait", "--for=condition=Established", "crd/dwdpdeployments.dwdp.io")
        kubectl(env, "create", "namespace", ns)
        deadline = time.monotonic() + 60
        while subprocess.run(
            ["kubectl", "get", "serviceaccount", "default", "-n", ns], env=env, capture_output=True
        ).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no default ServiceAccount in {ns}")
            time.sleep(0.2)
        n_pods = args.groups * args.pods_per_group

        # Baseline: the same number of bare pods, created directly.
        bare = {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"bare-{i}", "labels": {"bench": "bare"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "c",
                                "image": "none",
                                "command": ["python", "-c", "import time; time.sleep(600)"],
                            }
                        ],
                    },
                }
                for i in range(n_pods)
            ],
        }
        t0 = time.monotonic()
        kubectl(env, "apply", "-n", ns, "-f", "-", input=json.dumps(bare))
        wait_pods(env, ns, "bench=bare", n_pods)
        result["direct_pods_created_s"] = time.monotonic() - t0
        kubectl(env, "delete", "pods", "-n", ns, "-l", "bench=bare", "--wait=true")

        kube, stop = start_operator(ns, kubeconfig)
        time.sleep(2.0)  # kopf lists and starts its watches
        doc = {
            "apiVersion": "dwdp.io/v1alpha1",
            "kind": "DwdpDeployment",
            "metadata": {"name": "bench"},
            "spec": {
                "model": {"path": "/models/tiny-moe"},
                "image": "dwdp-worker:dev",
                "context": {
                    "replicas": args.groups,
                    "ranksPerPod": 1,
                    "dwdp": {"dwdpSize": args.pods_per_group},
                },
                "rendezvous": {"timeoutSeconds": 60},
            },
        }
        t0 = time.monotonic()
        kubectl(env, "apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        wait_pods(env, ns, "dwdp.io/deployment=bench", n_pods)
        result["operator_pods_created_s"] = time.monotonic() - t0
        while True:
            status = (
                json.loads(kubectl(env, "get", "dwdp", "bench", "-n", ns, "-o", "json")).get(
                    "status"
                )
                or {}
            )
            if status.get("phase") == "Ready":
                break
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"not Ready after 300 s: {status}")
            time.sleep(0.2)
        result["apply_to_ready_s"] = time.monotonic() - t0
        time.sleep(3.0)  # let the last status write and events land

        before = dict(kube.writes)
        rv0 = json.loads(kubectl(env, "get", "dwdp", "bench", "-n", ns, "-o", "json"))["metadata"][
            "resourceVersion"
        ]
        ev0 = len(kubectl(env, "get", "events", "-n", ns, "-o", "name").split())
        time.sleep(args.window_s)
        after = dict(kube.writes)
        rv1 = json.loads(kubectl(env, "get", "dwdp", "bench", "-n", ns, "-o", "json"))["metadata"][
            "resourceVersion"
        ]
        ev1 = len(kubectl(env, "get", "events", "-n", ns, "-o", "name").split())
        delta = {
            f"{verb} {kind}": after.get((verb, kind), 0) - before.get((verb, kind), 0)
            for verb, kind in after
            if after.get((verb, kind), 0) != before.get((verb, kind), 0)
        }
        per_min = 60.0 / args.window_s
        result["steady_writes_per_min"] = sum(delta.values()) * per_min
        result["steady_writes_by_kind"] = delta
        result["deployment_object_changed"] = rv0 != rv1
        result["new_events_per_min"] = (ev1 - ev0) * per_min
        result["writes_to_ready"] = sum(before.values())
        result["pods_ratio_operator_vs_direct"] = (
            result["operator_pods_created_s"] / result["direct_pods_created_s"]
        )
    finally:
        if stop is not None:
            stop()
        subprocess.run(
            ["kubectl", "delete", "namespace", ns, "--wait=false"], env=env, capture_output=True
        )
        if owned is not None:
            import shutil

            owned.cluster.down(timeout_s=10)
            shutil.rmtree(owned.state_dir, ignore_errors=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    rows = [
        ("direct API: N bare pods exist", f"{result['direct_pods_created_s']:.2f} s"),
        ("operator: apply -> all pods exist", f"{result['operator_pods_created_s']:.2f} s"),
        ("ratio operator / direct", f"{result['pods_ratio_operator_vs_direct']:.2f}x"),
        ("apply -> Ready", f"{result['apply_to_ready_s']:.2f} s"),
        ("operator writes until Ready", str(result["writes_to_ready"])),
        ("steady-state writes / min (target 0)", f"{result['steady_writes_per_min']:.1f}"),
        ("DwdpDeployment changed at rest", str(result["deployment_object_changed"])),
        ("new Events / min at rest", f"{result['new_events_per_min']:.1f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(
        f"operator_writes: {args.groups} groups x {args.pods_per_group} pods, "
        f"window {args.window_s:.0f} s"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if result["steady_writes_per_min"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
