"""The DWDP demo on the embedded local cluster: a DwdpDeployment applied, its groups
committing, answers served through vllm-router (scripts/demo.sh runs this driver with
the Python of .venv).

From a built local control plane to answers: start the embedded cluster in its own state
folder, ``helm install`` the operator, train (or take from the cache) the tiny
DeepSeek-V3-family demo model that knows a few facts (capitals, small sums, what DWDP does),
apply ``examples/04-demo.yaml`` (2 context DWDP groups of 4 ranks, expert + dense DWDP on the cpu
backend, and one generation server; the operator puts vllm-router in front of them), wait for
Ready and for the router while printing the group phases, send completion and chat requests
through the router (``status.router.endpoint``, reached at its Service's EndpointSlice address:
the local cluster has no kube-proxy), which prefills each on a context rank and decodes it on
the generation server, print for each answer which group and rank prefilled it and which
generation server decoded it (the answers' ``dwdp`` field), compare every answer with a
single-process run of the same checkpoint with replicated weights (greedy), print ``kubectl
get dwdp -o wide``, the time from apply to Ready and the requests per second served through
the router, and tear everything down (``--keep`` leaves it running).

The end-to-end cluster test (tests/cluster/test_e2e_demo.py) imports the steps from here.
Exit status: 0 when every answer equals the reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "dwdp-operator"
EXAMPLE = REPO / "examples" / "04-demo.yaml"
NAME = "demo"
NAMESPACE = "dwdp-demo"
API_KEY_SECRET = "demo-api-key"
"""The Secret ``spec.server.apiKeySecretRef`` of the example names (key ``api-key``)."""
API_KEY = secrets.token_urlsafe(24)
"""This run's API key: the Secret holds it, every request sends it as a Bearer token."""
OPERATOR_NAMESPACE = "dwdp-system"
RELEASE = "dwdp"
MODEL_DIR = "tiny-deepseek-v3"
PROMPTS = ("The capital of France is", "Once upon a time", "DWDP shares the experts")
CHAT = [{"role": "user", "content": "Say hello to the DWDP group."}]
MAX_TOKENS = 16
"""Enough for the longest answer of the demo model (it stops at its EOS token before)."""
READY_TIMEOUT_S = 900.0


def say(text: str) -> None:
    print(text, flush=True)


# ----------------------------------------------------------------------------- steps

NODE_GPUS = 16
"""nvidia.com/gpu capacity of the local node: the operator asks one per rank (2 groups x 4
ranks + 1 generation server = 9, above the default 8); the cpu backend uses none."""


def start_cluster(state: Path, *, gpus: int = NODE_GPUS, node_kind: str = "real") -> Any:
    """Start (or reuse) the local control plane in ``state`` on a pod network no other
    cluster on this host uses; returns a ``dwdp_dev.devcluster.testing.TestCluster``.

    ``node_kind="real"`` (the default): a real node (containerd), whose pods run from images:
    the operator and worker images are built first (``dwdp dev images``; a cold build of the
    worker takes minutes and about 7 GB of disk); the node imports the operator's now and the
    worker's before the deployment is applied (:func:`import_worker`). ``"process"``: process
    kubelets, pods run from ``.venv``."""
    from dwdp_dev.devcluster import build, images, tools
    from dwdp_dev.devcluster.cluster import Cluster
    from dwdp_dev.devcluster.testing import TestCluster, up_on_free_pod_net

    binary = build.build()
    tools_bin = tools.ensure_tools()
    overrides: dict[str, Any] = {"node": {"gpus": gpus}, "node_kind": node_kind}
    if node_kind == "real":
        for name in ("operator", "worker"):
            images.build_image(name, progress=lambda line: say(f"   {line}"))
        overrides["node_images"] = ["operator"]
    c = Cluster(state)
    up_on_free_pod_net(c, binary, **overrides)
    return TestCluster(c, tools_bin)


