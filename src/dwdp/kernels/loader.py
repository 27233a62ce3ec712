"""Build, cache and launch the gather kernels (docs/design.md §6.6).

The CUDA C sources beside this module are compiled at run time with NVRTC
(``cuda.bindings.nvrtc``) to a cubin for the device's architecture (``sm_90`` on H200),
cached on disk under ``$DWDP_KERNEL_CACHE`` or ``$XDG_CACHE_HOME/dwdp/kernels``, keyed by a hash
of every source byte, the compile options, the NVRTC version and the architecture, and
loaded into the current CUDA context. A cubin (not PTX) is loaded so that a newer NVRTC
than the driver's own CUDA version works (minor-version compatibility).

Nothing here synchronizes the device: ``GatherModule.launch`` only enqueues.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent
"""Folder of the ``.cu``/``.cuh`` sources."""

VARIANTS = ("register", "tma")
"""Gather variants, spelled as ``dwdp.api.enums.GatherKernel`` values."""

_HEADERS = ("gather_common.cuh",)


class KernelError(RuntimeError):
    """A gather kernel could not be built, loaded or launched; the message says why."""


@dataclass(frozen=True, slots=True)
class GatherConfig:
    """Compile-time shape of one gather variant.

    ``threads`` per block, ``chunk_bytes`` of work per chunk (a multiple of 16; the TMA
    stage size), ``unroll`` 16-byte loads in flight per thread (register) and ``stages``
    shared-memory stages (tma).
    """

    variant: str
    threads: int
    chunk_bytes: int
    unroll: int = 0
    stages: int = 0
    store_cs: bool = False
    store_lag: int = 1
    l2_prefetch: bool = False
    evict_first: bool = False

    @classmethod
    def default(cls, variant: str) -> GatherConfig:
        """The shipped configuration of ``variant`` ("register" or "tma")."""
        # Chosen by bench/gather.py --sweep on H200 (bench/results/gather-sweep*.txt): the
        # register shape with streaming stores reads fastest with every SM; the TMA shape
        # with two stores in flight holds up best at half the SMs.
        if variant == "register":
            return cls("register", threads=512, chunk_bytes=512 * 16 * 8, unroll=8, store_cs=True)
        if variant == "tma":
            return cls("tma", threads=128, chunk_bytes=48 * 1024, stages=4, store_lag=2)
        raise KernelError(f"unknown gather kernel {variant!r}; expected one of {VARIANTS}")

    @property
    def entry(self) -> str:
        """The kernel's symbol name."""
        return f"dwdp_gather_{self.variant}"

    @property
    def source_file(self) -> str:
        """The ``.cu`` file of the variant."""
        return f"gather_{self.variant}.cu"

    @property
    def dynamic_smem(self) -> int:
        """Dynamic shared memory per block in bytes (stages plus one mbarrier each)."""
        return self.stages * self.chunk_bytes + 8 * self.stages if self.variant == "tma" else 0

    def defines(self) -> dict[str, int]:
        """The ``-D`` macros that set this shape in the source."""
        out = {"DWDP_THREADS": self.threads, "DWDP_CHUNK": self.chunk_bytes}
        if self.variant == "register":
            out["DWDP_UNROLL"] = self.unroll
            out["DWDP_STORE_CS"] = int(self.store_cs)
            out["DWDP_L2_PREFETCH"] = int(self.l2_prefetch)
        else:
            out["DWDP_STAGES"] = self.stages
            out["DWDP_STORE_LAG"] = self.store_lag
            out["DWDP_EVICT_FIRST"] = int(self.evict_first)
        return out

    def validate(self) -> None:
        """Raise ``KernelError`` for a shape the kernels cannot run."""
        if self.variant not in VARIANTS:
            raise KernelError(f"unknown gather kernel {self.variant!r}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 16:
            raise KernelError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of 16")
        if not 32 <= self.threads <= 1024 or self.threads % 32:
            raise KernelError(f"threads={self.threads} must be a multiple of 32 in [32, 1024]")
        if self.variant == "tma":
            if not 2 <= self.stages <= 16:
                raise KernelError(f"stages={self.stages} must be in [2, 16]")
            if not 1 <= self.store_lag < self.stages:
                raise KernelError(f"store_lag={self.store_lag} must be in [1, stages - 1]")
            if self.chunk_bytes >= 1 << 20:
                raise KernelError("a TMA stage must stay below 1 MiB (mbarrier tx count)")
        elif self.unroll < 1:
            raise KernelError(f"unroll={self.unroll} must be >= 1")


def read_sources(config: GatherConfig) -> tuple[str, dict[str, str]]:
    """The variant's main source and the headers it includes, as text."""
    main = (KERNEL_DIR / config.source_file).read_text()
    headers = {name: (KERNEL_DIR / name).read_text() for name in _HEADERS}
    return main, headers


def compile_options(config: GatherConfig, arch: str) -> list[str]:
    """NVRTC options: a cubin for ``arch`` (e.g. ``"sm_90"``) with the config's macros."""
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--use_fast_math"]
    opts += [f"-D{k}={v}" for k, v in sorted(config.defines().items())]
    return opts


def cache_key(
    main: str, headers: Mapping[str, str], options: Sequence[str], arch: str, compiler: str
) -> str:
    """Hex digest naming one cubin: every source byte, option, the compiler and the arch.

    A change to any of them gives another key, so a stale cubin is never loaded.
    """
    h = hashlib.sha256()
    for part in (compiler, arch, *options, main):
        h.update(part.encode())
        h.update(b"\0")
    for name in sorted(headers):
        h.update(name.encode())
        h.update(b"\0")
        h.update(headers[name].encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    """``$DWDP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/dwdp/kernels``, else
    ``~/.cache/dwdp/kernels`` (an operator-made pod, whose root filesystem is read-only,
    sets ``XDG_CACHE_HOME`` to a folder of its writable ``/tmp`` volume)."""
    env = os.environ.get("DWDP_KERNEL_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dwdp" / "kernels"


def cache_path(config: GatherConfig, arch: str, key: str) -> Path:
    """Where the cubin of ``config`` for ``arch`` with ``key`` is kept."""
    return cache_dir() / f"{config.entry}-{arch}-{key}.cubin"


def _nvrtc_check(result, prog=None) -> None:
    from cuda.bindings import nvrtc

    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = ""
        if prog is not None:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.decode(errors="replace")
        raise KernelError(f"NVRTC failed: {err.name}\n{log}")


def nvrtc_version() -> str:
    """``"major.minor"`` of the NVRTC library in use."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _nvrtc_check(err)
    return f"{major}.{minor}"


def compile_cubin(config: GatherConfig, arch: str) -> tuple[bytes, Path, bool]:
    """The cubin of ``config`` for ``arch``: from the disk cache, else compiled with NVRTC
    and stored (written to a temporary file and renamed, so concurrent ranks are safe).

    Returns ``(cubin, path, from_cache)``. Raises ``KernelError`` on a compile error.
    """
    from cuda.bindings import nvrtc

    config.validate()
    main, headers = read_sources(config)
    options = compile_options(config, arch)
    key = cache_key(main, headers, options, arch, f"nvrtc-{nvrtc_version()}")
    path = cache_path(config, arch, key)
    if path.is_file():
        return path.read_bytes(), path, True
    names = sorted(headers)
    err, prog = nvrtc.nvrtcCreateProgram(
        main.encode(),
        config.source_file.encode(),
        len(names),
        [headers[n].encode() for n in names],
        [n.encode() for n in names],
    )
    _nvrtc_check(err)
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        _nvrtc_check(res, prog)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_check(err)
        cubin = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the kernel still runs, compiled each start
        log.warning("kernel cache %s not writable (%s); set DWDP_KERNEL_CACHE", path.parent, exc)
    return cubin, path, False


def _cu_check(result, what: str):
    from cuda.bindings import driver

    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise KernelError(f"{what} failed: {name.decode() if name else err}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def device_arch(device: int) -> tuple[str, int]:
    """``("sm_XY", multiprocessor count)`` of CUDA device ``device`` (driver API)."""
    from cuda.bindings import driver

    _cu_check(driver.cuInit(0), "cuInit")
    dev = _cu_check(driver.cuDeviceGet(device), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = _cu_check(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc"
    )
    minor = _cu_check(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc"
    )
    sms = _cu_check(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "sms"
    )
    return f"sm_{major}{minor}", int(sms)


class GatherModule:
    """One gather variant loaded into the current CUDA context.

    ``launch`` enqueues one gather of a whole packed table on a stream; it never waits.
    Build with ``load_gather``. ``close`` unloads the module (after the device is done
    with its launches: teardown only).
    """

    def __init__(self, config: GatherConfig, arch: str, cubin: bytes, from_cache: bool) -> None:
        from cuda.bindings import driver

        self.config = config
        self.arch = arch
        self.from_cache = from_cache
        self._module = _cu_check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._func = _cu_check(
            driver.cuModuleGetFunction(self._module, config.entry.encode()), "cuModuleGetFunction"
        )
        if config.dynamic_smem > 48 * 1024:
            _cu_check(
                driver.cuFuncSetAttribute(
                    self._func,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    config.dynamic_smem,
                ),
                "cuFuncSetAttribute(max dynamic shared memory)",
            )
        # Kernel parameters, packed once; launch() only rewrites the values.
        self._table = ctypes.c_uint64(0)
        self._n_desc = ctypes.c_int32(0)
        self._total = ctypes.c_uint64(0)
        self._dst = ctypes.c_uint64(0)
        self._params = (ctypes.c_void_p * 4)(
            *(ctypes.addressof(v) for v in (self._table, self._n_desc, self._total, self._dst))
        )

    def max_blocks_per_sm(self) -> int:
        """Blocks of this kernel one SM can hold (occupancy)."""
        from cuda.bindings import driver

        return int(
            _cu_check(
                driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    self._func, self.config.threads, self.config.dynamic_smem
                ),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )

    def launch(
        self,
        *,
        table_ptr: int,
        rows: int,
        total_chunks: int,
        dst_base: int,
        blocks: int,
        stream: int,
    ) -> None:
        """Enqueue one gather on CUDA stream handle ``stream`` (an int, 0 = legacy).

        ``table_ptr``: device address of ``rows`` packed rows (``dwdp.kernels.table``),
        built with this module's ``config.chunk_bytes``; ``dst_base``: device address the
        rows' ``dst`` offsets start from; ``blocks``: resident blocks (the SM reserve).
        Raises ``KernelError`` if the launch is refused.
        """
        from cuda.bindings import driver

        if rows == 0 or total_chunks == 0:
            return
        if blocks < 1:
            raise KernelError(f"blocks={blocks} must be >= 1")
        self._table.value = table_ptr
        self._n_desc.value = rows
        self._total.value = total_chunks
        self._dst.value = dst_base
        _cu_check(
            driver.cuLaunchKernel(
                self._func,
                blocks,
                1,
                1,
                self.config.threads,
                1,
                1,
                self.config.dynamic_smem,
                driver.CUstream(stream),
                ctypes.addressof(self._params),
                0,
            ),
            f"cuLaunchKernel({self.config.entry})",
        )

    def close(self) -> None:
        """Unload the module; safe to call twice."""
        from cuda.bindings import driver

        if self._module is not None:
            driver.cuModuleUnload(self._module)
            self._module = None


def load_gather(
    variant: str, *, device: int = 0, config: GatherConfig | None = None
) -> GatherModule:
    """Build (or take from the cache) and load the ``variant`` gather for ``device``.

    Needs a current CUDA context on ``device`` (e.g. after ``torch.cuda.init()``). Raises
    ``KernelError`` for an unknown variant, a ``tma`` gather on a device older than sm_90,
    or a compile/load failure.
    """
    config = config or GatherConfig.default(variant)
    config.validate()
    arch, _ = device_arch(device)
    if config.variant == "tma" and int(arch[3:]) < 90:
        raise KernelError(f"the tma gather needs sm_90 or newer; device {device} is {arch}")
    cubin, _, from_cache = compile_cubin(config, arch)
    return GatherModule(config, arch, cubin, from_cache)
