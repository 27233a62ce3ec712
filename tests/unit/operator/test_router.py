"""The router's builders (vllm-router in PD mode): its arguments list every server URL, its
API key comes from the Secret by reference, its NetworkPolicy and condition."""

from __future__ import annotations

import json

from dwdp.api.deployment import parse_deployment
from dwdp.operator import builders, router
from dwdp.operator import constants as c
from dwdp.operator.observe import ObservedPod, RouterPod, pod_from_object

OWNER = builders.Owner("demo", "ns1", "uid-1")
SERVERS = router.RouterServers(
    prefill=tuple(f"http://10.0.0.1:{8000 + k}" for k in range(4)),
    decode=("http://10.0.0.2:8000",),
)


def spec(**patch):
    doc = {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {"path": "/models/tiny"},
            "image": "worker:1",
            "context": {"ranksPerPod": 4, "handleType": "shm", "dwdp": {"dwdpSize": 4}},
            "generation": {"replicas": 1},
            **patch,
        },
    }
    return parse_deployment(doc).spec


def _pod(name: str, ip: str | None, ranks: int) -> ObservedPod:
    """A listed context pod of ``ranks`` local ranks at ``ip``."""
    labels = {
        c.LABEL_ROLE: "context",
        c.LABEL_GROUP_INDEX: "0",
        c.LABEL_INCARNATION: "0",
        c.LABEL_POD_INDEX: "0",
        c.LABEL_REVISION: "r",
    }
    ports = [{"name": f"rank-{k}", "containerPort": 8000 + k} for k in range(ranks)]
    pod = pod_from_object(
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"ports": ports}]},
            "status": {"phase": "Running", "podIP": ip},
        }
    )
    assert pod is not None
    return pod


def test_rank_urls_list_every_local_rank_of_every_pod() -> None:
    pods = [_pod("b", "10.0.0.2", 2), _pod("a", "10.0.0.1", 4), _pod("c", None, 1)]
    assert router.rank_urls(pods, base_port=8000) == (
        "http://10.0.0.1:8000",
        "http://10.0.0.1:8001",
        "http://10.0.0.1:8002",
        "http://10.0.0.1:8003",
        "http://10.0.0.2:8000",
        "http://10.0.0.2:8001",
    )