def import_worker(tc: Any) -> None:
    """On a real node, import the worker image (under the example's name too,
    ``dwdp-worker:dev``): the blobs its containerd lacks, the 3.3 GB of dependencies the
    first time (about two minutes), the thin product layer after a src/ change (seconds).
    The demo runs it beside the operator's install and the model and awaits it before the
    apply."""
    if tc.real_node:
        began = time.monotonic()
        if tc.import_images(["worker"]):
            say(f"   the node imported the worker image in {time.monotonic() - began:.1f} s")
        else:
            say("   the node's image store holds the worker image already")


def make_model(models: Path) -> Path:
    """The demo model (``dwdp testing train-demo-model``: the tiny DeepSeek-V3-family model
    trained on a corpus of facts) in ``models``: trained once into the shared cache
    (``$DWDP_CACHE_DIR/models``, keyed by a digest of the training inputs), then copied here."""
    from dwdp_dev.devcluster.paths import cache_dir
    from dwdp_dev.worker.demo_model import cached_demo_model

    trained = cached_demo_model(cache_dir() / "models")
    out = models / MODEL_DIR
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(trained, out)
    return out


def manifest(models: Path, *, name: str = NAME) -> dict[str, Any]:
    """``examples/04-demo.yaml`` with its hostPath pointing at ``models``."""
    import yaml

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["hostPath"] = str(models.resolve())
    return doc


def api_key_secret() -> dict[str, Any]:
    """The Secret holding this run's API key (apply it with the DwdpDeployment)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": API_KEY_SECRET},
        "type": "Opaque",
        "stringData": {"api-key": API_KEY},
    }


def install_operator(tc: Any, namespace: str = OPERATOR_NAMESPACE, *, watch: str | None = None):
    """``helm install`` the chart (CRD included) and wait for the operator pod."""
    args = ["upgrade", "--install", RELEASE, str(CHART), "-n", namespace, "--create-namespace"]
    if watch:
        args += ["--set", f"watchNamespaces[0]={watch}"]
    tc.helm(*args, "--wait", "--timeout", "180s", timeout=240)
    from dwdp_dev.operator.cluster import wait_established

    wait_established(tc, "dwdpdeployments.dwdp.io")


def group_phases(tc: Any, ns: str, name: str) -> tuple[str, str]:
    """(deployment phase, one-line summary of the groups and generation servers)."""
    obj = tc.get("dwdp", name, ns)
    st = obj.get("status") or {}
    groups = ", ".join(
        f"{g['name']} i{g.get('incarnation', 0)} {g.get('phase')} "
        f"{g.get('ranksReady', 0)}/{g.get('ranksTotal', 0)}"
        for g in st.get("groups") or ()
    )
    gen = st.get("generation") or {}
    text = f"{st.get('phase') or '-'}: {groups or 'no groups yet'}"
    if gen:
        text += f"; generation {gen.get('readyReplicas', 0)}/{gen.get('replicas', 0)}"
    return st.get("phase") or "", text


def wait_ready(
    tc: Any,
    ns: str,
    name: str,
    *,
    groups: int,
    timeout: float = READY_TIMEOUT_S,
    show: Callable[[str], None] = say,
) -> float:
    """Wait until the deployment is Ready with ``groups`` committed groups, printing each new
    phase summary; returns the seconds waited. Raises AssertionError on timeout."""
    start = time.monotonic()
    last = ""
    while True:
        try:
            obj = tc.get("dwdp", name, ns)
        except AssertionError:
            obj = {}
        st = obj.get("status") or {}
        try:
            _, text = group_phases(tc, ns, name)
        except AssertionError:
            text = "not found"
        if text != last:
            show(f"  [{time.monotonic() - start:6.1f}s] {text}")
            last = text
        gen = st.get("generation") or {}
        if (
            st.get("phase") == "Ready"
            and st.get("readyGroups") == groups
            and st.get("observedGeneration") == obj["metadata"].get("generation")
            and gen.get("readyReplicas", 0) == gen.get("replicas", 0)
        ):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{name} not Ready after {timeout:.0f} s; last: {text}")
        time.sleep(1.0)


@dataclass(frozen=True)
class Endpoint:
    """One rank's HTTP server as listed by the client Service's EndpointSlices."""

    group: str
    address: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


def service_endpoints(tc: Any, ns: str, name: str) -> list[Endpoint]:
    """Every ready (address, port) of the client Service ``name``, tagged with its group."""
    slices = json.loads(
        tc.kubectl(
            "get",
            "endpointslices",
            "-n",
            ns,
            "-l",
            f"kubernetes.io/service-name={name}",
            "-o",
            "json",
        ).stdout
    )["items"]
    pods = json.loads(
        tc.kubectl("get", "pods", "-n", ns, "-l", "dwdp.io/deployment", "-o", "json").stdout
    )["items"]
    group_of = {
        p["status"].get("podIP"): p["metadata"]["labels"].get("dwdp.io/group", "?")
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }
    out = []
    for s in slices:
        for port in s.get("ports") or ():
            for ep in s.get("endpoints") or ():
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                for addr in ep.get("addresses") or ():
                    out.append(Endpoint(group_of.get(addr, "?"), addr, int(port["port"])))
    return sorted(out, key=lambda e: (e.group, e.address, e.port))


def generation_endpoints(tc: Any, ns: str, port: int = 8000) -> list[Endpoint]:
    """The generation servers (their pod addresses: the client Service lists context ranks)."""
    pods = json.loads(
        tc.kubectl("get", "pods", "-n", ns, "-l", "dwdp.io/role=generation", "-o", "json").stdout
    )["items"]
    return [
        Endpoint(
            p["metadata"]["labels"].get("dwdp.io/group", p["metadata"]["name"]),
            p["status"]["podIP"],
            port,
        )
        for p in pods
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]


def requests_of() -> list[tuple[str, dict[str, Any]]]:
    """The demo's requests: one completion per prompt and one chat, greedy."""
    reqs: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
        for p in PROMPTS
    ]
    reqs.append(
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0})
    )
    return reqs


