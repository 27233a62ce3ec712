"""The API's sub-commands of ``dwdp``: ``crd``, ``validate`` (DwdpDeployment manifests, or with
``--launch`` worker launch configs) and ``partition``.

Only pydantic and PyYAML are needed. User mistakes (a missing file, bad YAML, a bad
number) end as one line and exit status 1 (through ``dwdp.cli_types.UserError``); an invalid
DwdpDeployment prints one line per problem and exits 1. Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dwdp.cli_types import UserError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``crd``, ``validate`` and ``partition`` to the ``dwdp`` parser."""
    crd = subparsers.add_parser(
        "crd",
        help="print the DwdpDeployment CustomResourceDefinition (YAML)",
        description="Print the DwdpDeployment CRD generated from the dwdp.api models.",
    )
    crd.add_argument(
        "-o", "--output", metavar="FILE", help="write to FILE instead of standard output"
    )
    crd.set_defaults(func=_cmd_crd)

    validate = subparsers.add_parser(
        "validate",
        help="check a DwdpDeployment manifest (or a worker launch config)",
        description="Check every DwdpDeployment in a YAML file against the rules of the "
        "API (the same rules the CRD applies); with --launch, every worker launch config "
        "(the file DWDP_CONFIG names) against its fields and the launch rules that need no "
        "model. Exit 0 when all are valid; otherwise one line per problem and exit 1.",
    )
    validate.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="YAML file ('-': stdin)"
    )
    validate.add_argument(
        "--launch", action="store_true",
        help="FILE holds worker launch configs (dwdp worker --config), not DwdpDeployments",
    )
    validate.set_defaults(func=_cmd_validate)

    part = subparsers.add_parser(
        "partition",
        help="show the expert partition of a DWDP group",
        description="Print every rank's expert range [start, end) and the partition kind "
        "(balanced, uniform, redundant or capped).",
    )
    part.add_argument("--experts", type=int, required=True, metavar="N", help="routed experts")
    part.add_argument(
        "--dwdp-size", type=int, required=True, metavar="D", help="ranks per DWDP group"
    )
    part.add_argument(
        "--experts-per-worker",
        type=int,
        default=0,
        metavar="S",
        help="experts stored per rank (default 0: balanced with T = 0)",
    )
    part.add_argument(
        "--prefetch-experts",
        type=int,
        default=0,
        metavar="T",
        help="stride between consecutive ranks' ranges (default 0)",
    )
    part.add_argument("--json", action="store_true", help="print JSON instead of a table")
    part.set_defaults(func=_cmd_partition)


def _cmd_crd(args: argparse.Namespace) -> int:
    from dwdp.api.crd import crd_yaml

    text = crd_yaml()
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        sys.stdout.write(text)
    return 0


def _load_documents(filename: str) -> list[Any]:
    import yaml

    try:
        text = sys.stdin.read() if filename == "-" else Path(filename).read_text()
    except OSError as exc:
        raise UserError(f"cannot read {filename}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"{filename} is not a text file") from None
    try:
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise UserError(f"{filename}: invalid YAML{where}: {problem}") from None
    if not docs:
        raise UserError(f"{filename}: no YAML document in the file")
    return docs


def _cmd_validate(args: argparse.Namespace) -> int:
    filename = args.filename
    shown = "<stdin>" if filename == "-" else filename
    kind = "launch config" if args.launch else "DwdpDeployment"
    try:
        return _validate_documents(_load_documents(filename), shown, launch=args.launch)
    except RecursionError:
        message = f"{shown}: the YAML is nested too deeply to be a {kind}"
        raise UserError(message) from None


def _validate_documents(docs: list[Any], shown: str, *, launch: bool = False) -> int:
    from dwdp.api.deployment import deployment_problems

    failed = False
    for index, doc in enumerate(docs):
        label = shown if len(docs) == 1 else f"{shown} (document {index + 1})"
        problems = _launch_problems(doc) if launch else deployment_problems(doc)
        if problems:
            failed = True
            for problem in problems:
                print(f"{label}: {problem}", file=sys.stderr)
        elif launch:
            print(f"{label}: launch config of {doc['model']['path']} is valid")
        else:
            name = (doc.get("metadata") or {}).get("name") or "(generated name)"
            print(f"{label}: DwdpDeployment {name} is valid")
    return 1 if failed else 0


def _launch_problems(doc: Any) -> list[Any]:
    """Every problem of a launch config document: its fields, then (once they are valid) the
    launch rules that need no model (``launch_problems``; the worker applies the rest on its
    host)."""
    from dwdp.api.errors import Problem, all_problems
    from dwdp.api.launch import LaunchConfig, launch_problems

    if not isinstance(doc, dict):
        return [Problem((), doc, "a launch config must be a mapping of fields")]
    if doc.get("kind") == "DwdpDeployment":  # one line, not one per field it does not know
        rule = "is a DwdpDeployment, not a worker launch config: validate it without --launch"
        return [Problem(("kind",), "DwdpDeployment", rule)]
    problems = all_problems(LaunchConfig, doc)
    return problems or launch_problems(LaunchConfig.model_validate(doc, by_name=False))


def _cmd_partition(args: argparse.Namespace) -> int:
    from dwdp.api.partition import PartitionError, expert_partition

    try:
        part = expert_partition(
            args.experts,
            args.dwdp_size,
            experts_per_worker=args.experts_per_worker,
            prefetch_experts=args.prefetch_experts,
        )
    except PartitionError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(part.to_dict(), indent=2))
        return 0
    print(f"{'rank':>4}  {'start':>5}  {'end':>5}  {'count':>5}  serves")
    covered = 0  # experts below this are served by a lower rank (the owner rule)
    for rank, (start, end) in enumerate(part.ranges):
        first = max(start, covered)
        serves = f"[{first}, {end})" if first < end else "-"
        covered = max(covered, end)
        print(f"{rank:>4}  {start:>5}  {end:>5}  {end - start:>5}  {serves}")
    print(part.describe())
    return 0
