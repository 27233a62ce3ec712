"""The revision of a role: a short hash of everything that reaches its pods, nothing else.

Invariant: two specs that differ only in what never reaches a rank (replica counts, rollout
and failure policy, status) have the same revision, so scaling never rolls a group; any
change of the launch config, image, command, environment, resources, placement or ports
gives a new one. The input is the role's pod template (:func:`dwdp.operator.builders.
role_template`) after defaulting, never the whole object.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["REVISION_LENGTH", "revision_of", "stable_hash"]

REVISION_LENGTH = 10
"""Hex characters of a revision (40 bits: collisions among one deployment's revisions are
negligible, and the value fits a label)."""


def stable_hash(value: Any, length: int = 16) -> str:
    """Hex SHA-256 prefix of ``value``'s canonical JSON (sorted keys, no spaces).

    Raises:
        TypeError: when ``value`` holds something JSON cannot encode.
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def revision_of(template: dict[str, Any]) -> str:
    """The revision label of a role whose pod template is ``template``."""
    return stable_hash(template, REVISION_LENGTH)
