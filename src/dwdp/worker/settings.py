"""The effective copy settings of one rank, resolved once from the DWDP config and the host.

:func:`resolve_copy_settings` is the only place that turns ``dwdp.copyMode``,
``dwdp.contentionOpt`` and ``dwdp.gatherKernel`` into what runs; the one frozen
:class:`CopySettings` it returns goes down to the backend and to both managers (dense and
expert), and nothing on the way defaults, coerces or re-checks them again:

- copy mode: ``copyMode`` when set; unset with ``contentionOpt`` true means ``batched`` (one
  batched, peer-interleaved copy per layer, as the seed runs it); unset otherwise
  ``per_slice``;
- gather kernel (``copyMode: gather`` only): ``gatherKernel`` or ``register``; ``tma`` on a
  device below SM90 runs the ``register`` kernel, with one WARNING;
- the gather's persistent grid in resident blocks (``gather_blocks``); the SM reserve it
  makes (the SMs those blocks hold) follows from the loaded kernel's occupancy
  (``GatherLaunch.sm_reserve``) and is reported in ``/dwdp/status``; with
  ``reserve_model_sms`` the model's persistent GEMMs leave those SMs free while DWDP is
  attached (the seed's ``set_sm_reserve``).

A setting the host cannot run (``gather`` on the cpu backend) raises
:class:`CopySettingsError` naming the field.

:func:`resolve_cuda_graphs` is the only place that turns ``engine.cudaGraphs`` into whether
the engine captures CUDA graphs of its decode-only steps (:class:`CudaGraphsError` when it
cannot).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dwdp.api.config import DwdpConfig
from dwdp.api.contract import ENV_DENSE_MIN_BYTES, ENV_TORCH_THREADS
from dwdp.api.enums import CopyMode, GatherKernel, Role
from dwdp.api.errors import Problem
from dwdp.api.support import CUDA_GRAPHS_WITH_DWDP

log = logging.getLogger(__name__)

DEFAULT_GATHER_BLOCKS = 32
"""Resident blocks of the gather's persistent grid (see bench/results for the bandwidth each
variant reaches by block count)."""

TMA_MIN_CAPABILITY = (9, 0)
"""The ``tma`` gather needs Hopper bulk copies: compute capability 9.0 or above."""

DENSE_MIN_BYTES = 1 << 20
"""Bytes: a dense storage smaller than this stays replicated (the reference's "storages under
1 MiB stay replicated"), unless ``DWDP_DENSE_MIN_BYTES`` says otherwise; the one threshold
dense setup uses."""


class CopySettingsError(ValueError):
    """A copy setting the host cannot run; the message names the field and the fix."""


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What the copy settings depend on: the backend (``"cpu"`` or ``"cuda"``) and, for
    cuda, the device's compute capability ``(major, minor)`` and SM count."""

    backend: str
    capability: tuple[int, int] | None = None
    sm_count: int | None = None


@dataclass(frozen=True, slots=True)
class CopySettings:
    """The effective copy settings (module docstring). ``gather_kernel`` is ``None`` unless
    ``copy_mode`` is gather; ``gather_blocks``: resident blocks of the gather's grid."""

    copy_mode: CopyMode = CopyMode.PER_SLICE
    gather_kernel: GatherKernel | None = None
    contention_opt: bool = False
    gather_blocks: int = DEFAULT_GATHER_BLOCKS
    reserve_model_sms: bool = False
    """Whether the model's persistent GEMM grids leave SMs free while DWDP is attached
    (``Backend.reserve_sms``; ``dwdp.smReserve`` set). Off by default: on one H200 it changed
    the 8K-token forward by under 1% and slowed the 16K one by 2%
    (``bench/results/gpu_forward-sm-reserve.txt``)."""
    sm_reserve_sms: int | None = None
    """How many SMs (``dwdp.smReserve`` as a number); ``None`` with ``reserve_model_sms``:
    the gather kernel's resident SMs (``auto``)."""
    notes: tuple[str, ...] = ()
    """The WARNING lines the resolution logged (a fallback), for the log and the tests."""


def resolve_copy_settings(dwdp: DwdpConfig, host: HostInfo) -> CopySettings:
    """The effective copy settings of ``dwdp`` on ``host`` (module docstring); logs each
    fallback once as a WARNING. Raises :class:`CopySettingsError`."""
    mode = dwdp.copy_mode
    if mode is None:
        mode = CopyMode.BATCHED if dwdp.contention_opt else CopyMode.PER_SLICE
    reserve = _sm_reserve(dwdp, host)
    if mode is not CopyMode.GATHER:
        return CopySettings(copy_mode=mode, contention_opt=dwdp.contention_opt, **reserve)
    if host.backend != "cuda":
        raise CopySettingsError(
            "dwdp.copyMode: gather needs a CUDA gather kernel; the cpu backend (handleType "
            "shm) runs per_slice or batched"
        )
    kernel = dwdp.gather_kernel or GatherKernel.REGISTER
    notes: tuple[str, ...] = ()
    if (
        kernel is GatherKernel.TMA
        and host.capability is not None
        and host.capability < TMA_MIN_CAPABILITY
    ):
        major, minor = host.capability
        note = (
            f"dwdp.gatherKernel: tma needs SM90 or newer; this device is sm_{major}{minor}, "
            "so the register gather kernel runs instead"
        )
        log.warning("%s", note)
        kernel, notes = GatherKernel.REGISTER, (note,)
    return CopySettings(
        copy_mode=mode,
        gather_kernel=kernel,
        contention_opt=dwdp.contention_opt,
        notes=notes,
        **reserve,
    )


def _sm_reserve(dwdp: DwdpConfig, host: HostInfo) -> dict[str, Any]:
    """The ``reserve_model_sms`` / ``sm_reserve_sms`` fields of ``dwdp.smReserve`` on
    ``host``. Raises :class:`CopySettingsError` on the cpu backend (no SMs) or for a number
    that leaves the model no SM."""
    reserve = dwdp.sm_reserve
    if reserve is None:
        return {}
    if host.backend != "cuda":
        raise CopySettingsError(
            f"dwdp.smReserve: {reserve!r} needs a CUDA device; the cpu backend (handleType "
            "shm) has no SMs to reserve; leave it unset"
        )
    if isinstance(reserve, int) and host.sm_count is not None and reserve >= host.sm_count:
        raise CopySettingsError(
            f"dwdp.smReserve: {reserve} SMs leave none of this device's {host.sm_count} to "
            f"the model; give at most {host.sm_count - 1}"
        )
    return {"reserve_model_sms": True,
            "sm_reserve_sms": reserve if isinstance(reserve, int) else None}


class WorkerEnvError(ValueError):
    """A worker setting from the environment (``api.contract.USER_ENV``) that is not what
    its variable takes; the message names the variable and the value."""


def _env_int(environ: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    """The ASCII decimal integer >= ``minimum`` in ``environ[name]``; None when unset or
    blank. Raises :class:`WorkerEnvError`."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if re.fullmatch(r"[0-9]+", text) is None or int(text) < minimum:
        raise WorkerEnvError(f"{name}: {text!r} is not an integer >= {minimum}")
    return int(text)


def resolve_dense_min_bytes(environ: Mapping[str, str]) -> int:
    """Dense storages below this many bytes stay replicated (``DWDP_DENSE_MIN_BYTES``, bytes;
    default ``DENSE_MIN_BYTES`` = 1 MiB, the reference's). Raises :class:`WorkerEnvError`."""
    value = _env_int(environ, ENV_DENSE_MIN_BYTES, minimum=0)
    return DENSE_MIN_BYTES if value is None else value


def resolve_torch_threads(environ: Mapping[str, str]) -> int | None:
    """Intra-op threads of this rank's torch (``DWDP_TORCH_THREADS``, >= 1); None: torch's
    default. Raises :class:`WorkerEnvError`."""
    return _env_int(environ, ENV_TORCH_THREADS, minimum=1)


class CudaGraphsError(ValueError):
    """``engine.cudaGraphs: true`` on a rank that cannot capture graphs; the message names
    the field, the value and why (one line)."""


def resolve_cuda_graphs(
    setting: bool | None, *, role: Role | None, device: str, dwdp_enabled: bool,
) -> bool:
    """Whether this rank captures CUDA graphs of its decode-only steps.

    Args:
        setting: ``engine.cudaGraphs`` (None: unset).
        role: the resolved role.
        device: where the model runs (``cpu`` or ``cuda:N``).
        dwdp_enabled: DWDP is on (``dwdp.api.launch.dwdp_active``): the prefetch schedule
            runs host hooks around every MoE layer.

    Unset: on for a generation server on CUDA without DWDP, off otherwise;
    false: off; true: on.

    Raises:
        CudaGraphsError: true with DWDP on (the words of the API's refusal,
            ``dwdp.api.support.CUDA_GRAPHS_WITH_DWDP``), or true off CUDA.
    """
    on_cuda = device.startswith("cuda")
    if setting is None:
        return role is Role.GENERATION and on_cuda and not dwdp_enabled
    if not setting:
        return False
    limit = CUDA_GRAPHS_WITH_DWDP
    if dwdp_enabled:
        raise CudaGraphsError(str(Problem(limit.path, True, limit.rule)))
    if not on_cuda:
        rule = (
            f"CUDA graphs need a CUDA device; this rank runs on {device}; leave it unset or "
            "false"
        )
        raise CudaGraphsError(str(Problem(limit.path, True, rule)))
    return True
