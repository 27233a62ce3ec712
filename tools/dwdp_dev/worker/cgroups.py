"""Memory cgroups of this host for tests and benches: a container's memory limit without a
container (``resources.limits.memory`` is a memory cgroup's limit). Needs root and a writable
cgroup filesystem; the memory controller of a v1 hierarchy where one has it (hybrid hosts),
else cgroup v2."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dwdp.worker.host_memory import oom_kills, read_cgroup, read_level


@dataclass(frozen=True, slots=True)
class MemoryCgroup:
    """A memory cgroup made here: ``version`` (``v1``/``v2``) and its directory."""

    version: str
    path: Path

    def join_command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this cgroup (a shell joins it, then becomes ``cmd``)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]

    def peak(self) -> int:
        """The cgroup's peak usage so far (bytes)."""
        name = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        return int((self.path / name).read_text())

    def working_set(self) -> int:
        """Usage less the inactive page cache the kernel drops first (bytes): what is left
        when the cgroup is at its limit and the kernel reclaims (the kubelet's measure)."""
        level = read_level(self.path, self.version)
        assert level is not None, f"{self.path}: no memory usage"
        return level.working_set

    def oom_kills(self) -> int:
        """Processes of this cgroup the kernel's OOM killer killed so far."""
        return oom_kills(self.path, self.version)


@contextlib.contextmanager
def memory_cgroup(limit: int, prefix: str = "dwdp") -> Iterator[MemoryCgroup]:
    """A new memory cgroup limited to ``limit`` bytes, removed (once its last process left,
    within 10 s) at the end."""
    version, _ = read_cgroup()
    base = Path("/sys/fs/cgroup/memory") if version == "v1" else Path("/sys/fs/cgroup")
    group = MemoryCgroup(version, base / f"{prefix}-{uuid.uuid4().hex[:8]}")
    group.path.mkdir()
    try:
        name = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        (group.path / name).write_text(str(limit))
        yield group
    finally:
        for _ in range(100):
            try:
                group.path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
