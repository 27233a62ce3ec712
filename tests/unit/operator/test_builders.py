"""Naming, revision and the object builders, against objects written out by hand."""

from __future__ import annotations

import base64
import copy

import pytest
import yaml

from dwdp.api.deployment import parse_deployment
from dwdp.api.enums import Role
from dwdp.api.launch import LaunchConfig
from dwdp.operator import builders, naming, router
from dwdp.operator import constants as c
from dwdp.operator.builders import Endpoint, Owner

OWNER = Owner(name="demo", namespace="ns1", uid="uid-1")
OWNER_REF = {
    "apiVersion": "dwdp.io/v1alpha1",
    "kind": "DwdpDeployment",
    "name": "demo",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}


def doc(**spec_patch) -> dict:
    spec = {
        "model": {"path": "/models/tiny"},
        "image": "worker:1",
        "context": {"replicas": 2, "ranksPerPod": 2, "dwdp": {"dwdpSize": 4}},
    }
    spec.update(spec_patch)
    return {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"},
        "spec": spec,
    }


SPEC = parse_deployment(doc()).spec


def without_hash(obj: dict) -> dict:
    out = copy.deepcopy(obj)
    annotations = out["metadata"].pop("annotations")
    assert set(annotations) == {c.ANNOTATION_APPLIED_HASH}
    return out


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (naming.config_map("demo", Role.CONTEXT, "abc"), "demo-context-abc"),
        (naming.headless_service("demo", Role.GENERATION), "demo-generation"),
        (naming.client_service("demo"), "demo"),
        (naming.endpoint_slice("demo", 1), "demo-rank-1"),
        (naming.group_name("demo", Role.CONTEXT, 3), "demo-g3"),
        (naming.group_name("demo", Role.GENERATION, 0), "demo-gen0"),
        (naming.pod_name("demo-g3", 2, 1), "demo-g3-i2-p1"),
        (naming.rendezvous_secret("demo-g3", 2), "demo-g3-i2-rdzv"),
        (
            naming.rendezvous_address(
                group="demo-g1",
                incarnation=4,
                deployment="demo",
                role=Role.CONTEXT,
                namespace="ns1",
                port=29500,
            ),
            "demo-g1-i4-p0.demo-context.ns1.svc:29500",
        ),
    ],
)
def test_names(got: str, want: str) -> None:
    assert got == want


def test_longest_names_fit_a_dns_label() -> None:
    dep = "a" * 40
    longest = naming.pod_name(naming.group_name(dep, Role.GENERATION, 999), 99999, 99)
    assert len(longest) <= 63
    assert len(naming.config_map(dep, Role.GENERATION, "0123456789")) <= 63
    assert len(naming.rendezvous_secret(naming.group_name(dep, Role.CONTEXT, 999), 99999)) <= 63


def test_context_pod_of_second_group_second_pod() -> None:
    pod = builders.worker_pod(
        SPEC, OWNER, role=Role.CONTEXT, group_index=1, incarnation=3, pod_index=1, revision="r1"
    )
    want = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-g1-i3-p1",
            "namespace": "ns1",
            "labels": {
                "dwdp.io/deployment": "demo",
                "dwdp.io/role": "context",
                "llm-d.ai/role": "prefill",
                "llm-d.ai/inferenceServing": "true",
                "llm-d.ai/model": "tiny",
                "dwdp.io/group": "demo-g1",
                "dwdp.io/group-index": "1",
                "dwdp.io/pod-index": "1",
                "dwdp.io/revision": "r1",
                "dwdp.io/incarnation": "3",
                "app.kubernetes.io/component": "worker",
                "app.kubernetes.io/managed-by": "dwdp-operator",
            },
            "ownerReferences": [OWNER_REF],
        },
        "spec": {
            "hostname": "demo-g1-i3-p1",
            "subdomain": "demo-context",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "readinessGates": [{"conditionType": "dwdp.io/group-ready"}],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "fsGroup": 1000,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumes": [
                {"name": "launch-config", "configMap": {"name": "demo-context-r1"}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
            "containers": [
                {
                    "name": "worker",
                    "image": "worker:1",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["dwdp", "launch", "--host", "$(DWDP_POD_IP)"],
                    "env": [
                        {"name": "DWDP_GROUP", "value": "demo-g1"},
                        {"name": "DWDP_INCARNATION", "value": "3"},
                        {"name": "DWDP_RANK", "value": "2"},
                        {"name": "DWDP_WORLD_SIZE", "value": "4"},
                        {"name": "DWDP_LOCAL_WORLD_SIZE", "value": "2"},
                        {
                            "name": "DWDP_RENDEZVOUS",
                            "value": "demo-g1-i3-p0.demo-context.ns1.svc:29500",
                        },
                        {"name": "DWDP_RENDEZVOUS_TIMEOUT_S", "value": "1800"},
                        {"name": "DWDP_ROLE", "value": "context"},
                        {"name": "DWDP_REVISION", "value": "r1"},
                        {"name": "DWDP_CONFIG", "value": "/etc/dwdp/context.yaml"},
                        {"name": "DWDP_PORT", "value": "8000"},
                        {
                            "name": "DWDP_POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
                        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.cache/triton"},
                    ],
                    "ports": [
                        {"name": "rank-0", "containerPort": 8000, "protocol": "TCP"},
                        {"name": "rank-1", "containerPort": 8001, "protocol": "TCP"},
                    ],
                    "resources": {
                        "limits": {"nvidia.com/gpu": 2},
                        "requests": {"nvidia.com/gpu": 2},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "privileged": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"add": [], "drop": ["ALL"]},
                    },
                    "readinessProbe": {
                        "httpGet": {"path": "/ready", "port": 8000},
                        "periodSeconds": 2,
                        "failureThreshold": 3,
                    },
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "volumeMounts": [
                        {"name": "launch-config", "mountPath": "/etc/dwdp", "readOnly": True},
                        {"name": "tmp", "mountPath": "/tmp"},
                        {"name": "dshm", "mountPath": "/dev/shm"},
                    ],
                }
            ],
        },
    }
    assert without_hash(pod) == want


