"""The rank contract: what the operator tells a rank and what a rank tells the operator.

One home for every word both sides spell (docs/design.md §5):

- the environment of a worker pod (:class:`Env`): the operator sets these, the worker and the
  test rank program (``dwdp_dev.operator.rankprog``) read them;
- the phases of a rank's ``GET /dwdp/status`` answer (:class:`StatusPhase`) and the answer
  itself (:class:`RankStatus`: the worker and the rank program write it, the operator reads it);
- the first word of a rank's termination message, ``"<word>: <cause>"``, which the operator
  classifies a group failure by: the startup stages (:class:`Stage`) and the setup phases
  (:data:`DENSE_SETUP_PHASES`, :data:`EXPERT_SETUP_PHASES`).

The operator, the worker and the rank program import these; a test derives the words each
of them can emit from its code and checks they are all here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

__all__ = [
    "COMMITTED_PHASES",
    "DENSE_SETUP_PHASES",
    "ENV_DENSE_MIN_BYTES",
    "ENV_TORCH_THREADS",
    "EXPERT_SETUP_PHASES",
    "SERVING_WORDS",
    "SETUP_WORDS",
    "TERMINATION_WORDS",
    "USER_ENV",
    "Env",
    "RankIdentity",
    "RankStatus",
    "Stage",
    "StatusPhase",
    "new_start_id",
]


class Env(enum.StrEnum):
    """Environment variables of a worker pod (set by the operator, read by every rank)."""

    GROUP = "DWDP_GROUP"
    """Name of the DWDP group (context) or server (generation), e.g. ``demo-g0``."""
    INCARNATION = "DWDP_INCARNATION"
    """Incarnation of the group, decimal (``3``; the worker also reads ``i3``)."""
    RANK = "DWDP_RANK"
    """Global rank of the pod's first local rank (pod index x ranks per pod); the launcher
    gives local rank k ``DWDP_RANK + k``."""
    WORLD_SIZE = "DWDP_WORLD_SIZE"
    """Ranks in the group (equals ``dwdp.dwdpSize`` when DWDP is on)."""
    LOCAL_RANK = "DWDP_LOCAL_RANK"
    """Index of a rank within its pod (set by the launcher for each child)."""
    LOCAL_WORLD_SIZE = "DWDP_LOCAL_WORLD_SIZE"
    """Ranks in this pod (``dwdp launch`` starts one process per local rank)."""
    RENDEZVOUS = "DWDP_RENDEZVOUS"
    """``host:port`` of the store on the group's pod 0 (rank 0 hosts it)."""
    RENDEZVOUS_TIMEOUT_S = "DWDP_RENDEZVOUS_TIMEOUT_S"
    """Seconds a rank waits for its peers at the rendezvous and at each collective."""
    ROLE = "DWDP_ROLE"
    """``context`` or ``generation``."""
    REVISION = "DWDP_REVISION"
    """Revision hash of what reaches the pod; reported back in ``/dwdp/status``."""
    CONFIG = "DWDP_CONFIG"
    """Path of the launch config YAML."""
    POD_IP = "DWDP_POD_IP"
    """The pod's address (downward API ``status.podIP``); the servers bind it."""
    PORT = "DWDP_PORT"
    """HTTP port of local rank 0; local rank k serves ``DWDP_PORT + k``."""
    TERMINATION_LOG = "DWDP_TERMINATION_LOG"
    """Where to write the termination message (default ``/dev/termination-log``)."""
    API_KEY = "DWDP_API_KEY"
    """The key clients send as ``Authorization: Bearer <key>`` on ``/v1/*`` (unset or empty:
    no key). The operator fills it from the Secret ``spec.server.apiKeySecretRef`` names
    (``valueFrom.secretKeyRef``: ``kubectl describe`` shows the reference, not the key)."""
    API_KEY_FILE = "DWDP_API_KEY_FILE"
    """Path of a file holding that key (it wins over ``DWDP_API_KEY``); re-read when it
    changes, so a rotated Secret takes effect without a restart. The operator mounts the Secret
    key ``spec.server.apiKeySecretRef`` names at :data:`API_KEY_PATH` in every worker and
    router pod."""
    MEMORY_LIMIT = "DWDP_MEMORY_LIMIT"
    """The worker container's memory limit in bytes (downward API ``resourceFieldRef``
    ``limits.memory``; set only when ``spec.resources`` gives one). A rank's host memory budget
    is the smallest of this, its cgroup's limit and the host's; it matters where the cgroup
    cannot be read."""
    RENDEZVOUS_SECRET_FILE = "DWDP_RENDEZVOUS_SECRET_FILE"
    """Path of a file holding the group incarnation's rendezvous secret (at least 32 bytes,
    raw): every connection to the rendezvous store proves it knows the secret. The operator
    mounts it from a Secret of that incarnation (key ``secret``) at
    :data:`RENDEZVOUS_SECRET_PATH`; ``dwdp launch`` makes one for a local run."""


