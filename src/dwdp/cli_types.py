"""What every command module of ``dwdp`` shares with the command line: the user's error and
the option types.

A leaf: the command modules (``dwdp.api.cli``, ``dwdp.worker.cli``, ``dwdp.operator.cli`` and
those other distributions contribute) import it, and ``dwdp.cli``, which imports them, catches
:class:`UserError`.
"""

from __future__ import annotations

import argparse


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit status 1."""


def port_number(text: str) -> int:
    """argparse type of a TCP port option: an integer from 1 to 65535; else argparse's usage
    error naming the option and the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port (an integer, 1 to 65535)") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1 to 65535)")
    return value