def test_pod_zero_exposes_the_rendezvous_port_and_user_settings_reach_the_pod() -> None:
    spec = parse_deployment(
        doc(
            env=[{"name": "HF_HOME", "value": "/cache"}],
            resources={"limits": {"memory": "8Gi"}},
            nodeSelector={"gpu": "h200"},
            model={"path": "/models/tiny", "hostPath": "/data/models"},
            gracefulShutdownTimeoutSeconds=20,
        )
    ).spec
    pod = builders.worker_pod(
        spec, OWNER, role=Role.CONTEXT, group_index=0, incarnation=0, pod_index=0, revision="r"
    )
    ctr = pod["spec"]["containers"][0]
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in ctr["ports"]
    assert ctr["env"][-1] == {"name": "HF_HOME", "value": "/cache"}
    assert ctr["env"][2] == {"name": "DWDP_RANK", "value": "0"}
    assert ctr["resources"] == {
        "limits": {"memory": "8Gi", "nvidia.com/gpu": 2},
        "requests": {"nvidia.com/gpu": 2},
    }
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30
    assert pod["spec"]["volumes"][1] == {
        "name": "model",
        "hostPath": {"path": "/data/models", "type": "Directory"},
    }
    assert ctr["volumeMounts"][1] == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_headless_service_per_role() -> None:
    want = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "demo-context",
            "namespace": "ns1",
            "labels": {
                "dwdp.io/deployment": "demo",
                "dwdp.io/role": "context",
                "app.kubernetes.io/component": "service",
                "app.kubernetes.io/managed-by": "dwdp-operator",
            },
            "ownerReferences": [OWNER_REF],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"dwdp.io/deployment": "demo", "dwdp.io/role": "context"},
            "ports": [
                {"name": "rendezvous", "port": 29500, "protocol": "TCP"},
                {"name": "rank-0", "port": 8000, "protocol": "TCP"},
                {"name": "rank-1", "port": 8001, "protocol": "TCP"},
            ],
        },
    }
    assert without_hash(builders.headless_service(SPEC, OWNER, Role.CONTEXT)) == want


def test_client_service_has_no_selector_and_one_port_per_local_rank() -> None:
    svc = without_hash(builders.client_service(SPEC, OWNER))
    assert svc["metadata"]["name"] == "demo"
    assert "selector" not in svc["spec"]
    assert svc["spec"]["ports"] == [
        {"name": "rank-0", "port": 8000, "targetPort": 8000, "protocol": "TCP"},
        {"name": "rank-1", "port": 8001, "targetPort": 8001, "protocol": "TCP"},
    ]