API_KEY_DIR = "/var/run/secrets/dwdp/api-key"
"""Where the operator mounts the API key's Secret in worker and router pods (read-only)."""
API_KEY_PATH = f"{API_KEY_DIR}/key"
"""The file ``DWDP_API_KEY_FILE`` names in an operator-made pod."""
RENDEZVOUS_SECRET_DIR = "/var/run/secrets/dwdp/rendezvous"
"""Where the operator mounts an incarnation's rendezvous Secret in its pods (read-only)."""
RENDEZVOUS_SECRET_KEY = "secret"
"""The key of the rendezvous Secret's data, and the file name under the mount."""
RENDEZVOUS_SECRET_PATH = f"{RENDEZVOUS_SECRET_DIR}/{RENDEZVOUS_SECRET_KEY}"
"""The file ``DWDP_RENDEZVOUS_SECRET_FILE`` names in an operator-made pod."""
RENDEZVOUS_SECRET_BYTES = 32
"""Bytes of a generated rendezvous secret (and the least a secret file may hold)."""


ENV_DENSE_MIN_BYTES = "DWDP_DENSE_MIN_BYTES"
"""Worker setting: dense storages below this many bytes stay replicated (default 1 MiB, the
reference's fixed threshold; lower it only for tiny test checkpoints)."""
ENV_TORCH_THREADS = "DWDP_TORCH_THREADS"
"""Worker setting: intra-op threads of each rank's torch (several CPU ranks per host)."""
USER_ENV: tuple[str, ...] = (ENV_DENSE_MIN_BYTES, ENV_TORCH_THREADS)
"""``DWDP_`` variables that are worker settings, not rank contract: a DwdpDeployment's
``spec.env`` may set these; every other ``DWDP_`` name is reserved for the operator."""


class StatusPhase(enum.StrEnum):
    """``phase`` of a rank's ``GET /dwdp/status`` answer.

    A worker serves HTTP only after its DWDP setup committed on every rank, so before that
    it does not answer at all (the operator reads "not reported yet").
    """

    DISABLED = "disabled"
    """The rank serves with replicated weights (DWDP off): committed trivially."""
    COMMITTED = "committed"
    """The DWDP setup committed on every rank of the group; the rank serves."""
    FAILED = "failed"
    """The engine died after the commit (a forward raised); the rank is about to exit."""
    RELEASED = "released"
    """The rank released its DWDP state (shutting down)."""


COMMITTED_PHASES = frozenset({StatusPhase.COMMITTED, StatusPhase.DISABLED})
"""Status phases that count as committed for the commit gate."""

def new_start_id() -> str:
    """A fresh start id: 16 hex characters from the system's random source."""
    import secrets

    return secrets.token_hex(8)


class Stage(enum.StrEnum):
    """Startup stages of a worker, the first word of its termination message when a stage
    fails (the setup stage is named by its phase instead, see :data:`SETUP_WORDS`)."""

    CONFIG = "config"
    """Reading the launch config and checking the launch rules."""
    CHECKPOINT = "checkpoint"
    """Checking the checkpoint headers, the adapter and the expert partition."""
    HOST = "host"
    """The host gate before the rendezvous: CUDA for the cuda backend, the handle type
    (FABRIC needs IMEX: a ComputeDomain), the copy operations and the gather kernel."""
    RENDEZVOUS = "rendezvous"
    """Joining the group (also any transport timeout while meeting the peers)."""
    LOAD = "load"
    """Loading the model."""
    SETUP = "setup"
    """DWDP setup, when the error names no phase."""
    ENGINE = "engine"
    """The engine: a forward raised after the commit."""
    SERVE = "serve"
    """The HTTP server (also what the operator infers for a serving rank that died
    without a word)."""


