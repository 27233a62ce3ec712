"""The real node's files (issue 36), written without starting anything: the settings this
host needs (cgroup v1, no systemd, no swap, no CAP_SYS_RESOURCE), the pause image archive
containerd imports, and the apiserver flags that let pods reach it through its Service."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import time
from pathlib import Path

import yaml

from dwdp_dev.devcluster import clusterdns, pki, realnode
from dwdp_dev.devcluster.cluster import Cluster
from dwdp_dev.devcluster.config import ClusterConfig


def _real_cfg() -> ClusterConfig:
    return ClusterConfig(
        apiserver_port=20001,
        kubelet_port=20002,
        node_healthz_port=20003,
        proxy_healthz_port=20004,
        proxy_metrics_port=20005,
        dns_ready_port=20006,
        pod_net="100.77",
        node_kind="real",
        node_dev="eth9",
    )


def test_configs_carry_the_settings_this_host_needs(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    pki.ensure_pki(c.pki, apiserver_ips=c._apiserver_ips(_real_cfg()))
    cfg = _real_cfg()
    cfg.save(c.config_path)
    realnode.RealNode(c)._write_configs(cfg)

    kubelet = yaml.safe_load((tmp_path / "kubelet.yaml").read_text())
    assert kubelet["failCgroupV1"] is False
    assert kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["failSwapOn"] is False
    assert kubelet["oomScoreAdj"] == 0
    assert kubelet["imageGCHighThresholdPercent"] == 100
    assert kubelet["syncFrequency"] == realnode.SYNC_FREQUENCY  # a rotated Secret in seconds
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert kubelet["containerRuntimeEndpoint"] == f"unix://{realnode.RUN_ROOT}/77/containerd.sock"
    assert kubelet["cgroupRoot"] == "/dwdp-node-77"  # one root per real node of the host
    # pods resolve through the cluster DNS on the node IP (the node's end of its veth)
    assert kubelet["clusterDNS"] == ["100.77.255.254"]
    assert kubelet["clusterDomain"] == clusterdns.DOMAIN

    corefile = (tmp_path / "Corefile").read_text()
    assert corefile.startswith("cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {")
    assert "bind 100.77.255.254\n" in corefile and "ready 100.77.255.254:20006\n" in corefile
    assert f"kubeconfig {tmp_path / 'coredns.kubeconfig'} dwdp-dev" in corefile
    dns_user = yaml.safe_load((tmp_path / "coredns.kubeconfig").read_text())["users"][0]
    assert dns_user["name"] == "coredns"
    # the node's programs, in its namespace, reach the apiserver at the host's end of the veth
    for user in ("node", "proxy", "coredns"):
        doc = yaml.safe_load((tmp_path / f"{user}.kubeconfig").read_text())
        assert doc["clusters"][0]["cluster"]["server"] == "https://100.77.255.253:20001"

    containerd = (tmp_path / "containerd.toml").read_text()
    assert "restrict_oom_score_adj = true" in containerd
    assert "SystemdCgroup = false" in containerd
    assert 'snapshotter = "overlayfs"' in containerd
    assert f'sandbox_image = "{realnode.PAUSE_IMAGE}"' in containerd

    proxy = yaml.safe_load((tmp_path / "kube-proxy.yaml").read_text())
    assert proxy["mode"] == "iptables" and proxy["oomScoreAdj"] == 0
    assert proxy["conntrack"]["maxPerCore"] == 0

    cni = json.loads((tmp_path / "cni" / "net.d" / "10-dwdp.conflist").read_text())
    bridge = cni["plugins"][0]
    assert bridge["bridge"] == realnode.BRIDGE and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"] == [[{"subnet": "100.77.0.0/17"}]]

    # the kubelet's serving certificate names the node IP
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((c.pki / "node-serving.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "100.77.255.254" in {str(i) for i in san.get_values_for_type(x509.IPAddress)}


def test_apiserver_flags_of_a_real_node(tmp_path: Path) -> None:
    """Pods reach the apiserver through the ``kubernetes`` Service of the node's own Service
    range, whose endpoint is the host's end of the node's veth; its certificate names both."""
    c = Cluster(tmp_path)
    cmd = c._component_cmd("apiserver", _real_cfg(), Path("/bin/devcluster"))
    assert "--bind-address=0.0.0.0" in cmd
    assert "--advertise-address=100.77.255.253" in cmd
    assert "--service-cluster-ip-range=100.77.128.0/24" in cmd
    assert "--endpoint-reconciler-type=lease" in cmd
    pki.ensure_pki(c.pki, apiserver_ips=c._apiserver_ips(_real_cfg()))
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((c.pki / "apiserver.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "100.77.128.1", "100.77.255.253"} <= ips
    process = c._component_cmd(
        "apiserver", ClusterConfig(node_kind="process"), Path("/bin/devcluster")
    )
    assert "--bind-address=127.0.0.1" in process
    assert "--advertise-address=127.0.0.1" in process
    assert "--endpoint-reconciler-type=none" in process


def test_guards_drop_forwarding_and_the_apiserver_on_the_default_device(tmp_path: Path) -> None:
    """Nothing is forwarded into or out of the node's veth (its pods reach this host only),
    and the apiserver's port is dropped on the default route's device; the rules name their
    node, so one node's ``down`` removes its own."""
    c = Cluster(tmp_path)
    _real_cfg().save(c.config_path)
    rules = realnode.RealNode(c)._guard_rules(_real_cfg())
    flat = [" ".join([ipt, *r]) for ipt, r in rules]
    assert any(r.startswith("iptables FORWARD -i dwdp77h") and r.endswith("DROP") for r in flat)
    assert any(r.startswith("iptables FORWARD -o dwdp77h") and r.endswith("DROP") for r in flat)
    assert any("INPUT -i eth9 -p tcp --dport 20001" in r for r in flat)
    assert all(f"{realnode.GUARD}-77" in r for r in flat)


