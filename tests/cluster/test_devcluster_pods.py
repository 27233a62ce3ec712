"""Acceptance tests of the local control plane with the process kubelet (issue 3; ``dwdp dev
up --node process``): real scheduler, controllers and apiserver, pods run as host processes.
They run on the session's ``process_cluster``: the session's ``cluster`` has a real node."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dwdp_dev.devcluster import build
from dwdp_dev.devcluster.testing import TestCluster


@pytest.fixture
def cluster(process_cluster: TestCluster) -> TestCluster:
    """This module's cluster (and its ``namespace`` fixture's): the process kubelets'."""
    return process_cluster

# An HTTP server on the pod's own address, port 8080: / answers the pod name, /healthz
# answers 200 unless the env HEALTHY is "0" (then 503).
HTTP_SERVER = textwrap.dedent(
    """
    import http.server, os
    ip, name = os.environ["POD_IP"], os.environ["POD_NAME"]
    healthy = os.environ.get("HEALTHY", "1") == "1"
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            ok = healthy or self.path != "/healthz"
            body = name.encode() if ok else b"unhealthy"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer((ip, 8080), H).serve_forever()
    """
)

POD_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
]

READINESS = {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1}


def python_container(code: str, name: str = "main", **extra: Any) -> dict:
    """A container running ``python -c code`` (python comes from the pod's PATH: the venv)."""
    return {
        "name": name,
        "image": "unused",
        "command": ["python", "-c", textwrap.dedent(code)],
        "env": list(POD_ENV) + extra.pop("env", []),
        **extra,
    }


def pod(name: str, containers: list[dict], labels: dict | None = None, **spec: Any) -> dict:
    """A Pod manifest (grace period 5 s unless given)."""
    spec.setdefault("terminationGracePeriodSeconds", 5)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {"containers": containers, **spec},
    }


def deployment(name: str, replicas: int, container: dict, grace: int = 5) -> dict:
    """A Deployment whose pods carry the label app=<name>."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": grace},
            },
        },
    }


def condition(obj: dict, ctype: str) -> str | None:
    """The status ("True"/"False") of a pod condition, None if absent."""
    for c in obj.get("status", {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"]
    return None


def pids_of(pod_obj: dict) -> list[int]:
    """The process ids of a pod's containers (containerID process://PID)."""
    out = []
    for cs in pod_obj.get("status", {}).get("containerStatuses") or []:
        cid = cs.get("containerID", "")
        if cid.startswith("process://"):
            out.append(int(cid.removeprefix("process://")))
    return out


def ignores_sigterm(pid: int) -> bool:
    """True once the process ignores SIGTERM (its SigIgn mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def terminated(pod_obj: dict, container: str = "main") -> dict | None:
    """The terminated state of a container, if it terminated."""
    for cs in pod_obj.get("status", {}).get("containerStatuses") or []:
        if cs["name"] == container:
            return cs.get("state", {}).get("terminated")
    return None


def pods_of(cluster: TestCluster, namespace: str, app: str) -> list[dict]:
    """The pods labelled app=<app>."""
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app={app}", "-o", "json")
    return json.loads(out.stdout)["items"]


def http_get(ip: str, port: int, path: str = "/") -> str:
    """GET http://ip:port/path; the body."""
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=5) as resp:
        return resp.read().decode()


def wait_finished(cluster: TestCluster, namespace: str, name: str, timeout: float = 60) -> dict:
    """Wait until the pod's phase is Succeeded or Failed; return it."""
    return cluster.wait_for(
        lambda: (
            (p := cluster.get("pod", name, namespace))["status"].get("phase")
            in ("Succeeded", "Failed")
            and p
        ),
        timeout=timeout,
        message=f"pod {name} to finish",
    )