DENSE_SETUP_PHASES = ("P1", "P2", "P3", "P4", "P5", "P6")
"""The dense setup phases (docs/design.md §6.3), each ending in one collective."""
EXPERT_SETUP_PHASES = ("handshake", "allocate", "map", "commit")
"""The expert setup phases, each ending in one collective."""

SETUP_WORDS = frozenset({*DENSE_SETUP_PHASES, *EXPERT_SETUP_PHASES, Stage.SETUP})
"""Termination words of a failed DWDP setup."""
SERVING_WORDS = frozenset({Stage.ENGINE, Stage.SERVE})
"""Termination words of a rank that failed after the commit."""
TERMINATION_WORDS = frozenset({*Stage, *SETUP_WORDS})
"""Every first word a worker's termination message can carry."""


_PHASE_WORDS = frozenset(p.value for p in StatusPhase)


def _or_none(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A field's value, or ``None`` when it does not validate (read leniently)."""
    try:
        return handler(value)
    except ValidationError:
        return None


class RankIdentity(BaseModel):
    """Who answers ``GET /dwdp/status``: the rank process's ``start_id`` (drawn when it starts,
    :func:`new_start_id`; the operator records the ids of a group's ranks when it commits, and
    a rank answering with another id was restarted in place, so the group failed), and from the
    operator's environment its ``group``, ``incarnation`` (an integer when it is one) and
    ``revision``. A field left unset is absent from the JSON (:meth:`wire`).

    Read leniently (:meth:`RankStatus.read`): a field of the wrong type reads as unset, so
    one odd field does not hide the rest; unknown fields are kept.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    start_id: str | None = Field(default=None, strict=True, min_length=1)
    group: str | None = Field(default=None, strict=True)
    incarnation: StrictInt | StrictStr | None = None
    revision: str | None = Field(default=None, strict=True)

    @field_validator("start_id", "group", "incarnation", "revision", mode="wrap")
    @classmethod
    def _unreadable_is_unset(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _or_none(value, handler)

    def wire(self) -> dict[str, Any]:
        """The JSON object: the fields that were set (``None`` ones too), extras included."""
        return self.model_dump(mode="json", exclude_unset=True)


class RankStatus(RankIdentity):
    """The body of a rank's ``GET /dwdp/status`` (one home for its field names).

    ``phase`` (a :class:`StatusPhase` word when the operator can read it); ``rank`` and
    ``dwdp_size`` (ranks of the group); ``layout_digest`` of the dense layout (``None``
    without dense DWDP); ``leaks`` (originals alive after the commit); ``error`` (phase
    ``failed``: the engine's fatal error); ``reason`` (phase ``disabled``: why). The worker adds
    its counters (bytes, slots, memory, ``kv_transfer``) as further fields: they are kept as
    extras and not part of what the operator reads.
    """

    phase: str = Field(strict=True)
    rank: int | None = Field(default=None, strict=True)
    dwdp_size: int | None = Field(default=None, strict=True)
    layout_digest: str | None = Field(
        default=None, strict=True, validation_alias=AliasChoices("layout_digest", "layoutDigest")
    )
    leaks: int | None = Field(default=None, strict=True)
    error: str | None = Field(default=None, strict=True)
    reason: str | None = Field(default=None, strict=True)

    @field_validator(
        "rank", "dwdp_size", "layout_digest", "leaks", "error", "reason", mode="wrap"
    )
    @classmethod
    def _unreadable_status_is_unset(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _or_none(value, handler)

    @classmethod
    def build(cls, **fields: Any) -> RankStatus:
        """A status of ``fields``: the declared ones, and the writer's further counters (kept
        as extras, in the JSON as given)."""
        return cls.model_validate(fields)

    @classmethod
    def read(cls, data: object) -> RankStatus | None:
        """A rank's answer as the operator reads it; ``None`` unless it is a JSON object whose
        ``phase`` is a :class:`StatusPhase` word (not reported yet)."""
        if not isinstance(data, Mapping):
            return None
        try:
            status = cls.model_validate(dict(data))
        except ValidationError:
            return None
        return status if status.phase in _PHASE_WORDS else None

    @property
    def known_phase(self) -> StatusPhase:
        """``phase`` as the contract's word (after :meth:`read`)."""
        return StatusPhase(self.phase)

    @property
    def incarnation_number(self) -> int | None:
        """``incarnation`` as an integer (``3`` or ``"3"``), ``None`` otherwise."""
        inc = self.incarnation
        return int(inc) if inc is not None and str(inc).isdigit() else None
