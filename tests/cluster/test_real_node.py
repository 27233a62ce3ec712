"""The real node (issue 36): a cluster started with ``node_kind="real"`` runs pods from the
project's images with containerd + runc under the real kubelet, in a network namespace of its
own, serves Services through kube-proxy with the Service CIDR routed to the node (a local
device), and ``down`` undoes every host change.

The module has a cluster of its own beside the session's (real nodes of several clusters run
side by side); its last test stops it and checks what is left on the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dwdp_dev.devcluster import build, clusterdns, images, nodestore, realnode, tools
from dwdp_dev.devcluster.cluster import Cluster, kubernetes_service_ip
from dwdp_dev.devcluster.testing import TestCluster, up_on_free_pod_net

# The pod's program: an HTTP server on port 8080 that answers its name and uid, and logs
# its uid at start and each request (stderr) for `kubectl logs`.
SERVER = textwrap.dedent(
    """
    import http.server, os
    print("serving as uid", os.getuid(), flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"{os.environ['HOSTNAME']} uid={os.getuid()}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("", 8080), H).serve_forever()
    """
)


def _host_state() -> dict[str, str]:
    """What a real node changes on the host: routes, links, network namespaces, iptables
    rules, sysctls, cgroups."""
    out = {
        "routes": subprocess.run(["ip", "route"], capture_output=True, text=True).stdout,
        "links": subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout,
        # the nodes' own namespaces (pods' namespaces, cni-*, come and go with the session's)
        "netns": " ".join(
            sorted(p.name for p in Path("/run/netns").glob("dwdp-node-*"))
            if Path("/run/netns").is_dir()
            else []
        ),
        "cgroups": " ".join(
            sorted(str(p) for h in realnode.cgroup_hierarchies() for p in h.glob("dwdp-node-*"))
        ),
        "iptables": "".join(
            subprocess.run([ipt, "-S"], capture_output=True, text=True).stdout
            for ipt in ("iptables", "ip6tables")
        ),
        "nat": subprocess.run(
            ["iptables", "-t", "nat", "-S"], capture_output=True, text=True
        ).stdout,
    }
    for key in ("net.ipv4.ip_forward", "net.ipv4.conf.all.route_localnet"):
        out[key] = (Path("/proc/sys") / key.replace(".", "/")).read_text().strip()
    return out


@pytest.fixture(scope="module")
def real_cluster(operator_image: images.StoredImage) -> Iterator[TestCluster]:
    """A cluster of its own with a real node that imported the operator image; stopped and
    removed at the end of the module (the last test stops it first)."""
    state = Path(tempfile.mkdtemp(prefix="dwdp-real-node-"))
    c = Cluster(state)
    before = _host_state()
    try:
        up_on_free_pod_net(c, build.build(), node_kind="real", node_images=["operator"])
    except Exception as exc:
        shutil.rmtree(state, ignore_errors=True)
        pytest.fail(f"the real-node cluster did not start: {exc}", pytrace=False)
    tc = TestCluster(c, tools.ensure_tools())
    tc.host_before = before  # type: ignore[attr-defined]
    try:
        yield tc
    finally:
        c.down(timeout_s=10)
        shutil.rmtree(state, ignore_errors=True)


def _pod(name: str, image: str, command: list[str], **spec: object) -> dict:
    """A pod of one container running ``command`` from ``image`` as uid 1000, hardened as the
    operator's pods are (seccomp, no capabilities, read-only root, limits); ``spec`` adds
    pod spec fields."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "securityContext": {
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": name,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "resources": {"limits": {"memory": "128Mi", "cpu": "500m"}},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            **spec,
        },
    }


SLEEP = ["python3", "-c", "import time; time.sleep(3600)"]


def _namespace(cluster: TestCluster, ns: str) -> None:
    """Create namespace ``ns`` and wait for its default ServiceAccount (pods need it)."""
    cluster.kubectl("create", "namespace", ns)
    cluster.wait_for(lambda: cluster.exists("serviceaccount", "default", ns), timeout=30)


def _node(cluster: TestCluster) -> dict:
    cfg = cluster.cluster.config()
    assert cfg is not None
    return cluster.get("node", cfg.node_name)