def test_endpoint_slices_one_per_local_rank_sorted_by_pod() -> None:
    slices = builders.endpoint_slices(
        SPEC, OWNER, [Endpoint("demo-g1-i0-p0", "10.0.0.2"), Endpoint("demo-g0-i0-p0", "10.0.0.1")]
    )
    assert [s["metadata"]["name"] for s in slices] == ["demo-rank-0", "demo-rank-1"]
    second = without_hash(slices[1])
    assert second["metadata"]["labels"]["kubernetes.io/service-name"] == "demo"
    assert second["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == (
        "dwdp-operator.dwdp.io"
    )
    assert second["addressType"] == "IPv4"
    assert second["ports"] == [{"name": "rank-1", "port": 8001, "protocol": "TCP"}]
    assert second["endpoints"] == [
        {
            "addresses": ["10.0.0.1"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "targetRef": {"kind": "Pod", "name": "demo-g0-i0-p0", "namespace": "ns1"},
        },
        {
            "addresses": ["10.0.0.2"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "targetRef": {"kind": "Pod", "name": "demo-g1-i0-p0", "namespace": "ns1"},
        },
    ]


def test_config_map_holds_the_launch_config_the_worker_reads() -> None:
    cm = without_hash(builders.config_map(SPEC, OWNER, Role.CONTEXT, "r1"))
    assert cm["metadata"]["name"] == "demo-context-r1"
    assert cm["metadata"]["labels"]["dwdp.io/revision"] == "r1"
    assert cm["immutable"] is True
    launch = yaml.safe_load(cm["data"]["context.yaml"])
    assert launch["role"] == "context"
    assert launch["dwdp"]["dwdpSize"] == 4
    assert launch["model"]["path"] == "/models/tiny"
    assert launch["serverPort"] == 8000


def test_generation_shape_and_pod() -> None:
    # A generation server is one rank (the worker runs no tensor parallelism).
    spec = parse_deployment(doc(generation={"replicas": 2, "ranksPerPod": 1})).spec
    shapes = builders.role_shapes(spec)
    assert shapes[Role.GENERATION] == builders.RoleShape(Role.GENERATION, 2, 1, 1)
    assert shapes[Role.GENERATION].pods_per_group == 1
    assert shapes[Role.CONTEXT].pods_per_group == 2
    pod = builders.worker_pod(
        spec, OWNER, role=Role.GENERATION, group_index=1, incarnation=0, pod_index=0, revision="g"
    )
    assert pod["metadata"]["name"] == "demo-gen1-i0-p0"
    assert pod["spec"]["subdomain"] == "demo-generation"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["DWDP_ROLE"] == "generation"
    assert env["DWDP_CONFIG"] == "/etc/dwdp/generation.yaml"
    assert env["DWDP_RANK"] == "0"
    assert env["DWDP_WORLD_SIZE"] == "1"


@pytest.mark.parametrize("role", [Role.CONTEXT, Role.GENERATION])
def test_the_api_key_reaches_every_worker_pod_as_a_mounted_secret(role: Role) -> None:
    """spec.server.apiKeySecretRef becomes a Secret volume (that key only, read-only, so the
    kubelet writes a rotated key into the pod) and DWDP_API_KEY_FILE naming the file: the pod
    spec (what kubectl describe shows) names the Secret, never the key; without it, neither."""
    ref = {"name": "serving-keys", "key": "openai"}
    spec = parse_deployment(doc(server={"apiKeySecretRef": ref}, generation={})).spec
    pod = builders.worker_pod(
        spec, OWNER, role=role, group_index=0, incarnation=0, pod_index=0, revision="r"
    )
    ctr = pod["spec"]["containers"][0]
    (entry,) = [e for e in ctr["env"] if e["name"].startswith("DWDP_API_KEY")]
    assert entry == {"name": "DWDP_API_KEY_FILE", "value": "/var/run/secrets/dwdp/api-key/key"}
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "api-key"]
    assert volume["secret"] == {
        "secretName": "serving-keys", "defaultMode": 0o400,
        "items": [{"key": "openai", "path": "key"}],
    }
    assert {"name": "api-key", "mountPath": "/var/run/secrets/dwdp/api-key",
            "readOnly": True} in ctr["volumeMounts"]
    plain = parse_deployment(doc(generation={})).spec
    pod = builders.worker_pod(
        plain, OWNER, role=role, group_index=0, incarnation=0, pod_index=0, revision="r"
    )
    assert not [e for e in pod["spec"]["containers"][0]["env"] if "API_KEY" in e["name"]]
    assert "api-key" not in {v["name"] for v in pod["spec"]["volumes"]}


@pytest.mark.parametrize(
    ("patch", "same"),
    [
        ({"context": {"replicas": 7, "ranksPerPod": 2, "dwdp": {"dwdpSize": 4}}}, True),
        ({"rollout": {"maxSurge": 2}}, True),
        ({"failurePolicy": {"backoffInitialSeconds": 1}}, True),
        ({"image": "worker:2"}, False),
        ({"env": [{"name": "A", "value": "1"}]}, False),
        ({"context": {"replicas": 2, "ranksPerPod": 4, "dwdp": {"dwdpSize": 4}}}, False),
        ({"context": {"replicas": 2, "ranksPerPod": 2, "dwdp": {"dwdpSize": 2}}}, False),
        ({"rendezvous": {"timeoutSeconds": 60}}, False),
        ({"server": {"port": 9000}}, False),
        ({"server": {"apiKeySecretRef": {"name": "keys"}}}, False),
        ({"nodeSelector": {"gpu": "h200"}}, False),
        ({"imagePullSecrets": [{"name": "regcred"}]}, False),
        ({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}}},
         False),
        ({"gpu": {"resourceName": "nvidia.com/mig-3g.71gb"}}, False),
        ({"gpu": {"resourceClaimTemplateName": "h200-x2"}}, False),
        ({"gpu": {"resourceName": "nvidia.com/gpu"}}, True),  # the default, spelled out
        ({"affinity": {}}, True),  # an empty affinity reaches no pod
    ],
)
def test_revision_covers_only_what_reaches_pods(patch: dict, same: bool) -> None:
    base = builders.revisions(SPEC)[Role.CONTEXT]
    changed = builders.revisions(parse_deployment(doc(**patch)).spec)[Role.CONTEXT]
    assert (base == changed) is same
    assert len(base) == 10


