"""DwdpConfig details, problem rendering, and the generated CRD's structure."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dwdp.api.config import DwdpConfig
from dwdp.api.crd import crd_manifest, crd_yaml
from dwdp.api.deployment import (
    ContextSpec,
    DwdpDeploymentStatus,
    deployment_problems,
    parse_deployment,
)
from dwdp.api.enums import CopyMode, GatherKernel
from dwdp.api.errors import DwdpValidationError, Problem, problems_from_validation_error


def problems(data: dict) -> list[Problem]:
    with pytest.raises(ValidationError) as info:
        DwdpConfig.model_validate(data)
    return problems_from_validation_error(info.value)


def test_defaults_match_design() -> None:
    cfg = DwdpConfig()
    assert (cfg.dwdp_size, cfg.num_groups, cfg.num_prefetch_slots) == (1, 1, 2)
    assert (cfg.num_experts_per_worker, cfg.num_prefetch_experts) == (0, 0)
    assert cfg.enable_experts and not cfg.enable_dense and not cfg.contention_opt
    assert cfg.copy_mode is None and cfg.gather_kernel is None
    assert not cfg.expert_dwdp and DwdpConfig(dwdp_size=2).expert_dwdp


def test_python_names_and_enums() -> None:
    cfg = DwdpConfig(dwdp_size=4, copy_mode="gather", gather_kernel="tma")
    assert cfg.copy_mode is CopyMode.GATHER and cfg.gather_kernel is GatherKernel.TMA
    assert cfg.to_yaml_dict()["copyMode"] == "gather"
    assert "gatherKernel" in cfg.to_yaml_dict() and "copy_mode" not in cfg.to_yaml_dict()


def test_every_broken_rule_is_listed() -> None:
    found = problems(
        {"enableExperts": False, "dwdpSize": 2, "contentionOpt": True, "gatherKernel": "tma"}
    )
    wheres = [p.where for p in found]
    assert wheres == ["gatherKernel", "dwdpSize", "contentionOpt", "enableExperts"]
    assert "nothing to distribute" in str(found[-1])


def test_problem_text_names_path_value_and_rule() -> None:
    (p,) = problems({"dwdpSize": 4, "copyMode": "gather", "contentionOpt": True})
    assert str(p) == (
        "copyMode: must be batched or unset while contentionOpt is true (got \"gather\")"
    )
    assert str(p.under(("spec", "context", "dwdp"))).startswith("spec.context.dwdp.copyMode:")


def test_list_paths_and_missing_values() -> None:
    found = deployment_problems(
        {
            "apiVersion": "dwdp.io/v1alpha1",
            "kind": "DwdpDeployment",
            "metadata": {"name": "x"},
            "spec": {"model": {"path": "/m"}, "context": {}, "env": [{"name": "DWDP_X"}]},
        }
    )
    rendered = [str(p) for p in found]
    assert "spec.image: is required" in rendered
    assert any(r.startswith("spec.env[0].name: names starting with DWDP_") for r in rendered)


def test_parse_deployment_raises_with_all_problems() -> None:
    with pytest.raises(DwdpValidationError) as info:
        parse_deployment({"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {}})
    err = info.value
    assert len(err.problems) >= 3 and err.first.where == "apiVersion"
    assert isinstance(err, ValueError) and "DwdpDeployment" in str(err)
    assert deployment_problems(["not", "a", "mapping"])[0].rule.startswith("a DwdpDeployment")


def test_context_geometry() -> None:
    # One rank per instance (the only layout this worker runs): a group is dwdpSize ranks.
    ctx = ContextSpec.model_validate({"ranksPerPod": 2, "dwdp": {"dwdpSize": 4}})
    assert ctx.ranks_per_group == 4 and ctx.pods_per_group == 2


def test_status_keeps_unknown_fields() -> None:
    status = DwdpDeploymentStatus.model_validate(
        {"readyGroups": 1, "kopf": {"progress": {}}, "groups": [{"name": "g0", "extra": 1}]}
    )
    assert status.ready_groups == 1 and status.model_extra == {"kopf": {"progress": {}}}


# ------------------------------------------------------------------------ CRD structure


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.fixture(scope="module")
def schema() -> dict:
    (version,) = crd_manifest()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_crd_schema_is_structural(schema) -> None:
    for path, node in _walk(schema):
        assert "$ref" not in node and "title" not in node and "const" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node and "oneOf" not in node, path
        assert "type" in node, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if node.get("type") == "string" and path.startswith(".spec"):
            assert "maxLength" in node or "enum" in node, f"{path}: unbounded string"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list"
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node or path.startswith(".status"), path


def test_crd_has_enums_minimums_defaults_and_rules(schema) -> None:
    dwdp = schema["properties"]["spec"]["properties"]["context"]["properties"]["dwdp"]
    props = dwdp["properties"]
    assert props["copyMode"]["enum"] == ["per_slice", "batched", "gather"]
    assert props["gatherKernel"]["enum"] == ["register", "tma"]
    assert props["numPrefetchSlots"] == {
        **props["numPrefetchSlots"], "minimum": 2, "default": 2, "type": "integer"
    }
    assert dwdp["default"] == {}
    rules = dwdp["x-kubernetes-validations"]
    assert all({"rule", "message", "fieldPath"} <= set(rule) for rule in rules)
    assert any("gatherKernel" in r["message"] and "gather" in r["message"] for r in rules)
    context = schema["properties"]["spec"]["properties"]["context"]
    assert {r["fieldPath"] for r in context["x-kubernetes-validations"]} == {
        ".dwdp.enableDense",
        ".dwdp.copyMode",
        ".dwdp.smReserve",
        ".transport",
        ".engine.cudaGraphs",
        ".dwdp.dwdpSize",
        ".ranksPerPod",
        ".kvCache.maxTokens",
    }
    status = schema["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert schema["properties"]["metadata"]["properties"]["name"]["maxLength"] == 40


def _preserving(node: object, path: str = "") -> list[str]:
    """The paths under ``node`` whose schema keeps unknown fields."""
    if isinstance(node, list):
        return [p for item in node for p in _preserving(item, path)]
    if not isinstance(node, dict):
        return []
    found = [path] if node.get("x-kubernetes-preserve-unknown-fields") else []
    return found + [p for k, v in node.items() for p in _preserving(v, f"{path}/{k}")]


def test_crd_spec_keeps_no_unknown_field(schema) -> None:
    """The spec's schema is structural throughout, so the apiserver refuses (strict field
    validation) or prunes every unknown field, a dropped one included; only the status
    (kopf's progress) keeps unknown fields."""
    spec = schema["properties"]["spec"]
    assert _preserving(spec) == []
    for section in ("context", "generation"):
        props = spec["properties"][section]["properties"]
        assert "parallel" not in props
        # the rest are dropped (speculativeDecoding's successor is speculative)
        assert set(props["engine"]["properties"]) == {"cudaGraphs", "speculative"}


def test_crd_names_subresources_and_columns() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "dwdpdeployments.dwdp.io"
    names = crd["spec"]["names"]
    assert names["kind"] == "DwdpDeployment" and names["shortNames"] == ["dwdp"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.context.replicas"
    assert scale["statusReplicasPath"].startswith(".status.")
    assert version["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyGroups"
    assert columns["Phase"] == ".status.phase"
    assert columns["DWDP"] == ".spec.context.dwdp.dwdpSize"
    assert columns["Dense"] == ".spec.context.dwdp.enableDense"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_crd_yaml_round_trips() -> None:
    text = crd_yaml()
    assert yaml.safe_load(text) == crd_manifest()
    assert text == crd_yaml()  # deterministic
