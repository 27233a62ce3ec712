"""docs/operations.md's field reference is generated from the API models and kept current."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from dwdp.api import docgen
from dwdp.api.deployment import DwdpDeploymentSpec

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def test_committed_reference_equals_the_generated_one() -> None:
    assert docgen.check(DOC), "docs/operations.md is stale: run python -m dwdp.api.docgen --write"


def _aliases(model: type, prefix: str) -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        out.add(path)
        out |= _nested(info.annotation, path)
    return out


def _nested(annotation: object, path: str) -> set[str]:
    """The rows below a field typed ``annotation``: a model's fields, a list's items as
    ``path[]`` (the table's spelling), nothing under a map."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return _aliases(annotation, path)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict:
        return set()
    below = f"{path}[]" if origin is list else path
    return set().union(*(_nested(arg, below) for arg in args))


def test_every_spec_field_has_a_row_with_its_default() -> None:
    text = docgen.generated_reference()
    paths = _aliases(DwdpDeploymentSpec, "spec")
    assert "spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[]"\
        ".podAffinityTerm.topologyKey" in paths
    for path in paths:
        assert f"| `{path}` |" in text, path
    assert "| `spec.rendezvous.timeoutSeconds` | integer | `1800` |" in text
    assert "| `spec.context.dwdp.numPrefetchSlots` | integer | `2` | >= 2" in text


def test_a_stale_block_is_detected(tmp_path: Path) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text(f"intro\n{docgen.BEGIN}\n| old |\n{docgen.END}\nrest\n")
    assert not docgen.check(doc)
    assert docgen.main(["--check", str(doc)]) == 1
    assert docgen.main(["--write", str(doc)]) == 0
    assert docgen.check(doc)
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("rest\n")


def test_missing_markers_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="markers"):
        docgen.replace_block("no markers", "x")
