"""The host gate: what this host must offer before a rank joins its group and loads weights.

``dwdp worker`` runs it after the launch and checkpoint checks and before the rendezvous and
the model load, only when the launch asks for DWDP. It refuses, with the remedy in the
message (the termination message carries it):

- the cuda backend (``handleType`` ``posixFd`` or ``fabric``) on a host where torch sees no
  CUDA device;
- ``fabric`` without an IMEX channel device in ``/dev/nvidia-caps-imex-channels`` (NVIDIA's
  DRA driver mounts ``channelN`` there for a ComputeDomain claim; checked before CUDA, so
  the refusal names the missing channel rather than a driver error);
- a handle type the device cannot share (``host_check``: CUDA VMM, the handle type's driver
  attribute and a trial allocation; FABRIC refused by the driver means no IMEX channel: run
  the pods in a ComputeDomain);
- a copy operation the host cannot run: the gather kernel the copy settings name (also the
  kernel that copies this rank's own rows in every mode) must compile and load, and
  ``batched`` needs ``cuMemcpyBatchAsync`` (CUDA 12.8 or newer).

``shm`` (the cpu backend) needs nothing beyond the launch checks.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dwdp.api.enums import CopyMode, GatherKernel, HandleType
from dwdp.api.launch import LaunchConfig
from dwdp.worker.settings import CopySettings, HostInfo

log = logging.getLogger(__name__)

IMEX_CHANNEL_DIR = Path("/dev/nvidia-caps-imex-channels")
"""Where NVIDIA's DRA driver mounts the IMEX channel devices (``channel0``, ...) of a
ComputeDomain claim; a FABRIC import or export needs one of them."""


class HostGateError(RuntimeError):
    """This host cannot run the launch as configured; the message names the setting, what
    the host lacks and the remedy."""


def imex_channels(directory: Path = IMEX_CHANNEL_DIR) -> list[str]:
    """The IMEX channel devices granted to this container: the names of the character
    devices ``channelN`` in ``directory`` (sorted); ``[]`` when there is none or no folder."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return sorted(e.name for e in entries if e.name.startswith("channel") and e.is_char_device())


def probe_host(
    cfg: LaunchConfig, *, device: int, imex_dir: Path = IMEX_CHANNEL_DIR
) -> HostInfo:
    """The host facts the copy settings need, after checking that the backend the launch's
    ``handleType`` selects can run here (module docstring); ``imex_dir``: where the IMEX
    channel devices are (FABRIC only). Raises ``HostGateError``."""
    if cfg.handle_type == HandleType.SHM:
        return HostInfo(backend="cpu")
    handle = cfg.handle_type.value
    if cfg.handle_type == HandleType.FABRIC:
        channels = imex_channels(imex_dir)
        if not channels:
            raise HostGateError(
                f"handleType: {handle} needs an IMEX channel, and {imex_dir} holds no "
                "channel device (channelN); " + _remedy(cfg.handle_type)
            )
        log.info("IMEX channels granted: %s", ", ".join(channels))
    import torch

    if not torch.cuda.is_available():
        raise HostGateError(
            f"handleType: {handle} runs the cuda backend, but torch sees no CUDA device on "
            "this host; run the rank on a GPU node (NVIDIA driver and a visible GPU), or set "
            "handleType: shm for the cpu backend"
        )
    from dwdp.worker.backend.base import BackendError
    from dwdp.worker.backend.cuda import host_check
    from dwdp.worker.backend.cuda_plan import FabricNotPermittedError

    try:
        facts = host_check(cfg.handle_type, device=device)
    except FabricNotPermittedError as exc:  # its message names the ComputeDomain remedy
        raise HostGateError(str(exc)) from exc
    except BackendError as exc:
        raise HostGateError(f"{exc}; {_remedy(cfg.handle_type)}") from exc
    log.info("host check passed: %s", facts)
    major, minor = torch.cuda.get_device_capability(device)
    return HostInfo(
        backend="cuda",
        capability=(major, minor),
        sm_count=torch.cuda.get_device_properties(device).multi_processor_count,
    )


def _remedy(handle_type: HandleType) -> str:
    if handle_type == HandleType.FABRIC:
        return (
            "FABRIC handles need a multi-node NVLink system and an IMEX channel: run the pods "
            "in a ComputeDomain, or set handleType: posixFd when every rank is on one host"
        )
    return "posixFd needs CUDA VMM with POSIX fd handles (a recent NVIDIA driver)"


def check_copy_ops(settings: CopySettings, host: HostInfo, *, device: int) -> None:
    """Refuse copy operations ``host`` cannot run (module docstring); nothing to check on
    the cpu backend. Raises ``HostGateError``."""
    if host.backend != "cuda":
        return
    from cuda.bindings import driver

    if settings.copy_mode is CopyMode.BATCHED and not hasattr(driver, "cuMemcpyBatchAsync"):
        raise HostGateError(
            "dwdp.copyMode: batched needs cuMemcpyBatchAsync (CUDA 12.8 or newer), which this "
            "host's cuda-python does not provide; set copyMode: per_slice or upgrade CUDA"
        )
    import torch

    from dwdp.kernels.loader import KernelError, load_gather

    kernel = settings.gather_kernel or GatherKernel.REGISTER
    try:
        with torch.cuda.device(device):
            torch.empty(1, device=device)  # the runtime makes the primary context
            load_gather(kernel.value, device=device).close()
    except KernelError as exc:
        raise HostGateError(
            f"the {kernel.value} gather kernel cannot be loaded on cuda:{device} ({exc}); DWDP "
            "copies this rank's own rows with it in every copy mode: check the CUDA toolkit "
            "(NVRTC) of the image"
        ) from exc