def test_revision_covers_the_worker_command() -> None:
    a = builders.revisions(SPEC)[Role.CONTEXT]
    b = builders.revisions(SPEC, command=("python", "-m", "x"))[Role.CONTEXT]
    assert a != b


def test_applied_hash_changes_with_content() -> None:
    a = builders.headless_service(SPEC, OWNER, Role.CONTEXT)
    b = builders.headless_service(SPEC, Owner("demo", "ns2", "uid-1"), Role.CONTEXT)
    assert builders.applied_hash(a) != builders.applied_hash(b)
    assert builders.applied_hash(a) == builders.applied_hash(
        builders.headless_service(SPEC, OWNER, Role.CONTEXT)
    )
    assert builders.applied_hash({"metadata": {}}) is None


def test_secret_value_is_added_base64_to_a_copy() -> None:
    planned = builders.rendezvous_secret(OWNER, role=Role.CONTEXT, group_index=0, incarnation=1)
    value = bytes(range(32))
    out = builders.with_secret_value(planned, value)
    assert base64.b64decode(out["data"]["secret"]) == value
    assert "data" not in planned  # the plan's object is left as planned
    assert out["metadata"] == planned["metadata"] and out["type"] == "Opaque"


def test_a_spec_override_replaces_only_its_field_and_user_env_wins() -> None:
    spec = parse_deployment(
        doc(
            securityContext={
                "readOnlyRootFilesystem": False,
                "capabilities": {"add": ["IPC_LOCK"]},
            },
            podSecurityContext={"runAsUser": 2000},
            env=[{"name": "XDG_CACHE_HOME", "value": "/models/cache"}],
        )
    ).spec
    pod = builders.worker_pod(
        spec, OWNER, role=Role.CONTEXT, group_index=0, incarnation=0, pod_index=0, revision="r"
    )
    ctr = pod["spec"]["containers"][0]
    assert ctr["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": False,
        "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]},
    }
    assert pod["spec"]["securityContext"]["runAsUser"] == 2000
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    caches = [e for e in ctr["env"] if e["name"] == "XDG_CACHE_HOME"]
    assert caches == [{"name": "XDG_CACHE_HOME", "value": "/models/cache"}]


def test_serving_policy_opens_the_serving_ports_of_the_widest_role_only() -> None:
    spec = parse_deployment(
        doc(
            context={"replicas": 1, "ranksPerPod": 4, "dwdp": {"dwdpSize": 4}},
            generation={"replicas": 1},
        )
    ).spec
    policy = without_hash(builders.serving_policy(spec, OWNER, operator_namespace="ops"))
    assert policy["metadata"]["name"] == "demo-serving"
    assert policy["spec"] == {
        "podSelector": {
            "matchLabels": {"dwdp.io/deployment": "demo", "app.kubernetes.io/component": "worker"}
        },
        "policyTypes": ["Ingress"],
        # no `from`: any source (servingFrom unset), so no operator peer is needed either
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8000, "endPort": 8003}]}],
    }


def test_kv_transfer_policy_admits_generation_pods_to_context_pods_on_every_port() -> None:
    policy = without_hash(builders.kv_transfer_policy(OWNER))
    worker = {"dwdp.io/deployment": "demo", "app.kubernetes.io/component": "worker"}
    assert policy["metadata"]["name"] == "demo-kv-transfer"
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {**worker, "dwdp.io/role": "context"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {
            **worker, "dwdp.io/role": "generation"}}}]}],
    }


def test_worker_pods_carry_llm_d_labels() -> None:
    """llm-d's role, serving and model labels (the served name made a label value)."""
    model = {"path": "/models/tiny", "servedName": "Qwen/Qwen3-30B-A3B:fp8"}
    spec = parse_deployment(doc(generation={"replicas": 1}, model=model)).spec
    for role, want in ((Role.CONTEXT, "prefill"), (Role.GENERATION, "decode")):
        pod = builders.worker_pod(spec, OWNER, role=role, group_index=0, incarnation=0,
                                  pod_index=0, revision="r1")
        labels = pod["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == want
        assert labels["llm-d.ai/inferenceServing"] == "true"
        assert labels["llm-d.ai/model"] == "Qwen-Qwen3-30B-A3B-fp8"


def test_label_values_are_valid_whatever_the_model_name() -> None:
    assert naming.label_value("a" * 80 + "/") == "a" * 63
    assert naming.label_value("--x y--") == "x-y"
    assert naming.label_value("///") == ""


def test_group_policy_admits_only_the_group_itself_on_every_port() -> None:
    policy = without_hash(builders.group_policy(OWNER, "demo-g1"))
    selector = {
        "matchLabels": {
            "dwdp.io/deployment": "demo",
            "app.kubernetes.io/component": "worker",
            "dwdp.io/group": "demo-g1",
        }
    }
    assert policy["metadata"]["name"] == "demo-g1-group"
    assert policy["spec"] == {
        "podSelector": selector,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": selector}]}],
    }


PLACEMENT = {
    "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": "nvidia.com/gpu.product", "operator": "In",
                         "values": ["NVIDIA-H200"]},
                        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["1"]},
                    ]}
                ]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": {"dwdp.io/deployment": "demo"}},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        },
    },
}


