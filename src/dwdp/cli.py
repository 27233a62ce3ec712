"""The ``dwdp`` command line: one entry point, sub-commands contributed by the sub-packages.

The product's sub-packages are listed in :data:`COMMAND_MODULES`; an installed distribution may
add its own through the entry-point group ``dwdp.commands`` (the development distribution
``dwdp-dev`` adds ``dwdp dev`` and ``dwdp testing`` that way, so the product wheel names no
development module). Each contributing module exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func`` (``args -> int`` exit status) on each; what they share with this
module (``UserError``, ``port_number``) is ``dwdp.cli_types``, below both. Contributing modules keep
their top-level imports light (no torch, no kopf): heavy imports happen inside ``func``, so
``dwdp validate`` works where only pydantic and PyYAML are installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from dwdp import __version__
from dwdp.cli_types import UserError

# Modules that contribute sub-commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "dwdp.api.cli",
    "dwdp.worker.cli",
    "dwdp.operator.cli",
)

#: The entry-point group through which other distributions contribute sub-command modules.
COMMAND_ENTRY_POINTS = "dwdp.commands"


def _command_modules() -> list[str]:
    """The product's command modules, then those installed distributions declare."""
    from importlib.metadata import entry_points

    extra = sorted(ep.value for ep in entry_points(group=COMMAND_ENTRY_POINTS))
    return [*COMMAND_MODULES, *(name for name in extra if name not in COMMAND_MODULES)]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="dwdp",
        description="DWDP for mixture-of-experts inference: operator, worker and tools.",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default INFO)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that part of the project is not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dwdp`` command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe raises here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        # the reader left (``dwdp partition ... | head``): as a shell tool does, stop quietly;
        # what is still buffered goes to /dev/null, so the exit's flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the status a shell shows for a tool a pipe ended
    except UserError as exc:
        print(f"dwdp {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