def test_pause_archive_is_an_oci_layout_naming_the_sandbox_image(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF-not-really")
    with tarfile.open(fileobj=io.BytesIO(realnode.pause_archive(binary))) as tar:
        names = tar.getnames()
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    assert "oci-layout" in names
    (entry,) = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == realnode.PAUSE_IMAGE
    assert f"blobs/sha256/{entry['digest'][7:]}" in names


def test_local_names_are_tagged_as_the_kubelet_asks_for_them() -> None:
    """A real node tags the test rank program's image with the name the operator tests' pods
    give (``dwdp-rank-standin:dev``) as the CRI normalizes it: Docker Hub's library path for a
    bare name; a name with a registry host stays as it is."""
    from dwdp_dev.devcluster import images
    from dwdp_dev.operator.cluster import STANDIN_IMAGE, deployment

    assert deployment("d", replicas=1, ranks_per_pod=1, dwdp_size=2)["spec"]["image"] == (
        STANDIN_IMAGE
    )
    assert images.LOCAL_NAMES["rank-standin"] == (STANDIN_IMAGE,)
    assert realnode._qualified(STANDIN_IMAGE) == "docker.io/library/dwdp-rank-standin:dev"
    assert realnode._qualified("team/x:1") == "docker.io/team/x:1"
    assert realnode._qualified("localhost/x:1") == "localhost/x:1"
    assert realnode._qualified("reg.example:5000/a/b:2") == "reg.example:5000/a/b:2"


def test_a_second_up_leaves_the_watched_configs_untouched(tmp_path: Path) -> None:
    """kube-proxy stops when its config file is written (even with the same bytes), so a
    second ``up`` of a running node writes no config whose content is unchanged (the cluster
    test of an idempotent ``up`` found kube-proxy restarted); a changed one is rewritten."""
    c = Cluster(tmp_path)
    pki.ensure_pki(c.pki, apiserver_ips=c._apiserver_ips(_real_cfg()))
    _real_cfg().save(c.config_path)
    node = realnode.RealNode(c)
    node._write_configs(_real_cfg())
    files = ["kube-proxy.yaml", "kubelet.yaml", "containerd.toml"]
    before = {f: (tmp_path / f).stat().st_mtime_ns for f in files}
    time.sleep(0.01)
    node._write_configs(_real_cfg())
    assert {f: (tmp_path / f).stat().st_mtime_ns for f in files} == before
    other = dataclasses.replace(_real_cfg(), proxy_metrics_port=20006)
    node._write_configs(other)
    assert (tmp_path / "kube-proxy.yaml").stat().st_mtime_ns != before["kube-proxy.yaml"]
    assert "127.0.0.1:20006" in (tmp_path / "kube-proxy.yaml").read_text()


def test_the_dns_role_only_reads(tmp_path: Path) -> None:
    """The cluster DNS reads the API with list and watch, bound to its own user only."""
    role, binding = clusterdns.rbac()
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": clusterdns.USER}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_a_refused_up_leaves_no_state_folder(tmp_path: Path) -> None:
    """A real node is one node: `up` with two is refused naming ``--node process``, before
    anything is written (a newcomer found ``.lock``, ``logs/``, ``pods/`` and ``run/`` left in
    a new folder, which ``down --purge`` then would not remove)."""
    import pytest

    from dwdp_dev.devcluster.cluster import ClusterError

    state = tmp_path / "new"
    with pytest.raises(ClusterError, match="--node process"):
        Cluster(state).up(binary=Path("/bin/true"), nodes=2)
    assert not state.exists()


def test_up_refuses_an_image_the_checkout_does_not_build(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """``dwdp dev up --images NAME`` takes only images this checkout builds: an unknown name is
    one line naming it, exit status 1, and no cluster folder (it was accepted, and the node
    imported nothing)."""
    from dwdp.cli import main

    def must_not_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(Cluster, "up", must_not_start)  # a regression starts no real node here
    state = tmp_path / "c"
    assert main(["dev", "up", "--images", "operator,nosuchimage", "--state-dir", str(state)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no image 'nosuchimage'" in err
    assert not state.exists()



def test_an_import_carries_only_the_blobs_containerd_lacks(tmp_path: Path) -> None:
    """After a src/ change the node's containerd holds every layer but the product's: the
    archive it imports holds the layout's index, its marker file and the new blobs alone."""
    blobs = tmp_path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for name in ("aa", "bb", "cc"):
        (blobs / name).write_bytes(name.encode())
    members = realnode.archive_members(tmp_path, {"sha256:aa", "sha256:cc", "sha256:zz"})
    assert members == ["oci-layout", "index.json", "blobs/sha256/bb"]
    everything = realnode.archive_members(tmp_path, set())
    assert everything[2:] == ["blobs/sha256/aa", "blobs/sha256/bb", "blobs/sha256/cc"]