def _pod(spec, role: Role = Role.CONTEXT, **kwargs) -> dict:
    return builders.worker_pod(
        spec, OWNER, role=role, group_index=0, incarnation=0, pod_index=0, revision="r", **kwargs
    )


@pytest.mark.parametrize("role", [Role.CONTEXT, Role.GENERATION])
def test_pull_secrets_and_affinity_reach_every_worker_pod(role: Role) -> None:
    """Both roles' pods carry spec.imagePullSecrets and spec.affinity as written (camelCase,
    nothing added or dropped)."""
    spec = parse_deployment(doc(generation={}, **PLACEMENT)).spec
    pod_spec = _pod(spec, role)["spec"]
    assert pod_spec["imagePullSecrets"] == PLACEMENT["imagePullSecrets"]
    assert pod_spec["affinity"] == PLACEMENT["affinity"]


def test_a_spec_without_placement_fields_keeps_its_template_and_pods() -> None:
    """Unset, the new fields add no key to the revision's input (an operator upgrade rolls
    no group) and none to the pod; the device plugin's nvidia.com/gpu counts stay."""
    template = builders.role_template(SPEC, Role.CONTEXT)
    assert not {"imagePullSecrets", "affinity", "resourceClaims"} & set(template)
    pod_spec = _pod(SPEC)["spec"]
    assert not {"imagePullSecrets", "affinity", "resourceClaims"} & set(pod_spec)
    resources = pod_spec["containers"][0]["resources"]
    assert resources == {"limits": {c.GPU_RESOURCE: 2}, "requests": {c.GPU_RESOURCE: 2}}


def test_dra_gpus_are_claimed_from_the_template_and_no_device_plugin_gpu_is_requested() -> None:
    spec = parse_deployment(
        doc(gpu={"resourceClaimTemplateName": "h200-x2"}, resources={"limits": {"memory": "8Gi"}})
    ).spec
    pod_spec = _pod(spec)["spec"]
    assert pod_spec["resourceClaims"] == [
        {"name": c.GPU_CLAIM, "resourceClaimTemplateName": "h200-x2"}
    ]
    assert pod_spec["containers"][0]["resources"] == {
        "limits": {"memory": "8Gi"},
        "claims": [{"name": c.GPU_CLAIM}],
    }
    assert builders.role_template(spec, Role.CONTEXT)["resourceClaims"] == pod_spec[
        "resourceClaims"
    ]


def test_dra_gpus_and_the_compute_domain_channel_are_both_claimed() -> None:
    spec = parse_deployment(doc(gpu={"resourceClaimTemplateName": "h200-x2"})).spec
    pod_spec = _pod(spec, channel_template="demo-g0-i0-channel")["spec"]
    assert pod_spec["resourceClaims"] == [
        {"name": c.GPU_CLAIM, "resourceClaimTemplateName": "h200-x2"},
        {"name": c.CHANNEL_CLAIM, "resourceClaimTemplateName": "demo-g0-i0-channel"},
    ]
    assert pod_spec["containers"][0]["resources"] == {
        "claims": [{"name": c.GPU_CLAIM}, {"name": c.CHANNEL_CLAIM}]
    }


DRA_TWO_TEMPLATES = {
    "gpu": {
        "resourceClaimTemplateName": "h200-x2",
        "generationResourceClaimTemplateName": "h200-x1",
    },
    "generation": {"replicas": 2},
}


@pytest.mark.parametrize(
    ("role", "template"), [(Role.CONTEXT, "h200-x2"), (Role.GENERATION, "h200-x1")]
)
def test_each_role_claims_its_own_dra_template(role: Role, template: str) -> None:
    """Context pods (2 GPUs) claim gpu.resourceClaimTemplateName, generation pods (1 GPU)
    gpu.generationResourceClaimTemplateName, each as the pod's and its container's 'gpus'
    claim, with no device-plugin GPU."""
    spec = parse_deployment(doc(**DRA_TWO_TEMPLATES)).spec
    claims = [{"name": c.GPU_CLAIM, "resourceClaimTemplateName": template}]
    assert builders.role_template(spec, role)["resourceClaims"] == claims
    pod_spec = _pod(spec, role)["spec"]
    assert pod_spec["resourceClaims"] == claims
    assert pod_spec["containers"][0]["resources"] == {"claims": [{"name": c.GPU_CLAIM}]}


