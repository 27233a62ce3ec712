"""Bounded fuzzing of the launch-config loader (issue 17 item 5): whatever bytes or YAML
values a file holds, ``dwdp worker`` either gets a valid ``LaunchConfig`` or one line naming
the file and the first bad field, never another exception or a hang. Cases found once are kept
as ``@example``s."""

from __future__ import annotations

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dwdp.api.launch import LaunchError  # noqa: E402
from dwdp.worker.main import WorkerStartupError, check_launch, load_launch_config  # noqa: E402

FIELDS = (
    "model", "role", "parallel", "engine", "transport", "handleType", "dwdp", "maxNumTokens",
    "maxBatchSize", "maxModelLen", "kvCache", "serverPort", "gracefulShutdownTimeoutSeconds",
)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).map(
    lambda d: {"model": {"path": "/m"}, **d}
)
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load(tmp_path, text: bytes) -> None:
    path = tmp_path / "launch.yaml"
    path.write_bytes(text)
    try:
        cfg = load_launch_config(str(path))
        check_launch(cfg, "context", environ={})
    except (WorkerStartupError, LaunchError) as exc:
        line = str(exc)
        assert line and "\n" not in line.strip(), line
        assert "Traceback" not in line


@FUZZ
@given(text=st.binary(max_size=200))
@example(text=b"\xff\xfe")  # not UTF-8
@example(text=b"- 1\n- 2\n")  # a list at the top level
@example(text=b"model: [")  # broken YAML
@example(text=b"model: {path: /m}\nkvCache: {freeMemoryFraction: .nan}\n")
def test_any_bytes_load_or_fail_in_one_line(tmp_path, text):
    _load(tmp_path, text)


@FUZZ
@given(doc=documents)
@example(doc={"model": {"path": "/m"}, "maxModelLen": 0})
@example(doc={"model": {"path": "/m"}, "kvCache": {"maxTokens": -1}})
@example(doc={"model": {"path": "/m"}, "dwdp": {"dwdpSize": 4, "enableDense": "yes"}})
@example(doc={"model": {"path": "/m"}, "serverPort": 1e309})
def test_any_document_loads_or_fails_in_one_line(tmp_path, doc):
    _load(tmp_path, yaml.safe_dump(doc, allow_unicode=True).encode())