def answer_of(path: str, body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def ask_json(url: str, path: str, req: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST one request with the API key; returns the answer's body. Raises on an HTTP error."""
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url + path, json=req, headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
    body: dict[str, Any] = r.json()
    return body


def ask(url: str, path: str, req: dict[str, Any], timeout: float = 120.0) -> str:
    """POST one request; returns the answer text. Raises on an HTTP error."""
    return answer_of(path, ask_json(url, path, req, timeout))


def without_key(url: str) -> int:
    """The status of a completion sent without the API key (401 when the key holds)."""
    import httpx

    path, req = requests_of()[0]
    return httpx.post(url + path, json=req, timeout=30).status_code


def tool_turn(url: str) -> tuple[str, bool]:
    """A tool loop through ``url``: the demo model, asked for Paris's weather with the
    ``get_weather`` tool offered (``tool_choice`` auto), answers a call the server parses out
    of its text; given the tool's answer, it answers the user. Returns what happened as shown
    (or the error) and whether it is what the model learned: ``get_weather`` with ``{"city":
    "Paris"}`` (``finish_reason`` ``tool_calls``), then ``weather_answer("Paris")``."""
    from dwdp_dev.worker.demo_corpus import (
        WEATHER_REPORT,
        WEATHER_TOOL,
        weather_answer,
        weather_question,
    )

    messages: list[dict[str, Any]] = [{"role": "user", "content": weather_question("Paris")}]
    req = {"tools": [WEATHER_TOOL], "max_tokens": 64, "temperature": 0}
    try:
        first = ask_json(url, "/v1/chat/completions", {"messages": messages, **req})
        call = first["choices"][0]
        calls = [c["function"] for c in call["message"].get("tool_calls") or []]
        messages += [call["message"]] + [
            {"role": "tool", "tool_call_id": c["id"], "content": WEATHER_REPORT}
            for c in call["message"].get("tool_calls") or []]
        final = ask(url, "/v1/chat/completions", {"messages": messages, **req})
    except Exception as exc:  # reported as a wrong answer, with the cause
        return f"<error: {exc}>", False
    shown = ", ".join(f"{c['name']}({c['arguments']})" for c in calls) or repr(
        call["message"].get("content"))
    learned = [{"name": "get_weather", "arguments": json.dumps({"city": "Paris"},
                                                                separators=(",", ":"))}]
    return (f"{shown} [{call['finish_reason']}]; the tool answers {WEATHER_REPORT!r} -> "
            f"{final!r}"), (calls == learned and call["finish_reason"] == "tool_calls"
                            and final == weather_answer("Paris"))


def reference_answers(model_dir: Path) -> list[str]:
    """The answers of a single process with replicated weights (same server code, no DWDP)."""
    import torch
    from fastapi.testclient import TestClient

    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.server.app import build_app

    torch.set_num_threads(1)
    model, tok = load_checkpoint(str(model_dir))
    engine = ContinuousEngine(model, tok, model_name=MODEL_DIR).start()
    try:
        app = build_app(engine, served_name=MODEL_DIR)
        with TestClient(app) as client:
            out = []
            for path, req in requests_of():
                r = client.post(path, json=req)
                assert r.status_code == 200, r.text
                out.append(answer_of(path, r.json()))
            return out
    finally:
        engine.stop()


@dataclass
class Results:
    """What the demo asked and got."""

    rows: list[tuple[Endpoint, str, str, bool]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r[3] for r in self.rows)


def ask_everyone(endpoints: list[Endpoint], want: list[str]) -> Results:
    """Every request of the demo to every endpoint, compared with ``want``."""
    res = Results()
    for ep in endpoints:
        for (path, req), expected in zip(requests_of(), want, strict=True):
            try:
                got = ask(ep.url, path, req)
            except Exception as exc:  # reported as a mismatch, with the cause
                got = f"<error: {exc}>"
            res.rows.append((ep, path, got, got == expected))
    return res


def throughput(endpoints: list[Endpoint], *, count: int, workers: int = 8) -> tuple[float, int]:
    """Send ``count`` completion requests spread over ``endpoints`` concurrently; returns
    (requests per second, failures)."""
    path, req = requests_of()[0]
    jobs = [endpoints[i % len(endpoints)].url for i in range(count)]

    def one(url: str) -> bool:
        try:
            ask(url, path, req)
            return True
        except Exception:
            return False

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        oks = list(pool.map(one, jobs))
    took = time.monotonic() - start
    return count / took, oks.count(False)


# ----------------------------------------------------------------------------- the router


def router_ready(tc: Any, ns: str, name: str, *, prefill: int, decode: int) -> dict | None:
    """``status.router`` once the router is Ready (condition RouterReady and a Ready pod)
    routing to ``prefill`` context ranks and ``decode`` generation servers, else None."""
    obj = tc.get("dwdp", name, ns)
    st = obj.get("status") or {}
    cond = {c["type"]: c for c in st.get("conditions") or ()}.get("RouterReady") or {}
    router = st.get("router") or {}
    if (
        cond.get("status") == "True"
        and cond.get("observedGeneration") == obj["metadata"].get("generation")
        and router.get("readyReplicas", 0) >= 1
        and (router.get("prefillServers"), router.get("decodeServers")) == (prefill, decode)
    ):
        return dict(router)
    return None


def wait_router(
    tc: Any, ns: str, name: str, *, prefill: int, decode: int, timeout: float = 300.0
) -> tuple[dict[str, Any], float]:
    """Wait for ``router_ready``; returns (``status.router``, seconds waited)."""
    start = time.monotonic()
    st = tc.wait_for(
        lambda: router_ready(tc, ns, name, prefill=prefill, decode=decode),
        timeout=timeout,
        interval=1.0,
        message=f"router of {name} Ready with {prefill} context ranks and {decode} decode",
    )
    return st, time.monotonic() - start


def router_address(tc: Any, ns: str, endpoint: str) -> Endpoint:
    """Where to reach the router Service of ``endpoint`` (``http://NAME.NS.svc:PORT``) from
    this host: on a real node its ClusterIP (kube-proxy's rules, the Service CIDR routed to
    ``lo``); on process kubelets, which have no kube-proxy, a ready address of its
    EndpointSlices at the Service port's target port (what kube-proxy would pick)."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    service = (parts.hostname or "").split(".")[0]
    svc = tc.get("service", service, ns)
    port = next(p for p in svc["spec"]["ports"] if p["port"] == parts.port)
    if tc.real_node:
        return Endpoint("router", svc["spec"]["clusterIP"], int(port["port"]))
    target = int(port.get("targetPort") or port["port"])
    found = [e for e in service_endpoints(tc, ns, service) if e.port == target]
    if not found:
        raise AssertionError(f"router Service {service}: no ready endpoint on port {target}")
    return Endpoint("router", found[0].address, target)


def server_name(ref: dict[str, Any] | None) -> str:
    """A ``ServerRef`` of the ``dwdp`` answer field, short: ``demo-g0 rank 2``, ``demo-gen0``."""
    if not ref:
        return "?"
    name = str(ref.get("group") or ref.get("pod") or ref.get("engine_id") or "?")
    if ref.get("role") == "context" and ref.get("rank") is not None:
        name += f" rank {ref['rank']}"
    return name


@dataclass(frozen=True)
class Routed:
    """One answer through the router: what was asked and got, who prefilled and decoded."""

    path: str
    got: str
    same: bool
    prefill: str
    decode: str


def ask_routed(url: str, path: str, req: dict[str, Any], want: str) -> Routed:
    """One request through the router, compared with ``want`` (errors are mismatches)."""
    try:
        body = ask_json(url, path, req)
    except Exception as exc:  # reported as a mismatch, with the cause
        return Routed(path, f"<error: {exc}>", False, "?", "?")
    got = answer_of(path, body)
    served = body.get("dwdp") or {}
    prefill, decode = server_name(served.get("prefill")), server_name(served.get("decode"))
    return Routed(path, got, got == want, prefill, decode)


def ask_router(url: str, want: list[str], *, rounds: int) -> list[Routed]:
    """Every request of the demo ``rounds`` times through the router, one at a time (with
    round robin over the context ranks, ``rounds`` x 4 requests reach that many ranks)."""
    return [
        ask_routed(url, path, req, expected)
        for _ in range(rounds)
        for (path, req), expected in zip(requests_of(), want, strict=True)
    ]


@dataclass
class Throughput:
    """A concurrent round through the router: requests/s, failures (errors or answers that
    differ from the reference), and how many answers each server prefilled and decoded."""

    rps: float
    failed: int
    prefill: dict[str, int]
    decode: dict[str, int]


def routed_throughput(url: str, want: str, *, count: int, workers: int = 8) -> Throughput:
    """``count`` copies of the demo's first completion sent through the router by ``workers``
    concurrent clients; the clock covers every answer, and each is checked against ``want``."""
    from collections import Counter

    path, req = requests_of()[0]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        rows = list(pool.map(lambda _: ask_routed(url, path, req, want), range(count)))
    took = time.monotonic() - start
    return Throughput(
        count / took,
        sum(not r.same for r in rows),
        dict(sorted(Counter(r.prefill for r in rows).items())),
        dict(sorted(Counter(r.decode for r in rows).items())),
    )


def kv_transfer_of(url: str) -> dict[str, Any]:
    """``/dwdp/status``'s ``kv_transfer`` of one server (empty without one)."""
    import httpx

    got: dict[str, Any] = httpx.get(url + "/dwdp/status", timeout=10).json()
    return dict(got.get("kv_transfer") or {})


# ----------------------------------------------------------------------------- main


def default_state_dir() -> Path:
    base = Path(os.environ.get("DWDP_CACHE_DIR") or Path.home() / ".cache" / "dwdp")
    return base / "clusters" / "demo"


PARSED_HELP = 10
"""``--parse-only``'s status when it printed the help: scripts/demo.sh stops there."""


STATE_MARK = ".dwdp-demo-state"
"""The file the demo writes into a state folder it made: only such a folder (or the default
one) is emptied at the start and removed at the end."""


def _state_dir(text: str) -> Path:
    """``--state-dir``: a new folder, an empty one, the default one or one an earlier demo made
    (it holds ``STATE_MARK``); anything else is refused, since the demo deletes the folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a folder path (got an empty one)")
    state = Path(text).expanduser().resolve()
    if state.exists() and not state.is_dir():
        raise argparse.ArgumentTypeError(f"{str(state)!r} exists and is not a folder")
    mine = state == default_state_dir().resolve() or (state / STATE_MARK).exists()
    if state.is_dir() and any(state.iterdir()) and not mine:
        raise argparse.ArgumentTypeError(
            f"{str(state)!r} holds files the demo did not make (no {STATE_MARK} in it), and the "
            "demo deletes its state folder: give a new or empty folder"
        )
    return state


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options (scripts/demo.sh passes its own). Exits 2 with argparse's message
    for a bad one."""
    p = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the cluster and the deployment "
        "running and print how to reach them and stop them",
    )
    p.add_argument(
        "--state-dir",
        type=_state_dir,
        default=None,
        help="cluster state folder, deleted when the demo ends (a new or empty folder, or one "
        "an earlier demo made; default ~/.cache/dwdp/clusters/demo)",
    )
    p.add_argument(
        "--requests",
        type=_positive,
        default=48,
        help="completion requests of the throughput round (default 48)",
    )
    p.add_argument(
        "--node",
        choices=("process", "real"),
        default="real",
        help="the local cluster's node: 'real' (default: containerd, the kubelet and "
        "kube-proxy; needs root; builds the operator and worker images first) or 'process' "
        "(process kubelets: pods run as host processes from .venv)",
    )
    # scripts/demo.sh checks the options with the system's Python before it makes .venv and
    # builds the control plane (minutes on a fresh machine), so a typo fails at once
    p.add_argument("--parse-only", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2)
        if exc.code == 0 and "--parse-only" in (sys.argv[1:] if argv is None else argv):
            return PARSED_HELP
        raise
    if args.parse_only:
        print(args.node)  # scripts/demo.sh installs the real node's packages for "real"
        return 0
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no progress bars in the log

    state = (args.state_dir or default_state_dir()).resolve()
    if state.exists():
        from dwdp_dev.devcluster.cluster import Cluster

        if Cluster(state).running():  # another demo (or one left with --keep) owns it
            print(
                f"demo: a cluster is already running in {state}; stop it with "
                f"`.venv/bin/dwdp dev down --state-dir {state} && rm -rf {state}`, "
                "or run this demo elsewhere with --state-dir DIR",
                file=sys.stderr,
            )
            return 1
        shutil.rmtree(state, ignore_errors=True)  # what a stopped demo left behind
    state.mkdir(parents=True, exist_ok=True)
    (state / STATE_MARK).write_text("made by scripts/demo.sh; removed with the folder\n")
    t0 = time.monotonic()
    say(f"== 1/7 starting the local control plane (state {state})")
    try:
        tc = start_cluster(state, node_kind=args.node)
    except KeyboardInterrupt as exc:  # the start stopped what it had started
        code = _stopped(exc)
        say("== tearing down")
        shutil.rmtree(state, ignore_errors=True)
        say("   cluster stopped, state removed")
        return code
    except Exception as exc:  # the state folder keeps the components' logs it names
        say(f"DEMO FAILED: the local cluster did not start: {exc}")
        return 1
    ok = False
    interrupted = 0
    # the worker image's import (minutes for its 3.3 GB the first time) beside the operator's
    # install and the model; awaited before the apply
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="import")
    importing = background.submit(import_worker, tc)
    try:
        say(f"   up in {time.monotonic() - t0:.1f} s; KUBECONFIG={tc.kubeconfig}")
        say("== 2/7 installing the operator with its Helm chart (charts/dwdp-operator)")
        install_operator(tc)
        say(tc.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE).stdout.rstrip())
        say("== 3/7 the tiny DeepSeek-V3-family demo model, trained on a corpus of facts")
        models = state / "models"
        t_model = time.monotonic()
        model_dir = make_model(models)
        cfg = json.loads((model_dir / "config.json").read_text())
        trained = json.loads((model_dir / "dwdp_checkpoint.json").read_text())["trained"]
        say(
            f"   {model_dir}: {cfg.get('num_hidden_layers')} layers, "
            f"{cfg.get('n_routed_experts')} routed experts + {cfg.get('n_shared_experts')} "
            f"shared, hidden {cfg.get('hidden_size')}; trained once on {trained['examples']} "
            f"texts in {trained['seconds']} s (final loss {trained['final_loss']}; kept in the "
            f"cache), ready in {time.monotonic() - t_model:.1f} s"
        )
        say(f"== 4/7 kubectl apply -f {EXAMPLE.relative_to(REPO)} (namespace {NAMESPACE})")
        importing.result()
        tc.kubectl("create", "namespace", NAMESPACE, check=False)
        doc = manifest(models)
        spec = doc["spec"]["context"]
        ranks = spec["dwdp"]["dwdpSize"]
        t_apply = time.monotonic()
        tc.apply(NAMESPACE, api_key_secret(), doc)
        ready_s = wait_ready(tc, NAMESPACE, NAME, groups=spec["replicas"])
        say(f"   Ready {ready_s:.1f} s after apply")
        gens = doc["spec"]["generation"]["replicas"]
        router, router_s = wait_router(
            tc, NAMESPACE, NAME, prefill=spec["replicas"] * ranks, decode=gens
        )
        say(
            f"   router Ready {ready_s + router_s:.1f} s after apply: "
            f"{router['prefillServers']} context ranks prefill, "
            f"{router['decodeServers']} generation server(s) decode"
        )
        say(tc.kubectl("get", "dwdp", "-n", NAMESPACE, "-o", "wide").stdout.rstrip())
        say("== 5/7 reference: one process, replicated weights, same checkpoint, greedy")
        want = reference_answers(model_dir)
        for (path, req), text in zip(requests_of(), want, strict=True):
            q = req.get("prompt") or req["messages"][-1]["content"]
            say(f"   {path:22} {q!r} -> {text!r}")
        say(
            "== 6/7 asking through the router: a context rank prefills, the generation server "
            "decodes"
        )
        ctx = service_endpoints(tc, NAMESPACE, NAME)
        gen = generation_endpoints(tc, NAMESPACE)
        groups = sorted({e.group for e in ctx})
        at = router_address(tc, NAMESPACE, router["endpoint"])
        say(
            f"   router {router['endpoint']} (at {at.address}:{at.port}, "
            f"{'its ClusterIP' if tc.real_node else 'its EndpointSlice'}) "
            f"in front of {len(ctx)} ranks in {len(groups)} groups ({', '.join(groups)}) "
            f"and {len(gen)} generation server(s)"
        )
        rounds = max(1, -(-len(ctx) // len(want)))  # round robin: every rank prefills once
        rows = ask_router(at.url, want, rounds=rounds)
        say(f"   {'prefilled by':16} {'decoded by':12} {'request':22} answer")
        for r in rows:
            mark = "==" if r.same else "!="
            say(f"   {r.prefill:16} {r.decode:12} {r.path:22} {r.got!r} {mark} reference")
        ranks_seen = sorted({r.prefill for r in rows})
        everyone = {f"{g} rank {k}" for g in groups for k in range(ranks)}
        say(
            f"   context ranks that prefilled: {len(ranks_seen)}/{len(everyone)}; "
            + "; ".join(
                f"generation server {g.group} read {kv.get('blocks_received', 0)} KV blocks "
                f"over NIXL ({kv.get('remote_prefill_tokens', 0)} prompt tokens prefilled "
                "remotely)"
                for g, kv in ((g, kv_transfer_of(g.url)) for g in gen)
            )
        )
        locked = without_key(ctx[0].url)
        gated = without_key(at.url)
        say(
            f"   asked without the API key (Secret {API_KEY_SECRET}): a rank HTTP {locked}, "
            f"the router HTTP {gated}"
        )
        call, called = tool_turn(at.url)
        say(f"   a tool call through the router (get_weather offered, tool_choice auto): "
            f"{call} {'==' if called else '!='} what the model learned")
        tp = routed_throughput(at.url, want[0], count=args.requests)
        spread = (
            f"{len(tp.prefill)} ranks, {next(iter(tp.prefill.values()))} each"
            if len(set(tp.prefill.values())) == 1
            else ", ".join(f"{k}: {v}" for k, v in tp.prefill.items())
        )
        say(
            f"   throughput through the router: {args.requests} completions (up to "
            f"{MAX_TOKENS} tokens each), 8 clients at a time: {tp.rps:.2f} requests/s, "
            f"{tp.failed} failed or different; prefilled by {spread}; decoded by "
            + ", ".join(f"{k} ({v})" for k, v in tp.decode.items())
        )
        say("== 7/7 summary")
        say(tc.kubectl("get", "dwdp", "-n", NAMESPACE, "-o", "wide").stdout.rstrip())
        ok = (
            bool(rows)
            and all(r.same for r in rows)
            and set(ranks_seen) == everyone
            and tp.failed == 0
            and len(groups) == spec["replicas"]
            and locked == 401
            and gated == 401
            and called
        )
        say(f"   answers equal to the reference: {sum(r.same for r in rows)}/{len(rows)}")
        say(
            f"   time from apply to Ready: {ready_s:.1f} s "
            f"(router Ready: {ready_s + router_s:.1f} s)"
        )
        say(f"   requests/s served through the router: {tp.rps:.2f}")
        say(f"   total {time.monotonic() - t0:.1f} s (apply at +{t_apply - t0:.1f} s)")
        say("DEMO OK" if ok else "DEMO FAILED: some answers differ from the reference")
    except KeyboardInterrupt as exc:
        interrupted = _stopped(exc)
    except Exception as exc:
        say(f"DEMO FAILED: {exc}")
        with contextlib.suppress(Exception):
            say(tc.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout)
    finally:
        background.shutdown(wait=True)  # an import under way ends before the teardown
        if args.keep:
            say("\nThe cluster keeps running. Reach it with:")
            say(f'  eval "$(.venv/bin/dwdp dev env --state-dir {state})"  # or:')
            say(f"  export KUBECONFIG={tc.kubeconfig} PATH={tc.tools_bin}:$PATH")
            say(f"  kubectl get dwdp -n {NAMESPACE} -o wide")
            if tc.real_node:  # kube-proxy serves the router's Service on this host
                say(
                    f"  kubectl get service {NAME}-router -n {NAMESPACE} -o jsonpath="
                    "'{.spec.clusterIP}:{.spec.ports[?(@.name==\"http\")].port}'"
                )
            else:  # the router's address and its http port (the slice lists metrics too)
                say(
                    f"  kubectl get endpointslices -n {NAMESPACE} "
                    f"-l kubernetes.io/service-name={NAME}-router -o jsonpath="
                    "'{.items[0].endpoints[0].addresses[0]}:"
                    '{.items[0].ports[?(@.name=="http")].port}\''
                )
            say(  # the key the router and the ranks check (the Secret holds it base64)
                f"  KEY=$(kubectl get secret {API_KEY_SECRET} -n {NAMESPACE} "
                "-o jsonpath='{.data.api-key}' | base64 -d)"
            )
            say(
                "  curl http://<that address:port>/v1/completions -H 'content-type: "
                "application/json' -H \"authorization: Bearer $KEY\" "
                '-d \'{"prompt": "Hello", "max_tokens": 8}\''
            )
            say("Stop it with:")
            say(f"  .venv/bin/dwdp dev down --state-dir {state} && rm -rf {state}")
        else:
            say("== tearing down")
            tc.kubectl(
                "delete",
                "dwdp",
                NAME,
                "-n",
                NAMESPACE,
                "--wait=true",
                "--timeout=60s",
                check=False,
                timeout=90,
            )
            tc.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, check=False)
            tc.cluster.down(timeout_s=20)
            shutil.rmtree(state, ignore_errors=True)
            say("   cluster stopped, state removed")
    if interrupted:  # the shell's code for a run stopped by a signal: 128 + SIGINT or SIGTERM
        return interrupted
    return 0 if ok else 1


class Terminated(KeyboardInterrupt):
    """SIGTERM (a plain ``kill``, a CI job's timeout) stops the demo as Ctrl-C does: the
    cluster is torn down and the state folder removed; the exit status is 143."""


def _stopped(exc: KeyboardInterrupt) -> int:
    """Say how the demo was stopped; return the shell's code for it: 128 + SIGTERM or SIGINT."""
    say(f"\ndemo: {'terminated (SIGTERM)' if isinstance(exc, Terminated) else 'interrupted'}")
    return 143 if isinstance(exc, Terminated) else 130


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:  # before the cluster is up, or a second signal later
        print("\ndemo: interrupted", file=sys.stderr)
        sys.exit(143 if isinstance(exc, Terminated) else 130)