def test_generation_pods_claim_the_context_template_without_their_own() -> None:
    spec = parse_deployment(
        doc(
            context={"replicas": 2, "ranksPerPod": 1, "dwdp": {"dwdpSize": 4}},
            gpu={"resourceClaimTemplateName": "h200-x1"},
            generation={"replicas": 1},
        )
    ).spec
    claims = [{"name": c.GPU_CLAIM, "resourceClaimTemplateName": "h200-x1"}]
    for role in (Role.CONTEXT, Role.GENERATION):
        assert _pod(spec, role)["spec"]["resourceClaims"] == claims


def test_the_generation_template_is_in_the_generation_revision_only() -> None:
    """Setting gpu.generationResourceClaimTemplateName rolls the generation servers (their
    pods claim another template) and no context group; its absence adds nothing."""
    base = {
        "context": {"replicas": 2, "ranksPerPod": 1, "dwdp": {"dwdpSize": 4}},
        "gpu": {"resourceClaimTemplateName": "h200-x1"},
        "generation": {"replicas": 1},
    }
    own = {**base, "gpu": {**base["gpu"], "generationResourceClaimTemplateName": "h200-x1-gen"}}
    before = builders.revisions(parse_deployment(doc(**base)).spec)
    after = builders.revisions(parse_deployment(doc(**own)).spec)
    assert before[Role.CONTEXT] == after[Role.CONTEXT]
    assert before[Role.GENERATION] != after[Role.GENERATION]


def test_the_device_plugin_resource_can_be_renamed() -> None:
    """gpu.resourceName replaces nvidia.com/gpu (one per rank), also over a count written in
    spec.resources."""
    spec = parse_deployment(
        doc(
            gpu={"resourceName": "nvidia.com/mig-3g.71gb"},
            resources={"limits": {"nvidia.com/mig-3g.71gb": 8}},
        )
    ).spec
    resources = _pod(spec)["spec"]["containers"][0]["resources"]
    assert resources == {
        "limits": {"nvidia.com/mig-3g.71gb": 2},
        "requests": {"nvidia.com/mig-3g.71gb": 2},
    }


# ----------------------------------------------------------------------------- memory limit

MEMORY_LIMIT_ENV = {
    "name": "DWDP_MEMORY_LIMIT",
    "valueFrom": {
        "resourceFieldRef": {
            "containerName": "worker", "resource": "limits.memory", "divisor": "1",
        }
    },
}


def _memory_limit_env(container: dict) -> list[dict]:
    return [e for e in container["env"] if e["name"] == "DWDP_MEMORY_LIMIT"]


@pytest.mark.parametrize("role", [Role.CONTEXT, Role.GENERATION])
def test_a_memory_limit_reaches_every_worker_container_by_the_downward_api(role: Role) -> None:
    """With resources.limits.memory, the worker container of both roles carries the limit as
    DWDP_MEMORY_LIMIT, a resourceFieldRef of its own container in bytes (the kubelet
    resolves it), and the revision's input has it."""
    resources = {"requests": {"memory": "3Gi"}, "limits": {"memory": "6Gi"}}
    spec = parse_deployment(doc(generation={}, resources=resources)).spec
    (ctr,) = _pod(spec, role)["spec"]["containers"]
    assert _memory_limit_env(ctr) == [MEMORY_LIMIT_ENV]
    assert MEMORY_LIMIT_ENV["valueFrom"]["resourceFieldRef"]["containerName"] == ctr["name"]
    assert ctr["resources"]["limits"]["memory"] == "6Gi"
    assert ctr["resources"]["requests"]["memory"] == "3Gi"
    assert MEMORY_LIMIT_ENV in builders.role_template(spec, role)["env"]


@pytest.mark.parametrize(
    "resources", [None, {"requests": {"memory": "3Gi"}}, {"limits": {"cpu": "2"}}]
)
def test_only_a_memory_limit_adds_the_env_so_other_specs_keep_their_revision(
    resources: dict | None,
) -> None:
    """Without a memory limit (no resources, a memory request only, other limits) the
    container has no DWDP_MEMORY_LIMIT and the revision's input is that of a spec without
    resources but for the resources themselves (an operator upgrade rolls no such group);
    adding the limit adds the env var, before the defaults and spec.env."""
    plain = builders.role_template(SPEC, Role.CONTEXT)
    spec = parse_deployment(doc(**({} if resources is None else {"resources": resources}))).spec
    template = builders.role_template(spec, Role.CONTEXT)
    assert {**template, "resources": None} == {**plain, "resources": None}
    assert not _memory_limit_env(_pod(spec)["spec"]["containers"][0])
    limits = {**((resources or {}).get("limits") or {}), "memory": "6Gi"}
    limited = parse_deployment(doc(resources={**(resources or {}), "limits": limits})).spec
    assert builders.role_template(limited, Role.CONTEXT)["env"] == [MEMORY_LIMIT_ENV, *plain["env"]]