def test_node_is_real_and_ready(real_cluster: TestCluster) -> None:
    """One Ready node run by containerd, with the fake GPUs patched in; its Service range is
    routed to a local device, the veth into the node's namespace (no packet for a ClusterIP
    takes the default route off the machine); its cgroup root has the node's CPU weight;
    `dwdp dev status` reports the node's components."""
    node = _node(real_cluster)
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == build.kubernetes_version()
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    net = realnode.RealNode(real_cluster.cluster).net
    first = real_cluster.get("service", "kubernetes", "default")["spec"]["clusterIP"]
    assert first == kubernetes_service_ip(real_cluster.cluster.config())
    route = subprocess.run(["ip", "route", "get", first], capture_output=True, text=True).stdout
    assert f" dev {net.host_veth} " in route, route
    local = subprocess.run(["ip", "-o", "link", "show", net.host_veth], capture_output=True,
                           text=True).stdout
    assert "link/ether" in local and "link-netns" in local, local  # its peer: the node's
    # its pods together weigh as several host processes, not as one (cgroup v1 cpu.shares)
    shares = [h / net.cgroup.lstrip("/") / "cpu.shares" for h in realnode.cgroup_hierarchies()]
    assert [int(p.read_text()) for p in shares if p.exists()] == [realnode.NODE_CPU_SHARES]
    proc = subprocess.run(
        [sys.executable, "-m", "dwdp", "dev", "status", "--state-dir", str(real_cluster.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = json.loads(proc.stdout)
    assert st["node_kind"] == "real"
    assert all(st["components"].values()), st["components"]


def test_pod_runs_as_its_user_behind_a_service(
    real_cluster: TestCluster, operator_image: images.StoredImage
) -> None:
    """A pod of the operator image with runAsUser 1000 runs as uid 1000 (seccomp, no
    capabilities, read-only root, memory limit applied by runc); the host reaches it through
    its Service's ClusterIP (routed to the node), and so does another pod from inside the pod
    network; `kubectl exec`, `kubectl logs` and `kubectl port-forward` work."""
    ns = "real-node"
    _namespace(real_cluster, ns)
    pod = _pod("web", operator_image.reference, ["python3", "-u", "-c", SERVER])
    pod["spec"]["containers"][0].update(
        ports=[{"containerPort": 8080}],
        readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    real_cluster.apply(ns, pod, service)
    real_cluster.kubectl(
        "wait", "-n", ns, "--for=condition=Ready", "pod/web", "--timeout=90s", timeout=100
    )

    status = real_cluster.get("pod", "web", ns)["status"]["containerStatuses"][0]
    assert status["imageID"] == operator_image.image_id  # the store's manifest

    ip = real_cluster.get("service", "web", ns)["spec"]["clusterIP"]
    route = subprocess.run(["ip", "route", "get", ip], capture_output=True, text=True).stdout
    assert f" dev {realnode.RealNode(real_cluster.cluster).net.host_veth} " in route, route

    def answer() -> str:
        with urllib.request.urlopen(f"http://{ip}/", timeout=3) as resp:
            return resp.read().decode()

    assert real_cluster.wait_for(answer, timeout=30, message=f"{ip} answers") == "web uid=1000"

    out = real_cluster.kubectl("exec", "-n", ns, "web", "--", "id", "-u").stdout
    assert out.strip() == "1000"
    status = real_cluster.kubectl("exec", "-n", ns, "web", "--", "cat", "/proc/1/status").stdout
    assert re.search(r"^Uid:\s+1000\s+1000\s+1000\s+1000$", status, re.M), status
    assert re.search(r"^Seccomp:\s+2$", status, re.M), status  # filter mode
    assert re.search(r"^CapEff:\s+0+$", status, re.M), status
    ro = real_cluster.kubectl("exec", "-n", ns, "web", "--", "touch", "/x", check=False)
    assert ro.returncode != 0 and "Read-only file system" in ro.stderr + ro.stdout
    limit = real_cluster.kubectl(
        "exec",
        "-n",
        ns,
        "web",
        "--",
        "sh",
        "-c",
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
        " || cat /sys/fs/cgroup/memory.max",
    ).stdout
    assert limit.strip() == str(128 * 2**20)

    logs = real_cluster.kubectl("logs", "-n", ns, "web").stdout
    assert "serving as uid 1000" in logs
    assert '"GET / HTTP/1.1" 200' in logs

    # another pod reaches the Service's ClusterIP through kube-proxy's rules in the pod network
    real_cluster.apply(ns, _pod("client", operator_image.reference, SLEEP))
    real_cluster.kubectl(
        "wait", "-n", ns, "--for=condition=Ready", "pod/client", "--timeout=90s", timeout=100
    )
    fetch = (
        f"import urllib.request as u; print(u.urlopen('http://{ip}/', timeout=5).read().decode())"
    )
    inside = real_cluster.kubectl("exec", "-n", ns, "client", "--", "python3", "-c", fetch)
    assert inside.stdout.strip() == "web uid=1000", inside.stdout + inside.stderr

    # kubectl port-forward: a local port of the host to the pod's 8080
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forward = subprocess.Popen(
        ["kubectl", "port-forward", "-n", ns, "pod/web", f"{port}:8080"],
        env=real_cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def forwarded() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=3) as resp:
                return resp.read().decode()

        got = real_cluster.wait_for(forwarded, timeout=30, message="port-forward answers")
        assert got == "web uid=1000"
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def test_cluster_dns_answers_pods(
    real_cluster: TestCluster, operator_image: images.StoredImage
) -> None:
    """Pods resolve through the cluster DNS the kubelet names in their resolv.conf: a
    Service by its short name, a pod of a headless Service that publishes not-ready addresses
    by ``<hostname>.<subdomain>.<namespace>.svc`` before it is ready (how a DWDP group's
    ranks find their rendezvous store), and the pod's address back to that name; a name
    outside the cluster is refused, not sent off the machine."""
    ns = "dns"
    _namespace(real_cluster, ns)
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "ranks"},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "rank-0"},
            "ports": [{"port": 29500}],
        },
    }
    rank = _pod("rank-0", operator_image.reference, SLEEP, hostname="r0", subdomain="ranks")
    # never ready: the name must resolve all the same
    rank["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 29500},
        "periodSeconds": 1,
    }
    real_cluster.apply(ns, headless, rank, _pod("client", operator_image.reference, SLEEP))
    real_cluster.kubectl(
        "wait", "-n", ns, "--for=condition=Ready", "pod/client", "--timeout=90s", timeout=100
    )
    rank_ip = real_cluster.wait_for(
        lambda: real_cluster.get("pod", "rank-0", ns)["status"].get("podIP"), timeout=60
    )
    cfg = real_cluster.cluster.config()
    assert cfg is not None
    resolv = real_cluster.kubectl("exec", "-n", ns, "client", "--", "cat", "/etc/resolv.conf")
    node_ip = realnode.RealNode(real_cluster.cluster).net.node_ip
    assert f"nameserver {node_ip}" in resolv.stdout, resolv.stdout
    assert f"search {ns}.svc.cluster.local svc.cluster.local cluster.local" in resolv.stdout

    lookup = textwrap.dedent(
        """
        import socket, sys
        for name in sys.argv[1:]:
            try:
                print(name, socket.gethostbyname(name))
            except OSError as exc:
                print(name, "error", type(exc).__name__)
        """
    )

    def resolve(*names: str) -> dict[str, str]:
        out = real_cluster.kubectl(
            "exec", "-n", ns, "client", "--", "python3", "-c", lookup, *names
        ).stdout
        return dict(line.split(" ", 1) for line in out.strip().splitlines())

    rank_name = f"r0.ranks.{ns}.svc"
    got = real_cluster.wait_for(
        lambda: (r := resolve(rank_name))[rank_name] == rank_ip and r,
        timeout=30,
        message=f"{rank_name} resolves to {rank_ip}",
    )
    assert got
    assert real_cluster.get("pod", "rank-0", ns)["status"]["containerStatuses"][0]["ready"] is False
    names = resolve(
        "kubernetes.default", f"kubernetes.default.svc.{clusterdns.DOMAIN}", "example.com"
    )
    assert names["kubernetes.default"] == names[f"kubernetes.default.svc.{clusterdns.DOMAIN}"]
    assert (
        names["kubernetes.default"]
        == real_cluster.get("service", "kubernetes", "default")["spec"]["clusterIP"]
    )
    assert names["example.com"].startswith("error"), names
    reverse = real_cluster.kubectl(
        "exec",
        "-n",
        ns,
        "client",
        "--",
        "python3",
        "-c",
        f"import socket; print(socket.gethostbyaddr({rank_ip!r})[0])",
    ).stdout.strip()
    assert reverse == f"r0.ranks.{ns}.svc.{clusterdns.DOMAIN}"