# ----------------------------------------------------------------------------- tests
def test_deployment_serves_on_both_pod_addresses(cluster: TestCluster, namespace: str) -> None:
    """Two replicas bind the same port on their own addresses, become Ready through their
    readiness probe, are listed ready in the Service's EndpointSlice and answer HTTP; a pod
    whose readiness probe fails stays NotReady and is listed not ready."""
    server = python_container(
        HTTP_SERVER, readinessProbe=READINESS, ports=[{"containerPort": 8080, "name": "http"}]
    )
    unhealthy = pod(
        "web-unhealthy",
        [
            python_container(
                HTTP_SERVER, readinessProbe=READINESS, env=[{"name": "HEALTHY", "value": "0"}]
            )
        ],
        labels={"app": "web", "probe": "failing"},
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    cluster.apply(namespace, deployment("web", 2, server), service, unhealthy)

    def two_ready() -> list[dict] | None:
        pods = [
            p
            for p in pods_of(cluster, namespace, "web")
            if p["metadata"]["name"] != "web-unhealthy"
        ]
        ok = len(pods) == 2 and all(condition(p, "Ready") == "True" for p in pods)
        return pods if ok else None

    pods = cluster.wait_for(two_ready, timeout=60, message="2 Ready replicas")
    ips = sorted(p["status"]["podIP"] for p in pods)
    pod_net = cluster.cluster.config().pod_net
    assert len(set(ips)) == 2 and all(ip.startswith(pod_net + ".") for ip in ips)
    assert all(p["spec"]["nodeName"] for p in pods)  # bound by the scheduler
    for p in pods:
        assert http_get(p["status"]["podIP"], 8080) == p["metadata"]["name"]

    def slice_endpoints() -> dict[str, bool] | None:
        out = cluster.kubectl(
            "get",
            "endpointslices",
            "-n",
            namespace,
            "-l",
            "kubernetes.io/service-name=web",
            "-o",
            "json",
        )
        eps = {}
        for s in json.loads(out.stdout)["items"]:
            for ep in s.get("endpoints") or []:
                for addr in ep["addresses"]:
                    eps[addr] = bool(ep.get("conditions", {}).get("ready"))
        # the EndpointSlice controller lists a pod before it copies its readiness: wait for
        # the two serving pods to read ready (the unhealthy one never does)
        return eps if len(eps) == 3 and all(eps.get(ip) for ip in ips) else None

    eps = cluster.wait_for(
        slice_endpoints, timeout=30, message="3 endpoints in the slice, the 2 serving ready"
    )
    bad = cluster.get("pod", "web-unhealthy", namespace)
    assert {ip: eps[ip] for ip in ips} == {ip: True for ip in ips}
    assert eps[bad["status"]["podIP"]] is False
    assert bad["status"]["phase"] == "Running" and condition(bad, "Ready") == "False"

    wide = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
    for p in pods:
        line = next(ln for ln in wide.splitlines() if ln.startswith(p["metadata"]["name"]))
        assert "Running" in line and p["status"]["podIP"] in line and "1/1" in line


def test_deleting_deployment_collects_pods_and_kills_processes(
    cluster: TestCluster, namespace: str
) -> None:
    """Garbage collection removes the pods of a deleted Deployment and their processes exit
    within the grace period; a process ignoring SIGTERM is SIGKILLed after its grace period."""
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open("/tmp/ignored", "w")
        while True:
            time.sleep(0.1)
    """
    cluster.apply(
        namespace,
        deployment("gc", 2, python_container(HTTP_SERVER, readinessProbe=READINESS), grace=30),
        pod("stubborn", [python_container(stubborn)], terminationGracePeriodSeconds=3),
    )
    pods = cluster.wait_for(
        lambda: (
            (ps := pods_of(cluster, namespace, "gc"))
            and len(ps) == 2
            and all(condition(p, "Ready") == "True" for p in ps)
            and ps
        ),
        timeout=60,
        message="2 Ready pods",
    )
    pids = [pid for p in pods for pid in pids_of(p)]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    stub = cluster.wait_for(
        lambda: (
            (p := cluster.get("pod", "stubborn", namespace))["status"].get("phase") == "Running"
            and p
        ),
        timeout=60,
        message="stubborn pod Running",
    )
    (stub_pid,) = pids_of(stub)
    cluster.wait_for(lambda: ignores_sigterm(stub_pid), timeout=30, interval=0.05,
                     message="the stubborn process ignoring SIGTERM")

    start = time.monotonic()
    cluster.kubectl("delete", "deployment", "gc", "-n", namespace, "--wait=false")
    cluster.wait_for(
        lambda: not pods_of(cluster, namespace, "gc"), timeout=30, message="gc pods collected"
    )
    assert time.monotonic() - start < 30  # well within the 30 s grace: SIGTERM ended them
    assert not any(alive(pid) for pid in pids)

    start = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    time.sleep(1.5)
    assert alive(stub_pid), "SIGTERM was ignored: the process must live until the grace ends"
    cluster.wait_for(
        lambda: not cluster.exists("pod", "stubborn", namespace),
        timeout=20,
        message="stubborn pod removed",
    )
    elapsed = time.monotonic() - start
    assert not alive(stub_pid)
    assert 2.5 <= elapsed <= 15, elapsed


def test_readiness_gate_holds_ready_until_condition_true(
    cluster: TestCluster, namespace: str
) -> None:
    """ContainersReady alone does not make the pod Ready while its readiness gate is unset."""
    gate = "dwdp.io/group-ready"
    cluster.apply(
        namespace,
        pod(
            "gated",
            [python_container("import time\nwhile True: time.sleep(1)")],
            readinessGates=[{"conditionType": gate}],
        ),
    )
    cluster.wait_for(
        lambda: condition(cluster.get("pod", "gated", namespace), "ContainersReady") == "True",
        timeout=60,
        message="containers ready",
    )
    time.sleep(1.5)
    p = cluster.get("pod", "gated", namespace)
    assert condition(p, "Ready") == "False"
    patch = {"status": {"conditions": [{"type": gate, "status": "True"}]}}
    cluster.kubectl(
        "patch",
        "pod",
        "gated",
        "-n",
        namespace,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps(patch),
    )
    p = cluster.wait_for(
        lambda: (
            (q := cluster.get("pod", "gated", namespace)) and condition(q, "Ready") == "True" and q
        ),
        timeout=20,
        message="Ready after the gate",
    )
    assert condition(p, gate) == "True"  # the kubelet kept the gate condition


def test_termination_message_and_exit_code(cluster: TestCluster, namespace: str) -> None:
    """A container writing /dev/termination-log and exiting 3 is reported Failed with both."""
    code = """
        import sys
        with open("/dev/termination-log", "w") as f:
            f.write("rank 3: setup verdict abort")
        sys.exit(3)
    """
    cluster.apply(namespace, pod("dies", [python_container(code)], restartPolicy="Never"))
    p = wait_finished(cluster, namespace, "dies")
    assert p["status"]["phase"] == "Failed"
    term = terminated(p)
    assert term is not None
    assert term["exitCode"] == 3
    assert term["message"] == "rank 3: setup verdict abort"
    assert term["reason"] == "Error"


def test_restart_policy_on_failure_restarts_then_succeeds(
    cluster: TestCluster, namespace: str
) -> None:
    """restartPolicy OnFailure reruns a failed container (its emptyDir survives) until it
    succeeds; the pod ends Succeeded with one restart."""
    code = """
        import os, sys
        marker = "/scratch/first-run-done"
        if not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(1)
    """
    ctr = python_container(code, volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}])
    cluster.apply(
        namespace,
        pod(
            "flaky", [ctr], restartPolicy="OnFailure", volumes=[{"name": "scratch", "emptyDir": {}}]
        ),
    )
    p = wait_finished(cluster, namespace, "flaky")
    assert p["status"]["phase"] == "Succeeded"
    (cs,) = p["status"]["containerStatuses"]
    assert cs["restartCount"] == 1
    assert cs["state"]["terminated"]["exitCode"] == 0
    assert cs["lastState"]["terminated"]["exitCode"] == 1


def test_headless_hostname_resolves_inside_pod(cluster: TestCluster, namespace: str) -> None:
    """<hostname>.<subdomain> (and its .<ns>.svc.cluster.local form) of a sibling resolves to
    the sibling's address inside a pod's processes; the pod's own hostname is its name."""
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "grp"},
        "spec": {
            "clusterIP": "None",
            "selector": {"app": "grp"},
            "ports": [{"port": 8080}],
            "publishNotReadyAddresses": True,
        },
    }
    sleeper = python_container("import time\nwhile True: time.sleep(1)")
    sibling = pod("rank1", [sleeper], labels={"app": "grp"}, hostname="rank-1", subdomain="grp")
    cluster.apply(namespace, headless, sibling)
    sib = cluster.wait_for(
        lambda: (q := cluster.get("pod", "rank1", namespace))["status"].get("podIP") and q,
        timeout=60,
        message="sibling address",
    )
    resolver = f"""
        import json, socket, time
        names = ["rank-1.grp", "rank-1.grp.{namespace}.svc.cluster.local"]
        out = {{}}
        for _ in range(100):
            try:
                out = {{n: socket.getaddrinfo(n, 8080)[0][4][0] for n in names}}
                break
            except socket.gaierror:
                time.sleep(0.1)
        out["hostname"] = socket.gethostname()
        with open("/dev/termination-log", "w") as f:
            json.dump(out, f)
    """
    cluster.apply(
        namespace,
        pod(
            "rank0",
            [python_container(resolver)],
            labels={"app": "grp"},
            hostname="rank-0",
            subdomain="grp",
            restartPolicy="Never",
        ),
    )
    p = wait_finished(cluster, namespace, "rank0")
    result = json.loads(terminated(p)["message"])
    ip = sib["status"]["podIP"]
    assert result == {
        "rank-1.grp": ip,
        f"rank-1.grp.{namespace}.svc.cluster.local": ip,
        "hostname": "rank-0",
    }
    assert p["status"]["phase"] == "Succeeded"


