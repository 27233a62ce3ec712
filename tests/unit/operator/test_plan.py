"""``plan(body, observed)`` against a tiny in-memory cluster: what it creates, opens,
deletes and writes, and that a deployment at rest plans no write at all."""

from __future__ import annotations

import copy

import pytest
import yaml

from dwdp.api.contract import RENDEZVOUS_SECRET_DIR, RENDEZVOUS_SECRET_PATH, Env
from dwdp.operator import constants as c
from dwdp.operator.constants import Reason
from dwdp.operator.observe import Observed, rank_report_from_json
from dwdp.operator.plan import Delete, GateChange, PlanOptions, plan

OPTIONS = PlanOptions(compute_domains=False)  # fabric is nominal on CPU test clusters


def body(replicas: int = 2, **spec_patch) -> dict:
    spec = {
        "model": {"path": "/models/tiny"},
        "image": "worker:1",
        "context": {"replicas": replicas, "ranksPerPod": 2, "dwdp": {"dwdpSize": 4}},
    }
    spec.update(spec_patch)
    return {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1", "generation": 1},
        "spec": spec,
    }


class Sim:
    """Applies plans to dicts: pods start Running (scheduled, addressed), ranks answer
    ``/dwdp/status`` with ``rank_phase`` (None: no answer yet), a vLLM server's container is
    ready as ``vllm_ready`` says (it answers no ``/dwdp/status``), deletes remove at once."""

    def __init__(self, body: dict) -> None:
        self.body = body
        self.objects: dict[tuple[str, str], dict] = {}
        self.rank_phase: str | None = "committed"
        self.vllm_ready = False
        self.start_ids: dict[str, str] = {}
        """Start id each pod's ranks answer with (none: the field is left out)."""
        self.next_ip = 1

    def observed(self) -> Observed:
        pods = [o for (k, _), o in self.objects.items() if k == "Pod"]
        others = [o for (k, _), o in self.objects.items() if k != "Pod"]
        ranks = {}
        for p in pods:
            labels = p["metadata"]["labels"]
            if c.LABEL_ROLE not in labels or c.LABEL_ENGINE in labels:  # router or vLLM pod
                continue
            first = int(
                next(
                    e["value"]
                    for e in p["spec"]["containers"][0]["env"]
                    if e["name"] == "DWDP_RANK"
                )
            )
            ranks[p["metadata"]["name"]] = tuple(
                rank_report_from_json(
                    {
                        "phase": self.rank_phase,
                        "rank": first + k,
                        "revision": labels[c.LABEL_REVISION],
                        "incarnation": int(labels[c.LABEL_INCARNATION]),
                        "layout_digest": "digest",
                        **(
                            {"start_id": self.start_ids[p["metadata"]["name"]]}
                            if p["metadata"]["name"] in self.start_ids
                            else {}
                        ),
                    }
                )
                for k in range(len(p["spec"]["containers"][0]["ports"]) - (first == 0))
            )
        return Observed.from_objects(pods=pods, children=others, ranks=ranks)

    def step(self, now: str = "T"):
        p = plan(self.body, self.observed(), options=OPTIONS, now=now)
        for obj in (*p.apply, *p.create, *p.slices):
            self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        for pod in p.create_pods:
            pod = copy.deepcopy(pod)
            pod["spec"]["nodeName"] = "node-0"
            pod["status"] = {
                "phase": "Running",
                "podIP": f"127.0.0.{self.next_ip}",
                "containerStatuses": [{"state": {"running": {}}}],
                "conditions": [],
            }
            if c.LABEL_ENGINE in pod["metadata"]["labels"]:
                pod["status"]["containerStatuses"][0]["ready"] = self.vllm_ready
            self.next_ip += 1
            self.objects[("Pod", pod["metadata"]["name"])] = pod
        for gate in p.gates:
            conds = self.objects[("Pod", gate.pod)]["status"]["conditions"]
            conds[:] = [x for x in conds if x["type"] != c.GATE_CONDITION]
            conds.append(
                {
                    "type": c.GATE_CONDITION,
                    "status": "True" if gate.ready else "False",
                    "reason": gate.reason or "x",
                }
            )
        for d in p.delete:
            self.objects.pop((d.kind, d.name), None)
        if p.status is not None:
            self.body["status"] = copy.deepcopy(p.status)
        return p

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, n) in self.objects if k == kind)


def test_first_plan_creates_every_child_of_two_groups() -> None:
    p = plan(body(), Observed(), options=OPTIONS, now="T0")
    assert [(o["kind"], o["metadata"]["name"]) for o in p.apply] == [
        ("ConfigMap", f"demo-context-{p.status['revision']}"),
        ("Service", "demo-context"),
        ("Service", "demo"),
        ("NetworkPolicy", "demo-serving"),
        ("NetworkPolicy", "demo-g0-group"),
        ("NetworkPolicy", "demo-g1-group"),
    ]
    assert [o["metadata"]["name"] for o in p.create_pods] == [
        "demo-g0-i0-p0",
        "demo-g0-i0-p1",
        "demo-g1-i0-p0",
        "demo-g1-i0-p1",
    ]
    assert [o["metadata"]["name"] for o in p.slices] == ["demo-rank-0", "demo-rank-1"]
    assert all(s["endpoints"] == [] for s in p.slices)
    assert p.delete == () and p.gates == ()
    assert [e.reason for e in p.events] == [Reason.CREATED_GROUP, Reason.CREATED_GROUP]
    assert p.status["phase"] == "Progressing"
    assert p.status["replicas"] == 2 and p.status["readyGroups"] == 0
    assert p.status["selector"] == "dwdp.io/deployment=demo,dwdp.io/role=context"
    assert p.status["endpoint"] == "http://demo.ns1.svc:8000"
    assert [g["phase"] for g in p.status["groups"]] == ["Pending", "Pending"]
    assert p.requeue_after_s < 10