def test_an_import_drops_the_repositorys_earlier_builds(
    real_cluster: TestCluster, operator_image: images.StoredImage, tmp_path: Path
) -> None:
    """A store of the cache keeps one build of each image: importing an image removes the
    names of its repository that hold another digest, and the image ID name
    (``sha256:...``, which the CRI plugin gives every image) that would alone keep that build;
    its blobs are collected at once. The image's own names and the pause image stay."""
    node = realnode.RealNode(real_cluster.cluster)
    repo = operator_image.repository
    earlier = f"{repo}:earlier"
    program = tmp_path / "program"  # a layer of its own: blobs no other image holds
    program.write_bytes(b"an earlier build")
    node.ctr("images", "import", "-", input=realnode.pause_archive(program, earlier))
    rows = [line.split() for line in node.ctr("images", "ls").splitlines()[1:]]
    digest = next(row[2] for row in rows if row[0] == earlier)
    # what a store holds of an earlier build once its tag moved on: its digest and ID names
    names = (f"{repo}@{digest}", "sha256:" + hashlib.sha256(b"its config").hexdigest())
    for name in names:
        node.ctr("images", "tag", "--force", earlier, name)
    node.ctr("images", "rm", earlier, operator_image.reference)  # the reference: imported again
    cfg = real_cluster.cluster.config()
    assert cfg is not None
    done = node.import_images(dataclasses.replace(cfg, node_images=["operator"]))
    assert done == [operator_image.reference]
    left = node.ctr("images", "ls", "-q").split()
    assert not set(names) & set(left), left
    assert {operator_image.reference, operator_image.image_id, realnode.PAUSE_IMAGE} <= set(left)
    assert digest.partition(":")[2] not in node.ctr("content", "ls", "-q")