def test_mounted_token_gets_exactly_its_rbac(cluster: TestCluster, namespace: str) -> None:
    """A pod's in-cluster client (token mounted at the standard path) can list pods, which its
    RoleBinding allows, and is forbidden to list secrets; the venv's python runs it."""
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    ]
    code = f"""
        import json, os, sys
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
        config.load_incluster_config()
        api = client.CoreV1Api()
        out = {{"python": sys.executable,
               "token": os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")}}
        for what, call in (("pods", api.list_namespaced_pod),
                           ("secrets", api.list_namespaced_secret)):
            try:
                call("{namespace}")
                out[what] = 200
            except ApiException as exc:
                out[what] = exc.status
        with open("/dev/termination-log", "w") as f:
            json.dump(out, f)
    """
    cluster.apply(
        namespace,
        *rbac,
        pod("client", [python_container(code)], serviceAccountName="reader", restartPolicy="Never"),
    )
    p = wait_finished(cluster, namespace, "client")
    result = json.loads(terminated(p)["message"])
    assert result["token"] is True
    assert result["pods"] == 200
    assert result["secrets"] == 403
    assert result["python"].startswith(str(cluster_venv(cluster)))


def cluster_venv(cluster: TestCluster) -> str:
    """The venv bin folder the cluster puts first on pods' PATH."""
    cfg = cluster.cluster.config()
    assert cfg is not None and cfg.venv_bin
    return cfg.venv_bin