def test_commit_opens_the_gates_then_the_slices_then_rest() -> None:
    sim = Sim(body())
    sim.rank_phase = None  # setting up: a worker answers only once committed
    sim.step("T0")
    p = sim.step("T1")
    assert p.gates == () and p.create_pods == ()
    assert [g["phase"] for g in p.status["groups"]] == ["Rendezvous", "Rendezvous"]
    sim.rank_phase = "committed"
    p = sim.step("T2")
    assert sorted(p.gates, key=lambda g: g.pod) == [
        GateChange("demo-g0-i0-p0", True, "demo-g0 committed"),
        GateChange("demo-g0-i0-p1", True, "demo-g0 committed"),
        GateChange("demo-g1-i0-p0", True, "demo-g1 committed"),
        GateChange("demo-g1-i0-p1", True, "demo-g1 committed"),
    ]
    assert [len(s["endpoints"]) for s in p.slices] == [4, 4]
    assert [e.reason for e in p.events] == [Reason.GATE_OPENED, Reason.GATE_OPENED]
    assert p.status["phase"] == "Ready"
    assert p.status["readyGroups"] == 2
    assert [g["layoutDigest"] for g in p.status["groups"]] == ["digest", "digest"]
    ready = p.status["conditions"][0]
    assert (ready["status"], ready["lastTransitionTime"]) == ("True", "T2")
    # At rest: nothing to write, and the loop may sleep long.
    rest = sim.step("T3")
    assert rest.writes == 0
    assert rest.status is None
    assert rest.requeue_after_s >= 30


def test_scale_adds_and_removes_whole_groups_only() -> None:
    sim = Sim(body(replicas=2))
    sim.step()
    sim.step()
    sim.body["spec"]["context"]["replicas"] = 3
    p = sim.step()
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g2-i0-p0", "demo-g2-i0-p1"]
    assert p.delete == ()
    sim.step()
    sim.body["spec"]["context"]["replicas"] = 1
    p = sim.step()
    # Drain, step 1: the gates close (reason GroupDraining) and the endpoints leave the
    # slices; no pod is deleted yet.
    assert p.create_pods == () and p.delete == ()
    drained = ["demo-g1-i0-p0", "demo-g1-i0-p1", "demo-g2-i0-p0", "demo-g2-i0-p1"]
    assert sorted(g.pod for g in p.gates) == drained
    assert {(g.ready, g.reason) for g in p.gates} == {(False, c.GATE_REASON_DRAINING)}
    assert [e.reason for e in p.events] == [Reason.DRAINING_GROUP, Reason.DRAINING_GROUP]
    assert [len(s["endpoints"]) for s in p.slices] == [2, 2]
    assert [g["phase"] for g in p.status["groups"]] == ["Serving", "Draining", "Draining"]
    # Step 2: the pods go, with their grace period.
    p = sim.step()
    pod_deletes = [d for d in p.delete if d.kind == "Pod"]
    assert sorted(pod_deletes, key=lambda d: d.name) == [Delete("Pod", n, 30) for n in drained]
    # ... and their incarnations' rendezvous Secrets in the same step.
    assert [d for d in p.delete if d.kind != "Pod"] == [
        Delete("Secret", "demo-g1-i0-rdzv"),
        Delete("Secret", "demo-g2-i0-rdzv"),
    ]
    assert [e.reason for e in p.events] == [Reason.DELETED_GROUP, Reason.DELETED_GROUP]
    p = sim.step()
    assert sim.names("Pod") == ["demo-g0-i0-p0", "demo-g0-i0-p1"]
    assert p.status["replicas"] == 1 and p.status["phase"] == "Ready"
    assert sim.step().writes == 0


def test_invalid_spec_touches_no_child() -> None:
    sim = Sim(body())
    sim.step()
    before = copy.deepcopy(sim.objects)
    sim.body["spec"]["context"]["ranksPerPod"] = 3
    p = sim.step("T9")
    assert (p.apply, p.create_pods, p.gates, p.slices, p.delete) == ((), (), (), (), ())
    assert sim.objects == before
    conds = {x["type"]: x for x in p.status["conditions"]}
    assert conds["Invalid"]["status"] == "True"
    assert "ranksPerPod" in conds["Invalid"]["message"]
    assert conds["Ready"]["reason"] == "InvalidSpec"
    assert p.status["phase"] == "Failed"
    assert [e.reason for e in p.events] == [Reason.INVALID_SPEC]
    again = sim.step("T10")
    assert again.writes == 0  # one Event per distinct problem, no status churn


def test_invalid_from_the_start_creates_nothing() -> None:
    bad = body()
    bad["spec"]["context"]["dwdp"]["dwdpSize"] = 0
    p = plan(bad, Observed(), options=OPTIONS, now="T")
    assert (p.apply, p.create_pods, p.slices) == ((), (), ())
    assert "dwdpSize" in p.status["conditions"][1]["message"]