def test_an_image_missing_from_the_store_is_named_not_skipped_silently(
    real_cluster: TestCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """An image the node should import that the local store no longer holds (another
    checkout's build replaced it: one image per name) gets one line naming it and the command
    that builds it; the node's containerd is left as it was."""
    node = realnode.RealNode(real_cluster.cluster)
    cfg = real_cluster.cluster.config()
    assert cfg is not None
    before = node.ctr("images", "ls", "-q")
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path))  # a local store without images
    capsys.readouterr()
    assert node.import_images(dataclasses.replace(cfg, node_images=["operator"])) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no image 'operator' in the local store" in err
    assert "`dwdp dev images --only operator` builds it" in err
    assert node.ctr("images", "ls", "-q") == before


def test_down_undoes_the_host_changes(real_cluster: TestCluster) -> None:
    """`down` stops every process (pods, kubelet, kube-proxy, containerd and its shims) and
    leaves routes, links, network namespaces, iptables rules, sysctls and cgroups as they were
    before `up` (another cluster's real node, the session's, runs on); no mount under the
    state folder is left."""
    c = real_cluster.cluster
    run_dir = realnode.RealNode(c).net.run_dir
    c.down(timeout_s=10)
    assert c.running() == {}
    after = _host_state()
    before = real_cluster.host_before  # type: ignore[attr-defined]
    assert after == before
    mounts = Path("/proc/mounts").read_text()
    assert str(c.state_dir) not in mounts and str(run_dir) not in mounts
    assert not run_dir.exists()
    shims = subprocess.run(
        ["pgrep", "-f", f"containerd-shim.*{run_dir}"], capture_output=True, text=True
    ).stdout
    assert shims == ""


def test_the_next_node_runs_the_images_its_store_kept(
    real_cluster: TestCluster, operator_image: images.StoredImage, capfd: pytest.CaptureFixture
) -> None:
    """After a clean `down` (the module's cluster, stopped by the test before), the store of
    the cache its containerd ran on serves the next cluster's node: the operator image is not
    imported again and runs at once, and nothing of the earlier cluster's pods is left in
    it (no container, no CRI sandbox folder)."""
    old = real_cluster.state_dir / "containerd"
    assert old.is_symlink(), "the module's node ran on a store of the cache"
    store = old.resolve()
    assert (store / nodestore.CLEAN).exists()
    state = Path(tempfile.mkdtemp(prefix="dwdp-real-node-again-"))
    c = Cluster(state)
    capfd.readouterr()
    try:
        up_on_free_pod_net(c, build.build(), node_kind="real", node_images=["operator"])
        err = capfd.readouterr().err
        node = realnode.RealNode(c)
        assert node.containerd_root.resolve() == store  # the first free store, as before
        assert f"importing {operator_image.reference}" not in err, err
        assert node.ctr("containers", "ls", "-q").strip() == ""
        assert not any((store / "io.containerd.grpc.v1.cri").glob("sandboxes/*"))
        tc = TestCluster(c, tools.ensure_tools())
        _namespace(tc, "again")
        tc.apply("again", _pod("web", operator_image.reference, SLEEP))
        tc.kubectl(
            "wait", "-n", "again", "--for=condition=Ready", "pod/web", "--timeout=60s", timeout=70
        )
    finally:
        c.down(timeout_s=10)
        shutil.rmtree(state, ignore_errors=True)
