"""docs/operations.md's field reference is generated from the API models and kept current."""

from __future__ import annotations

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
        for sub in getattr(info.annotation, "__args__", None) or (info.annotation,):
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                out |= _aliases(sub, path)
    return out


def test_every_spec_field_has_a_row_with_its_default() -> None:
    text = docgen.generated_reference()
    for path in _aliases(DwdpDeploymentSpec, "spec"):
        if ".tolerations." in path or ".env." in path:
            path = path.replace(".tolerations.", ".tolerations[].").replace(".env.", ".env[].")
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