def test_a_failed_pod_fails_its_group_only_and_closes_its_gate() -> None:
    sim = Sim(body())
    sim.step()
    sim.step()
    failed = sim.objects[("Pod", "demo-g1-i0-p1")]
    failed["status"]["phase"] = "Failed"
    failed["status"]["containerStatuses"] = [
        {"state": {"terminated": {"exitCode": 1, "message": "P3: rank 3 failed"}}}
    ]
    p = sim.step()
    assert p.gates == (GateChange("demo-g1-i0-p0", False, "demo-g1 is Failed"),)
    assert [len(s["endpoints"]) for s in p.slices] == [2, 2]
    groups = {g["name"]: g for g in p.status["groups"]}
    assert groups["demo-g0"]["phase"] == "Serving"
    assert groups["demo-g1"]["phase"] == "Restarting"
    assert groups["demo-g1"]["lastFailure"]["phase"] == "P3"
    assert groups["demo-g1"]["lastFailure"]["reason"] == "SetupFailed"
    assert groups["demo-g1"]["restarts"] == 1
    # Fail together: the whole incarnation goes, the other group is untouched.
    pod_deletes = sorted(d.name for d in p.delete if d.kind == "Pod")
    assert pod_deletes == ["demo-g1-i0-p0", "demo-g1-i0-p1"]
    assert [d for d in p.delete if d.kind != "Pod"] == [Delete("Secret", "demo-g1-i0-rdzv")]
    assert p.status["phase"] == "Degraded"
    degraded = p.status["conditions"][2]
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupFailed")


