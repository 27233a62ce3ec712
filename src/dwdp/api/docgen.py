"""The field reference of ``docs/operations.md``, generated from the API models.

The tables are rendered from the CustomResourceDefinition schema that
:mod:`dwdp.api.crd` generates from the pydantic models, so every spec field's type, default,
constraints and CEL rules (with their messages) are the ones the apiserver enforces. The
generated text sits between two marker lines of the document; the rest is written by hand.

``python -m dwdp.api.docgen --write [FILE]`` rewrites that block in place;
``python -m dwdp.api.docgen --check [FILE]`` exits 1 when the committed block differs (a
unit test runs the same check). Without options it prints the block.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "check", "generated_reference", "main", "replace_block"]

BEGIN = "<!-- BEGIN GENERATED FIELD REFERENCE (python -m dwdp.api.docgen --write) -->"
END = "<!-- END GENERATED FIELD REFERENCE -->"
DEFAULT_DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def _version() -> dict[str, Any]:
    from dwdp.api.crd import crd_manifest

    return crd_manifest()["spec"]["versions"][0]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(node: dict[str, Any]) -> str:
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node.get('items') or {})}"
    if kind == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'] or {})}"
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    return kind or "any"


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if value == {}:
        return "(all defaults)"
    return f"`{json.dumps(value)}`"


def _constraints(node: dict[str, Any], required: bool) -> list[str]:
    out = ["required"] if required else []
    for key, word in (("minimum", ">="), ("maximum", "<=")):
        if key in node:
            strict = node.get(f"exclusive{key.capitalize()}") is True  # the CRD's boolean form
            out.append(f"{word[0] if strict else word} {node[key]}")
    if "minLength" in node:
        out.append(f"length >= {node['minLength']}")
    if "maxLength" in node:
        out.append(f"length <= {node['maxLength']}")
    if "maxItems" in node:
        out.append(f"at most {node['maxItems']} items")
    if "maxProperties" in node:
        out.append(f"at most {node['maxProperties']} entries")
    if "pattern" in node:
        out.append(f"matches `{node['pattern']}`")
    if "enum" in node:
        out.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    return out


def _rows(
    node: dict[str, Any], path: str, rows: list[tuple[str, str, str, str, str]], required: bool
) -> None:
    """Depth-first rows (path, type, default, rules, description) of ``node`` and below."""
    cel_by_field: dict[str, list[str]] = {}
    for rule in node.get("x-kubernetes-validations") or ():
        field = (rule.get("fieldPath") or "").lstrip(".").split(".")[0]
        cel_by_field.setdefault(field, []).append(rule["message"])
    item = node.get("items") or {} if node.get("type") == "array" else {}
    scalars = bool(item) and "properties" not in item
    if path:
        rules = _constraints(node, required) + cel_by_field.pop("", [])
        if scalars:  # a list of strings or numbers: its items' CEL rules are this row's
            rules += [f"items: {r['message']}" for r in item.get("x-kubernetes-validations") or ()]
        rows.append(
            (path, _type(node), _default(node), "; ".join(rules), node.get("description", ""))
        )
    props = node.get("properties") or {}
    if item:
        props = item.get("properties") or {}
        for rule in () if scalars else item.get("x-kubernetes-validations") or ():
            field = (rule.get("fieldPath") or "").lstrip(".").split(".")[0]
            cel_by_field.setdefault(field, []).append(rule["message"])
        req = set(item.get("required") or ())
        prefix = f"{path}[]"
    else:
        req = set(node.get("required") or ())
        prefix = path
    for name, child in props.items():
        child = dict(child)
        extra = cel_by_field.pop(name, [])
        if extra:
            child["x-kubernetes-validations"] = [
                *(child.get("x-kubernetes-validations") or ()),
                *({"fieldPath": "", "message": m} for m in extra),
            ]
        _rows(child, f"{prefix}.{name}" if prefix else name, rows, name in req)
    for field, messages in cel_by_field.items():  # rules on a field the loop did not reach
        if path and messages:
            where = f"{path}.{field}" if field else path
            rows.append((where, "", "", "; ".join(messages), "(rule of the enclosing object)"))


def _table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row in rows:
        first, *rest = row
        out.append("| " + " | ".join([f"`{first}`", *(_cell(c) for c in rest)]) + " |")
    return out


def generated_reference() -> str:
    """The generated block (without the marker lines), ending with a newline."""
    version = _version()
    root = version["schema"]["openAPIV3Schema"]["properties"]
    lines = [
        "### Spec fields",
        "",
        "Every field of `spec`, in camelCase as written in YAML, with its default and the rules "
        "the apiserver (schema and CEL) and `dwdp validate` enforce. An object field whose "
        "default is `(all defaults)` may be left out entirely.",
        "",
    ]
    rows: list[tuple[str, str, str, str, str]] = []
    _rows(root["spec"], "spec", rows, True)
    lines += _table(rows, ("field", "type", "default", "rules", "meaning"))
    lines += [
        "",
        "### Status fields",
        "",
        "Written by the operator through the status subresource; read them with "
        "`kubectl get dwdp NAME -o yaml`.",
        "",
    ]
    rows = []
    _rows(root["status"], "status", rows, False)
    lines += _table(
        [(p, t, d) for p, t, _dflt, _r, d in rows if p != "status"], ("field", "type", "meaning")
    )
    lines += ["", "### Columns of `kubectl get dwdp`", ""]
    cols = [
        (c["name"], c["jsonPath"], c.get("description", ""))
        for c in version.get("additionalPrinterColumns") or ()
    ]
    lines += _table(cols, ("column", "from", "meaning"))
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with the generated block between the markers replaced by ``block``.

    Raises ValueError when the markers are missing or out of order."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {BEGIN!r} ... {END!r}")
    return text[: start + len(BEGIN)] + "\n\n" + block + "\n" + text[end:]


def check(doc: Path = DEFAULT_DOC) -> bool:
    """True when ``doc``'s generated block equals what the models generate now."""
    text = doc.read_text()
    return replace_block(text, generated_reference()) == text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dwdp.api.docgen", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the block in FILE")
    mode.add_argument("--check", action="store_true", help="exit 1 if FILE's block is stale")
    p.add_argument("file", nargs="?", type=Path, default=DEFAULT_DOC)
    args = p.parse_args(argv)
    if args.write:
        args.file.write_text(replace_block(args.file.read_text(), generated_reference()))
        return 0
    if args.check:
        if check(args.file):
            return 0
        print(f"{args.file}: the field reference is stale; run python -m dwdp.api.docgen --write")
        return 1
    sys.stdout.write(generated_reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