def test_gang_podgroup_schedules_only_a_full_gang(cluster: TestCluster, namespace: str) -> None:
    """The scheduling.k8s.io PodGroup API is served and the scheduler gangs its pods: one pod
    of a minCount-2 group stays unscheduled until the second one exists."""
    group = {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": "g0"},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}},
    }
    sleeper = python_container("import time\nwhile True: time.sleep(1)")

    def member(name: str) -> dict:
        return pod(name, [sleeper], schedulingGroup={"podGroupName": "g0"})

    cluster.apply(namespace, group, member("g0-a"))
    time.sleep(3)
    assert not cluster.get("pod", "g0-a", namespace)["spec"].get("nodeName")
    cluster.apply(namespace, member("g0-b"))
    for name in ("g0-a", "g0-b"):
        cluster.wait_for(
            lambda n=name: cluster.get("pod", n, namespace)["status"].get("phase") == "Running",
            timeout=60,
            message=f"{name} Running",
        )


def test_kubectl_logs_and_env(cluster: TestCluster, namespace: str) -> None:
    """kubectl logs reaches the kubelet; env fieldRefs and the venv-first PATH are set."""
    code = """
        import os, shutil
        print("ip", os.environ["POD_IP"], "name", os.environ["POD_NAME"], flush=True)
        print("dwdp", shutil.which("dwdp"), flush=True)
    """
    cluster.apply(namespace, pod("talker", [python_container(code)], restartPolicy="Never"))
    p = wait_finished(cluster, namespace, "talker")
    out = cluster.kubectl("logs", "talker", "-n", namespace).stdout
    assert f"ip {p['status']['podIP']} name talker" in out
    assert f"dwdp {cluster_venv(cluster)}/dwdp" in out


