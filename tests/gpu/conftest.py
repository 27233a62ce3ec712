"""GPU tests: CUDA devices only (marked ``gpu`` by folder); every test here skips, with
the reason, where torch sees no CUDA device or cuda-python is missing."""

from __future__ import annotations

import pytest


def cuda_reason() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings) is not installed"
    return None


@pytest.fixture(scope="session", autouse=True)
def _needs_cuda():
    reason = cuda_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def backend():
    """A CudaBackend on device 0, closed after the test."""
    from dwdp.worker.backend.cuda import CudaBackend

    b = CudaBackend(device=0)
    yield b
    b.close()