# ----------------------------------------------------------------------------- vLLM generation


def vllm_doc(**vllm) -> dict:
    """One context group of 4 ranks on the cpu backend, one vLLM generation server."""
    return doc(
        model={"path": "/models/tiny", "servedName": "tiny-moe", "dtype": "bfloat16",
               "hostPath": "/srv/models", "mountPath": "/models"},
        context={"replicas": 1, "ranksPerPod": 4, "handleType": "shm", "dwdp": {"dwdpSize": 4}},
        generation={"replicas": 1, "vllm": {"image": "vllm-cpu:0.32.0", **vllm}},
        server={"apiKeySecretRef": {"name": "serving-keys", "key": "openai"}},
        env=[{"name": "OMP_NUM_THREADS", "value": "2"}, {"name": "UCX_TLS", "value": "tcp,self"}],
        resources={"requests": {"memory": "16Gi"}},
    )


def _vllm_pod(spec, **kw) -> dict:
    return builders.worker_pod(spec, OWNER, role=Role.GENERATION, group_index=2, incarnation=1,
                               pod_index=0, revision="v1", **kw)


def test_a_vllm_generation_pod_runs_vllms_server_with_what_the_context_ranks_serve() -> None:
    spec = parse_deployment(vllm_doc(args=["--max-model-len", "512"])).spec
    pod = without_hash(_vllm_pod(spec, pod_group="demo-gen2-i1"))
    dwdp = without_hash(builders.worker_pod(
        parse_deployment(doc(generation={"replicas": 1}, model=vllm_doc()["spec"]["model"],
                             env=vllm_doc()["spec"]["env"])).spec,
        OWNER, role=Role.GENERATION, group_index=2, incarnation=1, pod_index=0, revision="v1"))
    assert pod["metadata"]["labels"] == {**dwdp["metadata"]["labels"], "dwdp.io/engine": "vllm"}
    assert pod["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    (ctr,) = pod["spec"]["containers"]
    assert ctr["name"] == "vllm" and ctr["image"] == "vllm-cpu:0.32.0"
    assert ctr["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert ctr["args"] == [
        "--model", "/models/tiny",
        "--served-model-name", "tiny-moe",
        "--host", "$(POD_IP)",
        "--port", "8000",
        "--dtype", "bfloat16",
        "--kv-transfer-config",
        '{"kv_buffer_device":"cpu","kv_connector":"NixlConnector","kv_role":"kv_consumer"}',
        "--max-model-len", "512",
    ]
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    assert ctr["env"] == [
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.cache/triton"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": "2"},
        {"name": "UCX_TLS", "value": "tcp,self"},  # spec.env wins over the default
        {"name": "POD_IP", "valueFrom": pod_ip},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": pod_ip},
        {"name": "VLLM_API_KEY",
         "valueFrom": {"secretKeyRef": {"name": "serving-keys", "key": "openai"}}},
    ]
    assert ctr["readinessProbe"] == {
        "httpGet": {"path": "/health", "port": 8000},
        "periodSeconds": 2,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }
    assert ctr["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert ctr["resources"] == {"requests": {"memory": "16Gi"}}  # spec.resources, no GPU
    (dctr,) = dwdp["spec"]["containers"]
    assert ctr["securityContext"] == dctr["securityContext"]
    assert ctr["volumeMounts"] == [m for m in dctr["volumeMounts"] if m["name"] in
                                   ("model", "tmp", "dshm")]
    assert ctr["volumeMounts"][0] == {"name": "model", "mountPath": "/models", "readOnly": True}
    keep = ("hostname", "subdomain", "restartPolicy", "terminationGracePeriodSeconds",
            "readinessGates", "securityContext")
    assert {k: pod["spec"][k] for k in keep} == {k: dwdp["spec"][k] for k in keep}
    assert pod["spec"]["volumes"] == [v for v in dwdp["spec"]["volumes"] if v["name"] in
                                      ("model", "tmp", "dshm")]
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "demo-gen2-i1"}
    assert "resourceClaims" not in pod["spec"]


def test_vllm_resources_and_hybrid_kv_cache_manager_come_from_generation_vllm() -> None:
    spec = parse_deployment(vllm_doc(hybridKvCacheManager=False,
                                     resources={"limits": {"cpu": 8}})).spec
    (ctr,) = _vllm_pod(spec)["spec"]["containers"]
    assert ctr["resources"] == {"limits": {"cpu": 8}}
    assert ctr["args"][-1] == "--disable-hybrid-kv-cache-manager"
    context = yaml.safe_load(builders.launch_config_text(spec, Role.CONTEXT))
    assert context["kvTransfer"]["vllm"]["hybridKvCacheManager"] is False
    assert context["kvTransfer"]["vllm"]["model"] == "/models/tiny"  # vLLM's --model


