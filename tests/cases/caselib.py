"""Load the DwdpDeployment case table (deployments.yaml) and build each case's document.

A case is ``base`` with the case's ``patch`` applied as a JSON merge patch (RFC 7386: a
null deletes the key), then ``nulls`` (dotted paths) set to an explicit null. Each case
says whether the document is ``valid`` and, when it is not, the ``field`` (camelCase path)
that every validator's message must name and, optionally, the ``message`` every validator's
text must contain (the same words from each). Test modules load this file by path
(pytest runs with ``--import-mode=importlib``, so ``tests`` is not a package).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CASES_FILE = Path(__file__).with_name("deployments.yaml")


@dataclass(frozen=True)
class Case:
    """One row of the table."""

    name: str
    rule: str
    document: dict[str, Any]
    valid: bool
    field: str | None
    message: str | None = None

    def field_named_in(self, text: str) -> bool:
        """True when ``text`` names this case's field: its full path, or its parent path
        together with its own name (a rule on the parent object that names the field)."""
        if self.field is None:
            return True
        if self.field in text:
            return True
        parent, _, leaf = self.field.rpartition(".")
        leaf = leaf.split("[", 1)[0]
        return (not parent or parent in text) and leaf in text

    def verdict_in(self, text: str) -> bool:
        """True when ``text`` (a validator's refusal) names the field and, if the case gives
        one, carries its message."""
        message_ok = self.message is None or " ".join(self.message.split()) in " ".join(
            text.split()
        )
        return self.field_named_in(text) and message_ok


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch of ``patch`` onto ``target`` (a new object)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _set_null(doc: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = None


def load_cases(path: Path = CASES_FILE) -> list[Case]:
    """Every case of the table, documents built, in file order."""
    table = yaml.safe_load(path.read_text())
    base = table["base"]
    cases = []
    seen: set[str] = set()
    for row in table["cases"]:
        name = row["name"]
        if name in seen:
            raise ValueError(f"duplicate case name {name!r} in {path}")
        seen.add(name)
        doc = merge_patch(base, row.get("patch") or {})
        for dotted in row.get("nulls") or ():
            _set_null(doc, dotted)
        valid = bool(row["valid"])
        field = row.get("field")
        if not valid and not field:
            raise ValueError(f"case {name!r}: an invalid case must name its field")
        message = row.get("message")
        if valid and message:
            raise ValueError(f"case {name!r}: a valid case has no refusal message")
        cases.append(Case(name, row.get("rule", ""), doc, valid, field, message))
    return cases