def test_liveness_exec_probe_restarts_container(cluster: TestCluster, namespace: str) -> None:
    """An exec liveness probe that starts failing (its file vanishes) gets the container
    killed and restarted under restartPolicy Always."""
    code = """
        import os, time
        open("/scratch/alive", "w").close()
        time.sleep(2)
        os.remove("/scratch/alive")
        time.sleep(1000)
    """
    liveness = {
        "exec": {"command": ["test", "-f", "/scratch/alive"]},
        "periodSeconds": 1,
        "failureThreshold": 2,
    }
    ctr = python_container(
        code, livenessProbe=liveness, volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}]
    )
    cluster.apply(
        namespace,
        pod(
            "liveness",
            [ctr],
            terminationGracePeriodSeconds=1,
            volumes=[{"name": "scratch", "emptyDir": {}}],
        ),
    )
    p = cluster.wait_for(
        lambda: (
            (q := cluster.get("pod", "liveness", namespace))["status"]
            .get("containerStatuses", [{}])[0]
            .get("restartCount", 0)
            >= 1
            and q
        ),
        timeout=60,
        message="a restart after the liveness probe failed",
    )
    cs = p["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] != 0


def test_configmap_volume_and_subpath(cluster: TestCluster, namespace: str) -> None:
    """A ConfigMap mounted whole and as a single file (subPath) is readable in the pod, as the
    operator mounts the worker launch config."""
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "launch"},
        "data": {"config.yaml": "dwdp_size: 4\n", "other": "x"},
    }
    code = """
        import json, os
        out = {"file": open("/tmp/dwdp-devcluster-test/config.yaml").read(),
               "dir": sorted(f for f in os.listdir("/tmp/dwdp-devcluster-test-dir")
                             if not f.startswith(".."))}
        with open("/dev/termination-log", "w") as f:
            json.dump(out, f)
    """
    ctr = python_container(
        code,
        volumeMounts=[
            {
                "name": "cfg",
                "mountPath": "/tmp/dwdp-devcluster-test/config.yaml",
                "subPath": "config.yaml",
                "readOnly": True,
            },
            {"name": "cfg", "mountPath": "/tmp/dwdp-devcluster-test-dir", "readOnly": True},
        ],
    )
    cluster.apply(
        namespace,
        cm,
        pod(
            "reader",
            [ctr],
            restartPolicy="Never",
            volumes=[{"name": "cfg", "configMap": {"name": "launch"}}],
        ),
    )
    p = wait_finished(cluster, namespace, "reader")
    assert json.loads(terminated(p)["message"]) == {
        "file": "dwdp_size: 4\n",
        "dir": ["config.yaml", "other"],
    }