def test_old_incarnation_pods_are_deleted_and_next_incarnation_follows_the_record() -> None:
    sim = Sim(body(replicas=1))
    sim.step()
    sim.step()
    # Someone removed every pod of the group: a failure; the next incarnation is 1.
    for name in sim.names("Pod"):
        del sim.objects[("Pod", name)]
    p = sim.step("2026-01-01T00:00:00Z")
    assert p.create_pods == ()
    assert p.status["groups"][0]["phase"] == "Restarting"
    assert p.status["groups"][0]["lastFailure"]["reason"] == "PodMissing"
    assert p.requeue_after_s <= 10  # at most the first backoff (default 10 s)
    assert sim.step("2026-01-01T00:00:09Z").create_pods == ()
    p = sim.step("2026-01-01T00:00:10Z")
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g0-i1-p0", "demo-g0-i1-p1"]
    env = {e["name"]: e.get("value") for e in p.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env["DWDP_INCARNATION"] == "1"
    assert env["DWDP_RENDEZVOUS"] == "demo-g0-i1-p0.demo-context.ns1.svc:29500"
    # A stray pod of incarnation 0 next to incarnation 1 is deleted.
    stray = copy.deepcopy(sim.objects[("Pod", "demo-g0-i1-p0")])
    stray["metadata"]["name"] = "demo-g0-i0-p0"
    stray["metadata"]["labels"][c.LABEL_INCARNATION] = "0"
    sim.objects[("Pod", "demo-g0-i0-p0")] = stray
    assert Delete("Pod", "demo-g0-i0-p0") in sim.step().delete


def _one_pod_groups(replicas: int = 2, **spec_patch) -> dict:
    """The demo's shape: groups of 4 ranks in one pod each."""
    context = {"replicas": replicas, "ranksPerPod": 4, "dwdp": {"dwdpSize": 4}}
    return body(context=context, **spec_patch)


def _delete_gracefully(sim: Sim, name: str, when: str) -> None:
    """``kubectl delete pod``: the pod stays, terminating, through its grace period."""
    sim.objects[("Pod", name)]["metadata"]["deletionTimestamp"] = when


def test_a_pod_deleted_by_someone_fails_its_group_which_restarts_under_its_index() -> None:
    sim = Sim(_one_pod_groups())
    sim.step()
    sim.step()
    assert sim.body["status"]["readyGroups"] == 2
    _delete_gracefully(sim, "demo-g1-i0-p0", "2026-01-01T00:00:00Z")
    p = sim.step("2026-01-01T00:00:01Z")
    # The same group failed (PodMissing), counted once; no new group index instead.
    assert p.create_pods == ()
    failed = [e for e in p.events if e.reason is Reason.GROUP_FAILED]
    assert len(failed) == 1 and "demo-g1 incarnation 0" in failed[0].message
    assert "PodMissing" in failed[0].message
    assert not any(e.reason is Reason.CREATED_GROUP for e in p.events)
    groups = {g["name"]: g for g in p.status["groups"]}
    assert sorted(groups) == ["demo-g0", "demo-g1"]
    assert groups["demo-g1"]["phase"] == "Restarting"
    assert groups["demo-g1"]["restarts"] == 1
    assert groups["demo-g1"]["lastFailure"]["reason"] == "PodMissing"
    assert "demo-g1-i0-p0" in groups["demo-g1"]["lastFailure"]["message"]
    assert p.status["nextGroupIndex"] == 2
    assert Delete("Secret", "demo-g1-i0-rdzv") in p.delete
    # Still terminating: waits, no second count, no pod.
    p = sim.step("2026-01-01T00:00:05Z")
    assert p.create_pods == () and not p.events
    assert p.status is None or p.status["groups"][1]["restarts"] == 1
    # Gone, backoff over: incarnation 1 of the same group.
    del sim.objects[("Pod", "demo-g1-i0-p0")]
    p = sim.step("2026-01-01T00:00:11Z")
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g1-i1-p0"]
    assert [e.reason for e in p.events] == [Reason.CREATED_GROUP, Reason.RESTARTED_GROUP]
    assert p.status["groups"][1]["incarnation"] == 1
    assert p.status["groups"][1]["restarts"] == 1


def test_deleting_pods_does_not_get_round_the_restart_limit() -> None:
    sim = Sim(_one_pod_groups(replicas=1, failurePolicy={"restartLimit": 0}))
    sim.step()
    sim.step()
    _delete_gracefully(sim, "demo-g0-i0-p0", "2026-01-01T00:00:00Z")
    p = sim.step("2026-01-01T00:00:01Z")
    assert "restart limit 0 reached" in next(
        e.message for e in p.events if e.reason is Reason.GROUP_FAILED
    )
    del sim.objects[("Pod", "demo-g0-i0-p0")]
    for t in ("2026-01-01T00:00:20Z", "2026-01-01T00:10:00Z"):
        p = sim.step(t)
        assert p.create_pods == ()
    (group,) = sim.body["status"]["groups"]
    assert (group["name"], group["phase"], group["restarts"]) == ("demo-g0", "Failed", 1)


def test_a_drained_group_terminating_is_no_failure() -> None:
    sim = Sim(_one_pod_groups(replicas=2))
    sim.step()
    sim.step()
    sim.body["spec"]["context"]["replicas"] = 1
    sim.step()  # gate closed (GroupDraining)
    pod = copy.deepcopy(sim.objects[("Pod", "demo-g1-i0-p0")])
    sim.step()  # deleted; in a cluster it terminates through its grace period
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    sim.objects[("Pod", "demo-g1-i0-p0")] = pod
    p = sim.step("2026-01-01T00:00:01Z")
    assert not any(e.reason is Reason.GROUP_FAILED for e in p.events)
    assert p.create_pods == ()


def test_spec_change_applies_a_new_config_and_keeps_the_old_for_live_groups() -> None:
    sim = Sim(body(replicas=1))
    sim.step()
    sim.step()
    old_rev = sim.body["status"]["revision"]
    sim.body["spec"]["image"] = "worker:2"
    p = sim.step()
    new_rev = p.status["revision"]
    assert new_rev != old_rev
    # the new revision's config, and the NetworkPolicy of the surge group it starts
    assert [o["metadata"]["name"] for o in p.apply] == [f"demo-context-{new_rev}", "demo-g1-group"]
    # Live groups are never patched: a surge group starts at the new revision.
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g1-i0-p0", "demo-g1-i0-p1"]
    assert p.delete == ()
    assert sim.names("ConfigMap") == sorted([f"demo-context-{old_rev}", f"demo-context-{new_rev}"])
    assert [g["revision"] for g in p.status["groups"]] == [old_rev, new_rev]


def test_changed_child_is_reapplied_and_unknown_child_deleted() -> None:
    sim = Sim(body(replicas=1))
    sim.step()
    sim.objects[("Service", "demo")]["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH] = "x"
    sim.objects[("ConfigMap", "demo-context-stale")] = {
        "kind": "ConfigMap",
        "metadata": {"name": "demo-context-stale"},
    }
    p = sim.step()
    assert [o["metadata"]["name"] for o in p.apply] == ["demo"]
    assert Delete("ConfigMap", "demo-context-stale") in p.delete


def test_generation_servers_are_groups_of_their_own() -> None:
    sim = Sim(body(replicas=1, generation={"replicas": 2}))
    p = sim.step()
    names = [o["metadata"]["name"] for o in p.create_pods]
    assert names == ["demo-g0-i0-p0", "demo-g0-i0-p1", "demo-gen0-i0-p0", "demo-gen1-i0-p0"]
    assert ("Service", "demo-generation") in {(o["kind"], o["metadata"]["name"]) for o in p.apply}
    p = sim.step()
    assert p.status["generation"] == {"replicas": 2, "readyReplicas": 2, "nextIndex": 2}
    assert p.status["phase"] == "Ready"


@pytest.mark.parametrize("replicas", [0, 1])
def test_zero_or_one_group(replicas: int) -> None:
    sim = Sim(body(replicas=replicas))
    sim.step()
    sim.step()
    assert sim.body["status"]["readyGroups"] == replicas
    assert sim.body["status"]["phase"] == "Ready"


def test_apiserver_defaults_in_the_read_status_are_not_a_change() -> None:
    sim = Sim(body())
    sim.step()
    sim.step()
    status = sim.body["status"]
    for group in status["groups"]:
        group["extraDefault"] = 0  # a field the CRD defaults and the plan does not set
    status["kopf"] = {"progress": {}}
    assert sim.step().writes == 0


def test_endpoint_slices_of_the_slice_controller_are_not_ours() -> None:
    sim = Sim(body(replicas=1))
    sim.step()
    theirs = {
        "kind": "EndpointSlice",
        "metadata": {
            "name": "demo-context-x7k2p",
            "labels": {
                c.LABEL_DEPLOYMENT: "demo",
                c.LABEL_SLICE_MANAGED_BY: "endpointslice-controller.k8s.io",
            },
        },
    }
    sim.objects[("EndpointSlice", "demo-context-x7k2p")] = theirs
    p = sim.step()
    assert all(d.kind != "EndpointSlice" for d in p.delete)
    assert sim.step().writes == 0


# ----------------------------------------------------------------------------- rendezvous Secret
def _env(pod: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def _secret_volume(pod: dict) -> str | None:
    """The Secret the pod mounts at the rendezvous secret folder (None: none)."""
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    mount = next((m for m in mounts if m["mountPath"] == RENDEZVOUS_SECRET_DIR), None)
    if mount is None:
        return None
    assert mount["readOnly"] is True
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["defaultMode"] == 0o400
    assert vol["secret"]["items"] == [{"key": "secret", "path": "secret"}]
    return vol["secret"]["secretName"]


def test_each_incarnation_gets_its_own_rendezvous_secret_before_its_pods() -> None:
    """A DWDP group over the TCP store: one Secret per incarnation, planned without a
    value, labelled and owned like the incarnation's pods, mounted only into them, and
    named by the env var (its path, never its value)."""
    p = plan(body(), Observed(), options=OPTIONS, now="T0")
    secrets = [o for o in p.create if o["kind"] == "Secret"]
    assert [s["metadata"]["name"] for s in secrets] == ["demo-g0-i0-rdzv", "demo-g1-i0-rdzv"]
    for index, secret in enumerate(secrets):
        assert secret["type"] == "Opaque"
        assert "data" not in secret and "stringData" not in secret  # the apply step adds it
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert secret["metadata"]["ownerReferences"][0]["controller"] is True
        pod = p.create_pods[2 * index]
        want = {
            k: v
            for k, v in pod["metadata"]["labels"].items()
            if k not in (c.LABEL_POD_INDEX, c.LABEL_REVISION, c.LABEL_LLMD_SERVING,
                         c.LABEL_LLMD_MODEL)
        }
        assert secret["metadata"]["labels"] == want
        assert want[c.LABEL_INCARNATION] == "0" and want[c.LABEL_GROUP] == f"demo-g{index}"
    for pod in p.create_pods:
        group = pod["metadata"]["labels"][c.LABEL_GROUP]
        assert _secret_volume(pod) == f"{group}-i0-rdzv"
        env = _env(pod)
        assert env[Env.RENDEZVOUS_SECRET_FILE.value] == RENDEZVOUS_SECRET_PATH
        assert "secret" not in str(pod["metadata"].get("annotations"))
        assert not any(
            "secretKeyRef" in (e.get("valueFrom") or {})
            for e in pod["spec"]["containers"][0]["env"]
        )
    assert plan(body(), Observed(), options=OPTIONS, now="T0") == p  # still deterministic


def test_a_restart_gets_a_new_secret_and_the_old_one_goes_with_its_pods() -> None:
    sim = Sim(body(replicas=1))
    sim.step()
    assert sim.names("Secret") == ["demo-g0-i0-rdzv"]
    assert sim.step().create == ()  # present: not created again
    for name in sim.names("Pod"):
        del sim.objects[("Pod", name)]
    p = sim.step("2026-01-01T00:00:00Z")  # the failure: incarnation 0's pods are gone
    assert Delete("Secret", "demo-g0-i0-rdzv") in p.delete
    p = sim.step("2026-01-01T00:00:10Z")
    assert [o["metadata"]["name"] for o in p.create] == ["demo-g0-i1-rdzv"]
    assert {_secret_volume(pod) for pod in p.create_pods} == {"demo-g0-i1-rdzv"}
    assert sim.names("Secret") == ["demo-g0-i1-rdzv"]


def test_a_group_without_dwdp_gets_no_secret() -> None:
    """dwdpSize 1: the worker never opens the store (the operator refuses the MPI transport
    outright, so tcpStore is the only rendezvous it runs)."""
    spec = {"context": {"replicas": 1, "ranksPerPod": 1, "dwdp": {"dwdpSize": 1}}}
    p = plan(body(**spec), Observed(), options=OPTIONS, now="T0")
    assert p.create_pods and not [o for o in p.create if o["kind"] == "Secret"]
    for pod in p.create_pods:
        assert _secret_volume(pod) is None
        assert Env.RENDEZVOUS_SECRET_FILE.value not in _env(pod)


def test_generation_servers_get_no_secret() -> None:
    """Generation servers run no DWDP (the worker never opens the store for them)."""
    p = plan(body(replicas=1, generation={"replicas": 1}), Observed(), options=OPTIONS, now="T")
    secrets = [o["metadata"]["name"] for o in p.create if o["kind"] == "Secret"]
    assert secrets == ["demo-g0-i0-rdzv"]
    gen = [o for o in p.create_pods if o["metadata"]["labels"][c.LABEL_ROLE] == "generation"]
    assert gen and all(_secret_volume(pod) is None for pod in gen)


def test_the_kv_transfer_policy_comes_with_generation_servers() -> None:
    names = [o["metadata"]["name"] for o in plan(
        body(replicas=1, generation={"replicas": 1}), Observed(), options=OPTIONS, now="T"
    ).apply if o["kind"] == "NetworkPolicy"]
    assert names == [
        "demo-serving", "demo-kv-transfer", "demo-g0-group", "demo-gen0-group", "demo-router"
    ]


def test_a_group_policy_lives_as_long_as_its_group_and_the_setting() -> None:
    sim = Sim(body(replicas=2))
    first = sim.step()
    policies = [o["metadata"]["name"] for o in first.apply if o["kind"] == "NetworkPolicy"]
    # applied in the plan that creates the pods (apply runs before the pod creations)
    assert policies == ["demo-serving", "demo-g0-group", "demo-g1-group"] and first.create_pods
    sim.step()
    sim.body["spec"]["context"]["replicas"] = 1
    sim.step()  # gates close
    sim.step()  # pods deleted
    p = sim.step()
    assert Delete("NetworkPolicy", "demo-g1-group") in p.delete
    assert sim.names("NetworkPolicy") == ["demo-g0-group", "demo-serving"]
    sim.body["spec"]["networkPolicy"] = {"enabled": False}
    p = sim.step()
    assert sorted(d.name for d in p.delete if d.kind == "NetworkPolicy") == [
        "demo-g0-group",
        "demo-serving",
    ]
    assert sim.names("Pod") == ["demo-g0-i0-p0", "demo-g0-i0-p1"]  # no rollout for it
    assert sim.step().writes == 0


def test_serving_sources_let_the_operator_namespace_in() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"team": "gateway"}}}]
    options = PlanOptions(compute_domains=False, operator_namespace="dwdp-system")
    spec = body(networkPolicy={"servingFrom": peers})
    p = plan(spec, Observed(), options=options, now="T0")
    serving = next(o for o in p.apply if o["metadata"]["name"] == "demo-serving")
    assert serving["spec"]["ingress"][0]["from"] == [
        *peers,
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dwdp-system"}}},
    ]


