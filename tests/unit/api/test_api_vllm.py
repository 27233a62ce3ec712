"""The arguments ``generation.vllm.args`` refuses: the options the operator sets and those the
context ranks cannot serve, in every spelling vLLM 0.32.0's parser takes for them (``_`` for
``-``, ``=VALUE``, ``--no-`` of a boolean, and any unambiguous prefix: argparse's
abbreviations), and nothing else. The prefix lengths were checked against the wheel's parser
(every prefix of every option it has); this table keeps the cases that matter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dwdp.api.deployment import deployment_problems, parse_deployment
from dwdp.api.vllm import FLAG_PATTERN, OPERATOR_ARGS, operator_arg

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "05-vllm-fleet.yaml"

REFUSED = [
    "--model", "--model=/x", "--served-model-name", "--served_model_name=x", "--served-model",
    "--ser", "--host", "--ho", "--port", "--por", "--uds", "--api-key", "--api-k", "--dtype",
    "--dt", "--kv-transfer-config", "--kv-t", "--kv-cache-dtype", "--tensor-parallel-size",
    "--te", "-tp", "-t", "-tp=2", "--pipeline-parallel-size", "--pi", "-pp",
    "--disable-hybrid-kv-cache-manager", "--disable-h", "--no-disable-hybrid-kv-cache-manager",
    "--config", "--config=/etc/vllm.yaml",
    # dotted keys: vLLM folds --X.key=value into --X '{"key": value}' (and --X.key+ appends)
    "--kv-transfer-config.kv_role=kv_producer", "--kv_transfer_config.kv_connector=X",
    "--kv-t.kv_role", "--served-model-name.x+", "--model.path=/y", "--api-key.x=y",
]
ACCEPTED = [
    "--max-model-len", "--max-num-seqs=16", "--no-enable-prefix-caching", "--enforce-eager",
    "--block-size", "--kv-events-config", "--kv-cache-memory-bytes", "--config-format",
    "--mode", "--se", "--po", "--api", "--d", "--tp", "--pp", "512", "float32", "-O3",
    "--compilation-config.mode=3", "--kv-events-config.enable_kv_cache_events=true",
    "--speculative-config.num_speculative_tokens=2",
]


@pytest.mark.parametrize("arg", REFUSED)
def test_an_option_the_operator_sets_is_refused_in_every_spelling(arg: str) -> None:
    assert operator_arg(arg) is not None
    assert re.fullmatch(FLAG_PATTERN[1:-1], arg)  # the CRD's CEL reads the same pattern


@pytest.mark.parametrize("arg", ACCEPTED)
def test_vllms_other_options_and_values_pass(arg: str) -> None:
    assert operator_arg(arg) is None
    assert not re.fullmatch(FLAG_PATTERN[1:-1], arg)


def test_each_refusal_says_why() -> None:
    assert operator_arg("--port") == OPERATOR_ARGS["port"][1] == "the operator passes server.port"
    assert "one rank per server" in (operator_arg("-tp") or "")


def test_the_vllm_fleet_example_is_valid_and_its_tier_is_vllm() -> None:
    document = yaml.safe_load(EXAMPLE.read_text())
    assert deployment_problems(document) == []
    spec = parse_deployment(document).spec
    assert spec.vllm is not None and spec.vllm.version == "0.32.0"