def _split(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The gate's options (before ``--``) and the vllm-router command line (after)."""
    cut = args.index("--")
    return dict(zip(args[:cut:2], args[1:cut:2], strict=True)), args[cut + 1 :]


def test_the_arguments_name_every_server_and_the_pd_mode() -> None:
    gate, args = _split(router.router_args(spec(), SERVERS))
    assert gate == {"--host": "$(POD_IP)", "--port": "8000"}  # the gate listens there
    assert args[:2] == ["vllm-router", "--vllm-pd-disaggregation"]
    assert "--host" not in args and "--port" not in args  # vllm-router: loopback, the gate's
    prefill = [args[i + 1] for i, a in enumerate(args) if a == "--prefill"]
    decode = [args[i + 1] for i, a in enumerate(args) if a == "--decode"]
    assert prefill == list(SERVERS.prefill) and decode == list(SERVERS.decode)
    pairs = dict(zip(args[2::2], args[3::2], strict=False))
    assert pairs["--prometheus-host"] == "$(POD_IP)" and pairs["--prometheus-port"] == "29000"
    assert pairs["--prefill-policy"] == "round_robin" == pairs["--decode-policy"]


def test_the_deployment_runs_the_gate_with_the_key_mounted_by_reference() -> None:
    s = spec(server={"apiKeySecretRef": {"name": "demo-key", "key": "token"}})
    dep = router.router_deployment(s, OWNER, SERVERS)
    assert dep["metadata"]["name"] == "demo-router" and dep["spec"]["replicas"] == 1
    pod = dep["spec"]["template"]
    ctr = pod["spec"]["containers"][0]
    assert ctr["command"] == ["dwdp", "router-gate"] and ctr["image"] == "worker:1"
    env = {e["name"]: e for e in ctr["env"]}
    assert env["DWDP_API_KEY_FILE"] == {
        "name": "DWDP_API_KEY_FILE", "value": "/var/run/secrets/dwdp/api-key/key"
    }
    assert "OPENAI_API_KEY" not in env and "--api-key" not in ctr["args"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "api-key"]
    assert volume["secret"] == {
        "secretName": "demo-key", "defaultMode": 0o400, "items": [{"key": "token", "path": "key"}]
    }
    assert {"name": "api-key", "mountPath": "/var/run/secrets/dwdp/api-key",
            "readOnly": True} in ctr["volumeMounts"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": 8000}
    assert ctr["readinessProbe"]["timeoutSeconds"] == 5  # not the 1 s default
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": 8000}
    assert ctr["livenessProbe"]["failureThreshold"] * ctr["livenessProbe"]["periodSeconds"] >= 30
    # a rolled pod serves on until kube-proxy dropped it, within its grace period
    delay = ctr["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < delay < pod["spec"]["terminationGracePeriodSeconds"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels[c.LABEL_MANAGED_BY] == c.MANAGED_BY  # its pods wake the deployment's loop
    assert c.LABEL_ROLE not in labels  # not a worker pod
    assert pod["metadata"]["annotations"][c.ANNOTATION_ROUTER_SERVERS] == SERVERS.digest
    no_key = router.router_deployment(spec(), OWNER, SERVERS)["spec"]["template"]["spec"]
    assert [e["name"] for e in no_key["containers"][0]["env"]] == ["POD_IP"]
    assert [v["name"] for v in no_key["volumes"]] == ["tmp"]


def test_without_servers_the_router_waits_at_zero_replicas() -> None:
    for servers in (
        router.RouterServers(),
        router.RouterServers(prefill=SERVERS.prefill),
        router.RouterServers(decode=SERVERS.decode),
    ):
        assert router.router_deployment(spec(), OWNER, servers)["spec"]["replicas"] == 0
    assert router.router_deployment(spec(router={"replicas": 3}), OWNER, SERVERS)["spec"][
        "replicas"
    ] == 3


def test_a_changed_server_list_changes_the_pod_template() -> None:
    fewer = router.RouterServers(prefill=SERVERS.prefill[:3], decode=SERVERS.decode)
    a = router.router_deployment(spec(), OWNER, SERVERS)
    b = router.router_deployment(spec(), OWNER, fewer)
    assert a["spec"]["template"] != b["spec"]["template"]
    assert builders.applied_hash(a) != builders.applied_hash(b)
    assert builders.applied_hash(a) == builders.applied_hash(
        router.router_deployment(spec(), OWNER, SERVERS)
    )


def test_router_settings_reach_the_pod() -> None:
    s = spec(
        router={
            "image": "router:2",
            "port": 9000,
            "metricsPort": 9100,
            "prefillPolicy": "cache_aware",
            "decodePolicy": "power_of_two",
            "requestTimeoutSeconds": 60,
            "resources": {"requests": {"cpu": "500m"}},
        }
    )
    ctr = router.router_deployment(s, OWNER, SERVERS)["spec"]["template"]["spec"]["containers"][0]
    gate, args = _split(ctr["args"])
    pairs = dict(zip(args[2::2], args[3::2], strict=False))
    assert ctr["image"] == "router:2" and ctr["resources"] == {"requests": {"cpu": "500m"}}
    assert (gate["--port"], pairs["--prometheus-port"]) == ("9000", "9100")
    assert ctr["livenessProbe"]["httpGet"]["port"] == 9000
    assert (pairs["--prefill-policy"], pairs["--decode-policy"]) == ("cache_aware", "power_of_two")
    assert pairs["--request-timeout-secs"] == "60"
    svc = router.router_service(s, OWNER)
    assert [p["port"] for p in svc["spec"]["ports"]] == [9000, 9100]
    assert router.router_endpoint(s, OWNER) == "http://demo-router.ns1.svc:9000"


def test_the_router_objects_follow_the_switches() -> None:
    kinds = [o["kind"] for o in router.router_objects(spec(), OWNER, SERVERS)]
    assert kinds == ["Deployment", "Service", "NetworkPolicy"]
    off = spec(networkPolicy={"enabled": False})
    assert [o["kind"] for o in router.router_objects(off, OWNER, SERVERS)] == [
        "Deployment",
        "Service",
    ]
    assert router.router_objects(spec(router={"enabled": False}), OWNER, SERVERS) == []
    assert router.router_objects(spec(generation=None), OWNER, SERVERS) == []


def test_only_the_router_and_the_listed_sources_reach_the_serving_ports() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]
    s = spec(networkPolicy={"servingFrom": peers})
    serving = builders.serving_policy(s, OWNER, operator_namespace="dwdp-system")
    sources = serving["spec"]["ingress"][0]["from"]
    assert {"podSelector": builders.router_selector(OWNER)} in sources
    assert len(sources) == 3
    policy = router.router_policy(s, OWNER)
    assert policy["spec"]["podSelector"] == builders.router_selector(OWNER)
    rule = policy["spec"]["ingress"][0]
    assert rule["from"] == peers and [p["port"] for p in rule["ports"]] == [8000, 29000]
    no_router = spec(networkPolicy={"servingFrom": peers}, router={"enabled": False})
    assert len(builders.serving_policy(no_router, OWNER)["spec"]["ingress"][0]["from"]) == 1
    assert "from" not in router.router_policy(spec(), OWNER)["spec"]["ingress"][0]


def test_the_router_never_carries_a_key_value() -> None:
    """The objects name the Secret; the only plain env value is the key file's path."""
    s = spec(server={"apiKeySecretRef": {"name": "demo-key"}})
    objs = router.router_objects(s, OWNER, SERVERS)
    assert "demo-key" in json.dumps(objs)
    ctr = objs[0]["spec"]["template"]["spec"]["containers"][0]
    values = [e["value"] for e in ctr["env"] if "value" in e]
    assert values == ["/var/run/secrets/dwdp/api-key/key"]


def test_only_ready_router_pods_of_the_current_list_count() -> None:
    pods = [
        RouterPod("a", ready=True, deleting=False, servers=SERVERS.digest),
        RouterPod("b", ready=True, deleting=False, servers="old"),
        RouterPod("c", ready=False, deleting=False, servers=SERVERS.digest),
        RouterPod("d", ready=True, deleting=True, servers=SERVERS.digest),
    ]
    assert router.ready_router_pods(pods, SERVERS) == 1


def test_router_pods_pull_the_worker_image_with_its_pull_secrets_only() -> None:
    """Running the worker image (router.image unset), the router pods get
    spec.imagePullSecrets; another image, or no secrets, gives the pod none."""
    secrets = [{"name": "regcred"}]

    def pod_spec(**patch) -> dict:
        return router.router_deployment(spec(**patch), OWNER, SERVERS)["spec"]["template"]["spec"]

    assert pod_spec(imagePullSecrets=secrets)["imagePullSecrets"] == secrets
    other = pod_spec(imagePullSecrets=secrets, router={"image": "public/vllm-router:1"})
    assert "imagePullSecrets" not in other
    assert "imagePullSecrets" not in pod_spec()