def test_a_revision_that_never_commits_hits_the_deadline_and_old_groups_keep_serving() -> None:
    sim = Sim(body(replicas=1, rollout={"progressDeadlineSeconds": 60}))
    sim.step(now="2026-01-01T00:00:00Z")
    sim.step(now="2026-01-01T00:00:01Z")
    old = sim.body["status"]["revision"]
    sim.body["spec"]["image"] = "worker:broken"
    sim.rank_phase = None  # the new revision's ranks never answer committed
    p = sim.step(now="2026-01-01T00:00:02Z")
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g1-i0-p0", "demo-g1-i0-p1"]
    new = p.status["revision"]
    surge = next(g for g in p.status["groups"] if g["name"] == "demo-g1")
    assert surge["startedAt"] == "2026-01-01T00:00:02Z"
    p = sim.step(now="2026-01-01T00:00:30Z")
    progressing = next(x for x in p.status["conditions"] if x["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert p.status["updatedGroups"] == 1
    p = sim.step(now="2026-01-01T00:01:03Z")
    conds = {x["type"]: x for x in p.status["conditions"]}
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == (
        "False",
        "ProgressDeadlineExceeded",
    )
    assert (
        f"group demo-g1 (revision {new}) has not committed 61 s" in conds["Progressing"]["message"]
    )
    assert conds["Degraded"]["status"] == "True" and conds["Ready"]["status"] == "True"
    assert p.status["phase"] == "Degraded"  # what `kubectl get dwdp` shows
    assert [(g["name"], g["revision"], g["phase"]) for g in p.status["groups"]] == [
        ("demo-g0", old, "Serving"),
        ("demo-g1", new, "Rendezvous"),
    ]
    assert p.delete == () and p.create_pods == ()  # the rollout waits; nothing drained
    # Reverting the spec: the stuck group goes, the old one is left as it is.
    sim.body["spec"]["image"] = "worker:1"
    p = sim.step(now="2026-01-01T00:01:04Z")
    assert p.status["revision"] == old
    assert all(g.pod.startswith("demo-g1") for g in p.gates)
    assert all(d.name.startswith("demo-g1") for d in p.delete)


def test_a_rank_restarted_in_place_behind_an_open_gate_fails_its_group() -> None:
    sim = Sim(body(replicas=1))
    sim.start_ids = {"demo-g0-i0-p0": "a0", "demo-g0-i0-p1": "a1"}
    sim.step()
    p = sim.step()  # commit: gates open, the start ids recorded
    assert {g.ready for g in p.gates} == {True}
    (g0,) = p.status["groups"]
    assert g0["rankStarts"] == ["a0", "a0", "a1", "a1"]  # 2 ranks per pod, by rank
    assert sim.step().writes == 0  # at rest, asked again: same processes
    sim.start_ids["demo-g0-i0-p1"] = "b1"  # pod 1's ranks restarted in place
    p = sim.step()
    assert sorted(g.pod for g in p.gates if not g.ready) == ["demo-g0-i0-p0", "demo-g0-i0-p1"]
    assert sorted(d.name for d in p.delete if d.kind == "Pod") == [
        "demo-g0-i0-p0",
        "demo-g0-i0-p1",
    ]
    (g0,) = p.status["groups"]
    assert g0["lastFailure"]["reason"] == "RestartedInPlace"
    assert g0["lastFailure"]["phase"] == "serve"
    assert (
        "rank 2 is no longer the process that committed (start id b1, committed as a1)"
        in (g0["lastFailure"]["message"])
    )
    assert [e.reason for e in p.events] == [Reason.GROUP_FAILED]


def test_a_committed_group_not_asked_this_cycle_is_not_judged() -> None:
    sim = Sim(body(replicas=1))
    sim.start_ids = {"demo-g0-i0-p0": "a0", "demo-g0-i0-p1": "a1"}
    sim.step()
    sim.step()
    observed = sim.observed()
    quiet = Observed.from_objects(
        pods=[o for (k, _), o in sim.objects.items() if k == "Pod"],
        children=[o for (k, _), o in sim.objects.items() if k != "Pod"],
        ranks={},  # committed groups are asked only every VERIFY_INTERVAL_S
    )
    assert observed.ranks and plan(sim.body, quiet, options=OPTIONS, now="T").writes == 0


def test_group_names_are_never_reused_and_scale_down_takes_the_failing_group() -> None:
    sim = Sim(body(replicas=3))
    sim.step()
    sim.step()
    assert sim.body["status"]["nextGroupIndex"] == 3
    # g0 fails (its pod ends); scale-down to 2 must take g0, not a serving group
    pod = sim.objects[("Pod", "demo-g0-i0-p0")]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [
        {"state": {"terminated": {"exitCode": 1, "message": "P3: boom"}}}
    ]
    sim.body["spec"]["context"]["replicas"] = 2
    p = sim.step()
    groups = {g["name"]: g["phase"] for g in p.status["groups"]}
    assert groups["demo-g1"] == "Serving" and groups["demo-g2"] == "Serving"
    assert not any(g.pod.startswith(("demo-g1", "demo-g2")) for g in p.gates)
    for _ in range(3):
        sim.step()
    assert sorted({n.rsplit("-i", 1)[0] for n in sim.names("Pod")}) == ["demo-g1", "demo-g2"]
    # scale up again: the new group is g3, never a reused g0
    sim.body["spec"]["context"]["replicas"] = 3
    p = sim.step()
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g3-i0-p0", "demo-g3-i0-p1"]
    assert sim.step().status["nextGroupIndex"] == 4  # spent once its pods exist


def test_a_refused_creation_retries_under_the_same_group_name() -> None:
    sim = Sim(body(replicas=2))
    p = sim.step()
    refused = [o for o in p.create_pods if o["metadata"]["name"].startswith("demo-g1")]
    for pod in refused:  # the apiserver refused g1's pods (quota): they never existed
        sim.objects.pop(("Pod", pod["metadata"]["name"]))
    p = sim.step()
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-g1-i0-p0", "demo-g1-i0-p1"]


# ----------------------------------------------------------------------------- the router


def _router(p) -> dict | None:
    return next((o for o in p.apply if o["kind"] == "Deployment"), None)


def _router_urls(dep: dict) -> tuple[list[str], list[str]]:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    pick = lambda flag: [args[i + 1] for i, a in enumerate(args) if a == flag]  # noqa: E731
    return pick("--prefill"), pick("--decode")


def _router_pod(sim: Sim, dep: dict, name: str = "demo-router-x") -> None:
    """A Ready pod of the router Deployment's current template (what its ReplicaSet makes)."""
    tmpl = dep["spec"]["template"]
    sim.objects[("Pod", name)] = {
        "kind": "Pod",
        "metadata": {"name": name, **copy.deepcopy(tmpl["metadata"])},
        "spec": copy.deepcopy(tmpl["spec"]),
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_the_router_lists_every_committed_rank_and_each_generation_server() -> None:
    sim = Sim(body(replicas=2, generation={"replicas": 1}))
    first = sim.step("T0")
    dep = _router(first)
    assert dep is not None and dep["spec"]["replicas"] == 0  # nothing committed yet
    assert _router_urls(dep) == ([], [])
    cond = {x["type"]: x for x in first.status["conditions"]}["RouterReady"]
    assert (cond["status"], cond["reason"]) == ("False", "NoServers")
    p = sim.step("T1")  # every rank commits: gates open, the router gets every rank's URL
    dep = _router(p)
    assert dep is not None and dep["spec"]["replicas"] == 1
    prefill, decode = _router_urls(dep)
    ips = {n: o["status"]["podIP"] for (k, n), o in sim.objects.items() if k == "Pod"}
    assert prefill == sorted(
        f"http://{ips[pod]}:{8000 + k}"
        for pod in ("demo-g0-i0-p0", "demo-g0-i0-p1", "demo-g1-i0-p0", "demo-g1-i0-p1")
        for k in range(2)
    )
    assert decode == [f"http://{ips['demo-gen0-i0-p0']}:8000"]
    assert p.status["router"] == {
        "replicas": 1,
        "readyReplicas": 0,
        "prefillServers": 8,
        "decodeServers": 1,
        "endpoint": "http://demo-router.ns1.svc:8000",
    }
    cond = {x["type"]: x for x in p.status["conditions"]}["RouterReady"]
    assert (cond["status"], cond["reason"]) == ("False", "RouterNotReady")
    _router_pod(sim, dep)
    p = sim.step("T2")
    assert _router(p) is None and p.create_pods == () and p.delete == ()
    assert p.status["router"]["readyReplicas"] == 1
    cond = {x["type"]: x for x in p.status["conditions"]}["RouterReady"]
    assert (cond["status"], cond["reason"], cond["lastTransitionTime"]) == (
        "True",
        "RouterAvailable",
        "T2",
    )
    assert sim.step("T3").writes == 0  # at rest


def test_a_failed_group_leaves_the_router_and_rolls_it() -> None:
    sim = Sim(body(replicas=2, generation={"replicas": 1}))
    sim.step()
    dep = _router(sim.step())
    assert dep is not None
    _router_pod(sim, dep)
    sim.step()
    failed = sim.objects[("Pod", "demo-g1-i0-p1")]
    failed["status"]["phase"] = "Failed"
    p = sim.step()
    rolled = _router(p)
    assert rolled is not None
    prefill, _ = _router_urls(rolled)
    g0 = {sim.objects[("Pod", f"demo-g0-i0-p{i}")]["status"]["podIP"] for i in (0, 1)}
    assert len(prefill) == 4 and {u.split("//")[1].split(":")[0] for u in prefill} == g0
    annotation = c.ANNOTATION_ROUTER_SERVERS
    assert (
        rolled["spec"]["template"]["metadata"]["annotations"][annotation]
        != dep["spec"]["template"]["metadata"]["annotations"][annotation]
    )
    cond = {x["type"]: x for x in p.status["conditions"]}["RouterReady"]
    assert cond["status"] == "False"  # the ready pod runs the old list


def test_no_router_without_generation_servers_or_when_turned_off() -> None:
    for spec_patch in ({}, {"generation": {"replicas": 1}, "router": {"enabled": False}}):
        sim = Sim(body(replicas=1, **spec_patch))
        sim.step()
        p = sim.step()
        assert "Deployment" not in {k for k, _ in sim.objects}
        assert "demo-router" not in sim.names("NetworkPolicy") + sim.names("Service")
        assert "router" not in p.status
        assert "RouterReady" not in {x["type"] for x in p.status["conditions"]}
    sim = Sim(body(replicas=1, generation={"replicas": 1}))
    sim.step()
    assert sim.names("Deployment") == ["demo-router"]
    sim.body["spec"]["router"] = {"enabled": False}
    p = sim.step()
    assert {Delete(k, "demo-router") for k in ("Deployment", "NetworkPolicy", "Service")} <= set(
        p.delete
    )


def test_router_enabled_without_generation_is_refused_before_any_pod() -> None:
    p = plan(body(replicas=1, router={"enabled": True}), Observed(), options=OPTIONS, now="T")
    assert p.apply == () and p.create_pods == ()
    invalid = {x["type"]: x for x in p.status["conditions"]}["Invalid"]
    assert "spec.router.enabled" in invalid["message"]
    assert "needs generation servers" in invalid["message"]


# ----------------------------------------------------------------------------- vLLM generation


def vllm_body(**generation) -> dict:
    """One context group of 4 ranks on the cpu backend and vLLM generation servers."""
    return body(
        replicas=1,
        model={"path": "/models/tiny", "dtype": "float32"},
        context={"replicas": 1, "ranksPerPod": 4, "handleType": "shm", "dwdp": {"dwdpSize": 4}},
        generation={"replicas": 1, "vllm": {"image": "vllm-cpu:0.32.0"}, **generation},
    )


def _set_vllm_ready(sim: Sim, ready: bool) -> None:
    for (kind, _), obj in sim.objects.items():
        if kind == "Pod" and c.LABEL_ENGINE in obj["metadata"]["labels"]:
            obj["status"]["containerStatuses"][0]["ready"] = ready


def test_vllm_servers_join_the_router_as_decode_servers_once_their_health_passes() -> None:
    sim = Sim(vllm_body())
    first = sim.step("T0")
    (gen,) = [o for o in first.create_pods if o["metadata"]["labels"][c.LABEL_ROLE] == "generation"]
    assert gen["metadata"]["name"] == "demo-gen0-i0-p0"
    assert gen["spec"]["containers"][0]["command"][:3] == [
        "python3", "-m", "vllm.entrypoints.openai.api_server"
    ]
    configs = sorted(o["metadata"]["name"] for o in first.apply if o["kind"] == "ConfigMap")
    assert len(configs) == 1 and configs[0].startswith("demo-context-")  # vLLM reads none
    assert not [o for o in first.create if o["metadata"]["name"].startswith("demo-gen")]
    p = sim.step("T1")  # the context group commits; vLLM is still loading
    assert [g.pod for g in p.gates] == ["demo-g0-i0-p0"]
    assert p.status["generation"]["readyReplicas"] == 0
    assert _router(p)["spec"]["replicas"] == 0  # no decode server yet
    assert sim.step("T2").gates == ()  # an unready vLLM server is never asked /dwdp/status
    _set_vllm_ready(sim, True)
    p = sim.step("T3")
    assert p.gates == (GateChange("demo-gen0-i0-p0", True, "demo-gen0 committed"),)
    dep = _router(p)
    ips = {n: o["status"]["podIP"] for (k, n), o in sim.objects.items() if k == "Pod"}
    assert dep["spec"]["replicas"] == 1
    assert _router_urls(dep)[1] == [f"http://{ips['demo-gen0-i0-p0']}:8000"]
    assert p.status["generation"]["readyReplicas"] == 1 and p.status["phase"] == "Ready"
    assert p.status["router"]["decodeServers"] == 1
    _set_vllm_ready(sim, False)  # a slow /health after the commit is not a failure
    assert sim.step("T4").gates == () and sim.body["status"]["phase"] == "Ready"


def test_a_vllm_server_that_exits_fails_and_leaves_the_router() -> None:
    sim = Sim(vllm_body())
    sim.vllm_ready = True
    sim.step("T0")
    sim.step("T1")
    pod = sim.objects[("Pod", "demo-gen0-i0-p0")]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [
        {"ready": False, "state": {"terminated": {"exitCode": 1, "message": "EngineDeadError"}}}
    ]
    p = sim.step("T2")
    assert [d.name for d in p.delete if d.kind == "Pod"] == ["demo-gen0-i0-p0"]
    (entry,) = p.status["generation"]["groups"]
    assert entry["lastFailure"]["message"] == "demo-gen0-i0-p0: EngineDeadError"
    assert p.status["generation"]["readyReplicas"] == 0
    assert _router_urls(_router(p))[1] == []


def test_a_vllm_tier_change_rolls_the_vllm_servers_only() -> None:
    sim = Sim(vllm_body())
    sim.vllm_ready = True
    sim.step("T0")
    sim.step("T1")
    revisions = {n: o["metadata"]["labels"][c.LABEL_REVISION] for (k, n), o in sim.objects.items()
                 if k == "Pod"}
    sim.body["spec"]["generation"]["vllm"]["args"] = ["--max-model-len", "512"]
    p = sim.step("T2")
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-gen1-i0-p0"]
    new = p.create_pods[0]["metadata"]["labels"][c.LABEL_REVISION]
    assert new != revisions["demo-gen0-i0-p0"]
    assert p.create_pods[0]["spec"]["containers"][0]["args"][-2:] == ["--max-model-len", "512"]
    assert not [o for o in p.apply if o["kind"] == "ConfigMap"]  # the context config stays


def test_hybrid_kv_cache_manager_reaches_both_tiers() -> None:
    p = plan(vllm_body(vllm={"image": "vllm-cpu:0.32.0", "hybridKvCacheManager": False,
                             "sideChannelPort": 6100}),
             Observed(), options=OPTIONS, now="T")
    (cm,) = [o for o in p.apply if o["kind"] == "ConfigMap"]
    launch = yaml.safe_load(cm["data"][c.CONFIG_KEY_CONTEXT])
    assert launch["kvTransfer"]["vllm"] == {
        "version": "0.32.0",
        "sideChannelPort": 6100,
        "model": "/models/tiny",
        "hybridKvCacheManager": False,
        "cpuAttentionKernel": "auto",  # the vLLM hosts' kernel is taken to be this host's
    }
    (gen,) = [o for o in p.create_pods if o["metadata"]["labels"][c.LABEL_ROLE] == "generation"]
    assert "--disable-hybrid-kv-cache-manager" in gen["spec"]["containers"][0]["args"]