def test_security_context_read_only_root_no_privileges(
    cluster: TestCluster, namespace: str
) -> None:
    """A container with readOnlyRootFilesystem, allowPrivilegeEscalation: false and every
    capability dropped (the worker pods' defaults) cannot write outside its volumes, has
    no_new_privs and only the added capability; its emptyDirs (one at /tmp, above this
    cluster's state folder) and its termination log stay writable, and what it writes in
    /tmp stays in the pod."""
    code = """
        import errno, json, os
        def can_write(path):
            try:
                open(path, "w").close()
                return True
            except OSError as exc:
                return errno.errorcode[exc.errno]
        fields = dict(
            line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines()
        )
        out = {
            "root": can_write("/dwdp-locked-pod-wrote-this"),
            "scratch": can_write("/scratch/x"),
            "tmp": can_write("/tmp/dwdp-locked-pod-wrote-this"),
            "no_new_privs": fields["NoNewPrivs"].strip(),
            "cap_eff": fields["CapEff"].strip(),
            "cap_bnd": fields["CapBnd"].strip(),
        }
        with open("/dev/termination-log", "w") as f:
            json.dump(out, f)
    """
    security = {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
    }
    ctr = python_container(
        code,
        securityContext=security,
        volumeMounts=[
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    )
    cluster.apply(
        namespace,
        pod(
            "locked",
            [ctr],
            restartPolicy="Never",
            volumes=[{"name": "scratch", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
        ),
    )
    p = wait_finished(cluster, namespace, "locked")
    assert not Path("/tmp/dwdp-locked-pod-wrote-this").exists()
    assert json.loads(terminated(p)["message"]) == {
        "root": "EROFS",
        "scratch": True,
        "tmp": True,
        "no_new_privs": "1",
        "cap_eff": "0000000000000400",  # CAP_NET_BIND_SERVICE (bit 10) only
        "cap_bnd": "0000000000000400",
    }


def _start_ticks(pid: int) -> int:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_an_apiserver_outage_changes_no_container(cluster: TestCluster, namespace: str) -> None:
    """With the apiserver down for 10 s (ten of the kubelet's 1-s sync loops), the kubelet keeps
    every container as it was (same process, same start time, no restart) while its status
    patches fail, and reports the pod again once the apiserver is back (a pod made Ready during
    the outage shows Ready)."""
    code = """
        import os, time
        while not os.path.exists("/scratch/ready"):
            time.sleep(0.2)
        time.sleep(100000)
    """
    readiness = {"exec": {"command": ["test", "-f", "/scratch/ready"]}, "periodSeconds": 1}
    ctr = python_container(
        code,
        readinessProbe=readiness,
        volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
    )
    volumes = [{"name": "scratch", "emptyDir": {}}]
    cluster.apply(namespace, pod("outlast", [ctr], restartPolicy="Never", volumes=volumes))
    running = cluster.wait_for(
        lambda: (
            (p := cluster.get("pod", "outlast", namespace))["status"].get("phase") == "Running"
            and pids_of(p)
            and p
        ),
        timeout=60,
        message="pod running",
    )
    (pid,) = pids_of(running)
    started = _start_ticks(pid)
    scratch = next(cluster.state_dir.glob(f"pods/{namespace}_outlast_*")) / "volumes" / "scratch"
    apiserver = cluster.cluster.running()["apiserver"]
    os.kill(apiserver, signal.SIGKILL)  # a crash: the process is gone at once
    try:
        cluster.wait_for(lambda: not alive(apiserver), timeout=30, message="apiserver stopped")
        (scratch / "ready").touch()  # the pod turns Ready while nobody can be told
        time.sleep(10)
        assert alive(pid) and _start_ticks(pid) == started
    finally:
        cluster.cluster.up(binary=build.build())  # as start_test_cluster did
    back = cluster.wait_for(
        lambda: condition(p := cluster.get("pod", "outlast", namespace), "Ready") == "True" and p,
        timeout=90,
        message="the pod's Ready condition after the outage",
    )
    assert pids_of(back) == [pid] and alive(pid) and _start_ticks(pid) == started
    (status,) = back["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and "running" in status["state"]
    # the controllers are back too (they reconnect with a back-off): a new namespace gets its
    # ServiceAccount, as the later tests of the session's process cluster need
    probe = f"{namespace}-after"
    cluster.kubectl("create", "namespace", probe)
    cluster.wait_for(
        lambda: cluster.exists("serviceaccount", "default", probe),
        timeout=180,
        message="the default ServiceAccount of a namespace made after the outage",
    )
    cluster.kubectl("delete", "namespace", probe, "--wait=false")
