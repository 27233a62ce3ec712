"""Pytest fixtures over a real local cluster, importable by any test folder.

``tests/cluster/conftest.py`` re-exports them; another folder does the same with
``from dwdp_dev.devcluster.testing import cluster, namespace  # noqa: F401``.

- ``cluster`` (session): starts a private cluster in a temporary state folder, on its own
  free ports and its own pod network, so it never clashes with a running demo cluster; stops
  it (every process, pods included) and removes the folder at the end. Set
  ``DWDP_TEST_STATE_DIR`` to use (and keep running) a cluster in that folder instead. Its
  node offers :data:`SESSION_GPUS` fake ``nvidia.com/gpu``. Its node is a real one
  (containerd, kubelet, kube-proxy; see realnode.py), which imports the operator's image and
  the test rank program's (``tools/images/rank-standin``, built first) before the first test,
  and the store's other current images (the worker's) beside the first tests.
  ``DWDP_TEST_NODE=process`` gives it process kubelets instead, to compare the two nodes'
  times. Three tests that run images fail there: the Helm install's, the operator image's
  and the worker image's group test.
- ``process_cluster`` (session): a second cluster, of process kubelets (pods run as host
  processes, from the host's virtual environment), started when a test asks for it.
- ``namespace`` (function): a fresh namespace whose default ServiceAccount exists; deleted
  after the test.
- ``operator_image`` (session): the operator image in the local OCI store
  (dwdp_dev.devcluster.images: built without a daemon the first time, minutes; reused while its
  inputs are unchanged); the session cluster's node imports it (the chart's default image).
- ``worker_image`` (session): the worker image (``images/worker/Dockerfile`` with the
  ``worker,cuda`` extras on the same base: about 6 GB of torch and CUDA wheels, a cold build
  takes minutes; cached the same way).

The ``cluster`` object is a ``TestCluster``: ``kubeconfig``, ``env``, ``kubectl()``,
``helm()``, ``api_client()``, ``apply()``, ``get()``, ``exists()``, ``wait_for()``
and ``pod_log()``. :func:`demo_namespace` readies a namespace of it for the demo's
deployment (the end-to-end tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

from dwdp_dev.devcluster import build, images, tools
from dwdp_dev.devcluster.cluster import Cluster, routed_pod_nets
from dwdp_dev.devcluster.paths import REPO_ROOT

T = TypeVar("T")


class TestCluster:
    """Handle on a running local cluster for tests.

    ``kubeconfig`` is the admin kubeconfig; ``env`` has KUBECONFIG and a PATH that starts
    with kubectl and helm; ``cluster`` is the underlying ``Cluster``.
    """

    __test__ = False  # not a test class for pytest

    def __init__(self, cluster: Cluster, tools_bin: Path) -> None:
        self.cluster = cluster
        self.state_dir = cluster.state_dir
        self.kubeconfig: Path = cluster.kubeconfig
        self.tools_bin = tools_bin
        self.env: dict[str, str] = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{tools_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self._api_client = None
        self._importing: threading.Thread | None = None
        self.closing = False  # set before the cluster stops: a background import's end is moot

    def _run(
        self, tool: str, args: tuple[str, ...], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(self.tools_bin / tool), *map(str, args)],
            input=input,
            text=True,
            capture_output=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(map(str, args))} exited {proc.returncode}:\n"
                f"{proc.stderr}{proc.stdout}"
            )
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run kubectl against the cluster; text output. Raises AssertionError if ``check``
        and it exits non-zero, subprocess.TimeoutExpired after ``timeout`` seconds."""
        return self._run("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess:
        """Run helm against the cluster; same contract as ``kubectl``."""
        return self._run("helm", args, input, check, timeout)

    def api_client(self):
        """Return a ``kubernetes.client.ApiClient`` with admin rights (one per cluster)."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    @staticmethod
    def wait_for(
        fn: Callable[[], T], timeout: float = 30, interval: float = 0.2, message: str = "condition"
    ) -> T:
        """Call ``fn`` until it returns a truthy value and return it; raise AssertionError
        after ``timeout`` seconds (the last exception ``fn`` raised is chained)."""
        deadline = time.monotonic() + timeout
        last_exc: Exception | None = None
        while True:
            try:
                value = fn()
                if value:
                    return value
            except Exception as exc:  # retried until the deadline
                last_exc = exc
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {message}"
                ) from last_exc
            time.sleep(interval)

    def apply(self, namespace: str, *objs: dict) -> None:
        """``kubectl apply`` the given manifests (dicts) in ``namespace``."""
        import json

        body = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
        self.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict:
        """Return one object as a dict; raises AssertionError if kubectl fails."""
        import json

        ns = ["-n", namespace] if namespace else []
        return json.loads(self.kubectl("get", kind, name, *ns, "-o", "json").stdout)

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        """Return True while the object exists."""
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("get", kind, name, *ns, check=False).returncode == 0

    @property
    def real_node(self) -> bool:
        """True if the cluster's node is a real one (containerd), not process kubelets."""
        cfg = self.cluster.config()
        return cfg is not None and cfg.node_kind == "real"

    def container_pid(self, pod: dict) -> int:
        """The host pid of the main process of the pod's (only) container: the process
        kubelet reports it in the containerID (``process://<pid>``), a real node's
        containerd runs it as its task (``containerd://<id>``)."""
        (ctr,) = pod["status"]["containerStatuses"]
        scheme, _, ident = ctr["containerID"].partition("://")
        if scheme == "process":
            return int(ident)
        assert scheme == "containerd", ctr["containerID"]
        from dwdp_dev.devcluster import realnode

        return realnode.RealNode(self.cluster).task_pid(ident)

    def container_processes(self, pod: dict) -> list[int]:
        """The host pids of the processes of the pod's (only) container: its main process
        (:meth:`container_pid`) and every descendant, on either node."""
        main = self.container_pid(pod)
        return [main, *descendants(main)]

    def import_images(self, names: list[str] | None = None) -> list[str]:
        """Make images built after ``up`` (or left out of its ``node_images``) runnable: a real
        node imports the current images of the store it lacks, all of them or those ``names``
        (minutes for the worker image), after the import :meth:`import_in_background` started,
        if any, has ended; process kubelets run no images. Returns the references imported
        (none where the node's image store holds them already)."""
        if self._importing is not None:
            self._importing.join()
            self._importing = None
        return self._import(names)

    def import_in_background(self) -> None:
        """Start, in a thread of its own, importing every current image of the store the real
        node lacks (the worker image's about two minutes), so the tests that need none run
        meanwhile; :meth:`import_images` waits for it. A failure there is printed, and the next
        :meth:`import_images` tries again (and raises)."""

        def work() -> None:
            try:
                self._import(None)
            except Exception as exc:  # the foreground import retries and reports it
                if not self.closing:
                    print(f"dwdp dev: background image import failed: {exc}", file=sys.stderr)

        if self.real_node:
            self._importing = threading.Thread(target=work, name="node-image-import", daemon=True)
            self._importing.start()

    def _import(self, names: list[str] | None) -> list[str]:
        cfg = self.cluster.config()
        if not (self.real_node and cfg is not None):
            return []
        from dataclasses import replace

        from dwdp_dev.devcluster import realnode

        return realnode.RealNode(self.cluster).import_images(replace(cfg, node_images=names))

    def secret_volume(self, pod: dict, volume: str) -> Path:
        """The host folder the kubelet mounts as the pod's Secret volume ``volume``."""
        meta = pod["metadata"]
        if self.real_node:
            volumes = self.state_dir / "kubelet" / "pods" / meta["uid"] / "volumes"
            return volumes / "kubernetes.io~secret" / volume
        folder = f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        return self.state_dir / "pods" / folder / "volumes" / volume

    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """Return the current log of a pod's container (the first container if None), read
        from the process kubelet's files, or through the API on a real node; '' if there is
        none."""
        if self.real_node:
            if container is None:
                spec = self.get("pod", pod, namespace).get("spec") or {}
                container = (spec.get("containers") or [{}])[0].get("name")
            got = self.kubectl("logs", "-n", namespace, pod, "-c", str(container), check=False)
            return got.stdout if got.returncode == 0 else ""
        dirs = sorted(
            self.state_dir.glob(f"pods/{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime
        )
        if not dirs:
            return ""
        logs = dirs[-1] / "logs"
        if container is None:
            currents = sorted(logs.glob("*.current"))
            if not currents:
                return ""
            container = currents[0].stem
        try:
            name = (logs / f"{container}.current").read_text().strip()
            return (logs / name).read_text(errors="replace")
        except OSError:
            return ""


def descendants(pid: int) -> list[int]:
    """The pids of every living descendant of process ``pid`` (children first)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = sorted(children.get(todo.pop(0), ()))
        out += kids
        todo += kids
    return out


SESSION_GPUS = 16
"""``nvidia.com/gpu`` of the session cluster's node: the demo deployment of
tests/cluster/test_e2e_demo.py asks 9 (2 groups of 4 ranks and a generation server) while
pods of earlier tests may still be terminating; the cpu backend uses none."""


def start_test_cluster(
    state_dir: Path | None = None, node_kind: str = "real"
) -> tuple[TestCluster, bool]:
    """Start a cluster for tests whose node is ``node_kind`` (or, for a real node, reuse the
    one in ``DWDP_TEST_STATE_DIR``); return it and whether the caller owns it (and must stop
    it). Raises build.BuildError/ClusterError if it cannot start."""
    keep = os.environ.get("DWDP_TEST_STATE_DIR") if node_kind == "real" else None
    binary = build.build()
    tools_bin = tools.ensure_tools()
    overrides: dict[str, Any] = {"node": {"gpus": SESSION_GPUS}, "node_kind": node_kind}
    if node_kind == "real":  # imported by `up`: the operator tests' worker pods run it
        images.build_image("rank-standin", progress=print)
        overrides["node_images"] = list(UP_IMAGES)
    folder = Path(keep) if keep else state_dir
    c = Cluster(folder or Path(tempfile.mkdtemp(prefix="dwdp-test-cluster-")))
    up_on_free_pod_net(c, binary, **overrides)
    tc = TestCluster(c, tools_bin)
    tc.import_in_background()  # the worker image, while the first tests run
    return tc, not keep


UP_IMAGES = ("operator", "rank-standin")
"""The images a test cluster's real node imports before its ``up`` returns (the operator
tests need them at once); the others (the worker's about two minutes) are imported beside
the first tests (:meth:`TestCluster.import_in_background`)."""


def up_on_free_pod_net(c: Cluster, binary: Path, **overrides: Any) -> None:
    """Bring ``c`` up (``Cluster.up`` with ``overrides``); a cluster not configured yet gets a
    pod network ``100.N.0.0/16`` that no other cluster on this host routes, so tests and the
    demo can run side by side. What started is stopped if the start fails (the error is
    re-raised), also when a signal stops the start (KeyboardInterrupt)."""
    if c.config() is None:
        routed = routed_pod_nets()
        free = [n for n in range(65, 128) if f"100.{n}" not in routed]
        overrides["pod_net"] = f"100.{random.choice(free or [127])}"
    try:
        c.up(binary=binary, **overrides)
    except BaseException:
        c.down(timeout_s=5)
        raise


def run_in_image(image: images.StoredImage, *command: str) -> subprocess.CompletedProcess:
    """Run ``command`` in ``image``'s root filesystem (unpacked once per digest) as the image's
    user with only the image's environment (``chroot``; needs root), as a runtime would start
    it; text output, at most 60 s. The caller checks the exit status."""
    config = images.image_config(image)
    env = [str(e) for e in config["Env"]]
    return subprocess.run(
        [
            *("chroot", f"--userspec={config['User']}", str(images.unpack(image))),
            *("/usr/bin/env", "-i", *env, *command),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


DEMO_MODULE = "dwdp_demo_driver"
"""Module name under which :func:`demo_driver` loads ``scripts/demo.py``."""


def demo_driver() -> ModuleType:
    """``scripts/demo.py`` of this checkout as a module (its steps: start a cluster, install
    the operator, make the demo model, wait for Ready, ask), loaded once per process; the
    end-to-end cluster tests drive the demo's own steps with it.

    Raises:
        FileNotFoundError: outside a source checkout (no scripts/demo.py).
    """
    if DEMO_MODULE in sys.modules:
        return sys.modules[DEMO_MODULE]
    if REPO_ROOT is None:
        raise FileNotFoundError("scripts/demo.py: not a source checkout")
    spec = importlib.util.spec_from_file_location(DEMO_MODULE, REPO_ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[DEMO_MODULE] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def demo_namespace(tc: TestCluster, ns: str, models: Path) -> Iterator[Path]:
    """Namespace ``ns`` of the session cluster made ready for the demo's DwdpDeployment, as the demo
    does it: on a real node the operator and worker images built and imported (the worker's under
    the example's name, ``dwdp-worker:dev``), the operator installed by its Helm chart
    (:func:`demo_driver`'s ``install_operator``, in namespace ``<ns>-operator``, watching ``ns``)
    and the demo model put in ``models`` (the deployment's ``hostPath``, made readable by the ranks'
    user). Yields the model's directory. On exit every DwdpDeployment of ``ns`` is deleted (the
    operator removes its children), the operator uninstalled (its release's cluster-wide RBAC is
    named by the release, which later Helm tests install again) and both namespaces deleted."""
    demo = demo_driver()
    operator_ns = f"{ns}-operator"
    tc.kubectl("create", "namespace", ns)
    try:
        if tc.real_node:
            for name in ("operator", "worker"):
                _stored_image(name)
            tc.import_images()
        demo.install_operator(tc, operator_ns, watch=ns)
        models.chmod(0o755)  # a temporary folder is its owner's only; the ranks run as uid 1000
        yield demo.make_model(models)
    finally:
        print(tc.kubectl("get", "dwdp,pods", "-n", ns, "-o", "wide", check=False).stdout)
        tc.kubectl(
            "delete",
            "dwdp",
            "--all",
            "-n",
            ns,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        tc.helm(
            "uninstall",
            demo.RELEASE,
            "-n",
            operator_ns,
            "--wait",
            "--timeout",
            "60s",
            check=False,
            timeout=90,
        )
        tc.kubectl(
            "delete",
            "namespace",
            ns,
            operator_ns,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )


def _session_cluster(node_kind: str) -> Iterator[TestCluster]:
    try:
        tc, owned = start_test_cluster(node_kind=node_kind)
    except Exception as exc:
        pytest.fail(f"local cluster did not start: {exc}", pytrace=False)
    try:
        yield tc
    finally:
        if owned:
            tc.closing = True
            tc.cluster.down(timeout_s=10)
            shutil.rmtree(tc.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[TestCluster]:
    """A running local cluster for the whole session (see the module docstring); its node is
    a real one, or process kubelets with ``DWDP_TEST_NODE=process`` (to compare the two)."""
    kind = os.environ.get("DWDP_TEST_NODE", "real")
    if kind not in ("real", "process"):
        pytest.fail(f"DWDP_TEST_NODE={kind!r}: real or process", pytrace=False)
    yield from _session_cluster(kind)


@pytest.fixture(scope="session")
def process_cluster() -> Iterator[TestCluster]:
    """A cluster of process kubelets for the whole session, beside ``cluster``: for the
    process kubelet's own tests and for pods that run a program of the host (the vLLM interop
    tests run vLLM from ``.venv-vllm``, which no image holds)."""
    yield from _session_cluster("process")


@pytest.fixture
def namespace(cluster: TestCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (name derived from the test) with its default ServiceAccount."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base or 't'}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    cluster.wait_for(
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        timeout=30,
        message=f"default ServiceAccount in {name}",
    )
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _stored_image(name: str) -> images.StoredImage:
    """Image ``name`` built (or found up to date) in the local OCI store; a failed build
    fails the test that asked for it."""
    try:
        return images.build_image(name, progress=lambda m: print(m, file=sys.stderr))
    except images.ImageError as exc:
        pytest.fail(f"the {name} image did not build: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def operator_image() -> images.StoredImage:
    """The operator image of this checkout in the local OCI store (see the module docstring)."""
    return _stored_image("operator")


@pytest.fixture(scope="session")
def worker_image() -> images.StoredImage:
    """The worker image of this checkout in the local OCI store (see the module docstring)."""
    return _stored_image("worker")