@pytest.mark.parametrize("staging", [8192, None])
def test_the_context_launch_config_carries_staging_tokens(staging: int | None) -> None:
    """``generation.vllm.stagingTokens`` reaches the context ranks as
    ``kvTransfer.vllm.stagingTokens``; unset, the launch config leaves it to the rank's
    default (and a spec without it keeps the revision it had)."""
    vllm = {} if staging is None else {"stagingTokens": staging}
    spec = parse_deployment(vllm_doc(**vllm)).spec
    text = builders.launch_config_text(spec, Role.CONTEXT)
    assert yaml.safe_load(text)["kvTransfer"]["vllm"].get("stagingTokens") == staging
    cfg = LaunchConfig.model_validate(yaml.safe_load(text))
    assert cfg.kv_transfer.vllm is not None
    assert cfg.kv_transfer.vllm.staging_tokens == staging


def test_without_an_api_key_secret_vllm_gets_no_key() -> None:
    document = vllm_doc()
    del document["spec"]["server"]
    (ctr,) = _vllm_pod(parse_deployment(document).spec)["spec"]["containers"]
    assert "VLLM_API_KEY" not in {e["name"] for e in ctr["env"]}


def test_a_vllm_tier_reads_no_launch_config_and_meets_no_rendezvous() -> None:
    spec = parse_deployment(vllm_doc()).spec
    assert not builders.reads_launch_config(spec, Role.GENERATION)
    assert builders.reads_launch_config(spec, Role.CONTEXT)
    assert not builders.rendezvous_secret_needed(spec, Role.GENERATION)
    with pytest.raises(ValueError, match="vLLM's: they read no launch config"):
        builders.launch_config_text(spec, Role.GENERATION)


@pytest.mark.parametrize(
    ("vllm", "rolls"),
    [
        ({"args": ["--max-num-seqs", "4"]}, {Role.GENERATION}),
        ({"image": "vllm-cpu:0.32.0-b"}, {Role.GENERATION}),
        ({"resources": {"limits": {"cpu": 4}}}, {Role.GENERATION}),
        # the vLLM servers learn the context ranks' port from each prefill's answer
        ({"sideChannelPort": 6000}, {Role.CONTEXT}),
        ({"hybridKvCacheManager": False}, {Role.CONTEXT, Role.GENERATION}),
        ({"stagingTokens": 8192}, {Role.CONTEXT}),  # the context ranks' buffer only
    ],
)
def test_a_vllm_setting_rolls_the_tiers_that_read_it(vllm: dict, rolls: set[Role]) -> None:
    base = builders.revisions(parse_deployment(vllm_doc()).spec)
    changed = builders.revisions(parse_deployment(vllm_doc(**vllm)).spec)
    assert {role for role in base if changed[role] != base[role]} == rolls


def test_the_network_policies_bound_the_vllm_side_channels() -> None:
    """vLLM's side channel authenticates no peer: the context ranks' channels are reached by
    the deployment's generation pods only (the KV-transfer policy's source selects the vLLM
    pods), and the vLLM pods' own channels by nobody (the serving policy selects them and
    admits the serving ports only)."""
    spec = parse_deployment(vllm_doc()).spec
    labels = _vllm_pod(spec)["metadata"]["labels"]
    kv = builders.kv_transfer_policy(OWNER)["spec"]
    (source,) = kv["ingress"][0]["from"]
    assert source["podSelector"]["matchLabels"].items() <= labels.items()
    assert kv["podSelector"]["matchLabels"][c.LABEL_ROLE] == "context"
    serving = builders.serving_policy(spec, OWNER)["spec"]
    assert serving["podSelector"]["matchLabels"].items() <= labels.items()
    assert serving["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000, "endPort": 8003}]}]


def test_vllm_servers_and_the_router_get_no_memory_limit_env() -> None:
    """DWDP_MEMORY_LIMIT is the dwdp ranks': with memory limits on every pod, the context
    ranks carry it; the vLLM servers (spec.resources reaches them too) and the router do not."""
    document = vllm_doc()
    document["spec"]["resources"] = {"limits": {"memory": "6Gi"}}
    document["spec"]["router"] = {"resources": {"limits": {"memory": "1Gi"}}}
    spec = parse_deployment(document).spec
    assert _memory_limit_env(_pod(spec)["spec"]["containers"][0]) == [MEMORY_LIMIT_ENV]
    (vllm_ctr,) = _vllm_pod(spec)["spec"]["containers"]
    assert vllm_ctr["resources"] == {"limits": {"memory": "6Gi"}}
    assert not _memory_limit_env(vllm_ctr)
    assert MEMORY_LIMIT_ENV not in builders.vllm_template(spec)["env"]
    servers = router.RouterServers(
        prefill=("http://10.0.0.1:8000",), decode=("http://10.0.0.2:8000",)
    )
    deployment = router.router_deployment(spec, OWNER, servers)
    (router_ctr,) = deployment["spec"]["template"]["spec"]["containers"]
    assert router_ctr["resources"] == {"limits": {"memory": "1Gi"}}
    assert not _memory_limit_env(router_ctr)
