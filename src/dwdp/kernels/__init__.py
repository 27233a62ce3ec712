"""dwdp.kernels: the DWDP gather kernels (CUDA C sources, NVRTC-built at run time).

``gather_register.cu`` and ``gather_tma.cu`` copy a whole layer per launch from a
device table of ``(src, dst offset, bytes)`` descriptors (``table``); ``loader`` compiles,
caches and launches them. Importing this package needs neither CUDA nor torch.
"""

from dwdp.kernels.loader import (
    VARIANTS,
    GatherConfig,
    GatherModule,
    KernelError,
    compile_cubin,
    load_gather,
)
from dwdp.kernels.table import GatherEntry, GatherTableError, PackedTable, pack_table

__all__ = [
    "VARIANTS",
    "GatherConfig",
    "GatherEntry",
    "GatherModule",
    "GatherTableError",
    "KernelError",
    "PackedTable",
    "compile_cubin",
    "load_gather",
    "pack_table",
]
