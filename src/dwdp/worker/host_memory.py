"""How much host memory this rank's container may still take: its budget on the host.

A rank sizes what it keeps on the host (the cpu backend's KV cache pool, the vLLM staging
buffer) from this budget, never from the node's free pages: inside a container
``/proc/meminfo`` is the node's, so a pod limited to 4 GiB on a 512 GiB node would size its
pool for the node and be OOM-killed once it filled it. The budget is the smallest of:

- the host's ``MemAvailable`` (the kernel's estimate of memory available to new work);
- for each cgroup from this process's own up to the root of the memory hierarchy it can see,
  with a limit: the limit less the cgroup's working set (usage less the inactive page cache
  the kernel drops before it OOM-kills: what the kubelet calls the working set). cgroup v2:
  ``memory.max`` and ``memory.current``; v1 (the memory controller of a v1 hierarchy, hybrid
  hosts included): ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``;
- ``DWDP_MEMORY_LIMIT`` (the container's limit from the downward API, where the operator
  sets it) less this container's working set when a cgroup of this branch has a limit (then
  the innermost is the container's own), else less nothing: with no cgroup limit at all the
  innermost cgroup is no container's (a session's, under a process kubelet that starts pods
  as plain processes: its working set is everything else running there), and the limit is an
  upper bound only.

The cgroup files are found through ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (a
container without a cgroup namespace sees its own cgroup at the mount's root). ``root``
arguments let tests read a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dwdp.api.contract import Env

UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded ``LONG_MAX``; anything this big is none."""


@dataclass(frozen=True, slots=True)
class CgroupLevel:
    """One cgroup of this process's branch: its directory, its limit (None: none) and its
    working set (bytes)."""

    path: Path
    limit: int | None
    working_set: int

    @property
    def headroom(self) -> int | None:
        """What this cgroup may still take before its limit (bytes, never negative); None
        without a limit."""
        return None if self.limit is None else max(0, self.limit - self.working_set)


@dataclass(frozen=True, slots=True)
class HostBudget:
    """What this process may still take on the host (module docstring).

    ``host_available``: ``MemAvailable``; ``levels``: the cgroups of this process's branch
    up to the mount's root, innermost first (empty when none can be read); ``env_limit``:
    ``DWDP_MEMORY_LIMIT`` (None when unset); ``cgroup``: ``v1``, ``v2`` or ``none``."""

    host_available: int
    levels: tuple[CgroupLevel, ...] = ()
    env_limit: int | None = None
    cgroup: str = "none"

    @property
    def limit(self) -> int | None:
        """The container's memory limit (bytes): the tightest of the cgroups' and the
        operator's; None without one."""
        limits = [lv.limit for lv in self.levels if lv.limit is not None]
        if self.env_limit is not None:
            limits.append(self.env_limit)
        return min(limits) if limits else None

    @property
    def working_set(self) -> int | None:
        """The container's working set (bytes, the innermost cgroup's); None unknown."""
        return self.levels[0].working_set if self.levels else None

    @property
    def _container_used(self) -> int:
        """What counts against ``DWDP_MEMORY_LIMIT``: the innermost cgroup's working set when
        a cgroup of the branch has a limit (a container's), else 0 (module docstring)."""
        limited = any(lv.limit is not None for lv in self.levels)
        return (self.working_set or 0) if limited else 0

    @property
    def available(self) -> int:
        """Bytes this process's container may still take: the smallest headroom."""
        candidates = [self.host_available,
                      *(lv.headroom for lv in self.levels if lv.headroom is not None)]
        if self.env_limit is not None:
            candidates.append(max(0, self.env_limit - self._container_used))
        return min(candidates)

    @property
    def limited_by(self) -> str:
        """What set ``available``: ``host``, ``cgroup <v> <path>`` or ``DWDP_MEMORY_LIMIT``."""
        best, name = self.host_available, "host MemAvailable"
        for lv in self.levels:
            if lv.headroom is not None and lv.headroom < best:
                best, name = lv.headroom, f"cgroup {self.cgroup} {lv.path}"
        if self.env_limit is not None and self.env_limit - self._container_used < best:
            name = Env.MEMORY_LIMIT.value
        return name

    def describe(self) -> str:
        """One line: the budget, what set it, the limit and the working set (GiB)."""
        limit, used = self.limit, self.working_set
        shown = "unknown" if used is None else f"{gib(used)} GiB"
        if used is not None and self.env_limit is not None and not self._container_used:
            shown += " of a cgroup without a limit, not counted"
        return (
            f"host memory budget {gib(self.available)} GiB ({self.limited_by}; limit "
            f"{'none' if limit is None else gib(limit) + ' GiB'}, working set {shown}, host "
            f"MemAvailable {gib(self.host_available)} GiB)"
        )


def gib(n: int | None) -> str:
    """Bytes as GiB with two decimals (``-`` for None), as every memory line shows them."""
    return "-" if n is None else f"{n / 2**30:.2f}"


# -- reading -----------------------------------------------------------------------------------
def mem_available(root: Path = Path("/")) -> int:
    """The kernel's ``MemAvailable`` (bytes). ``OSError`` when ``/proc/meminfo`` lacks it."""
    for line in (root / "proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


Mount = tuple[str, Path]
"""A cgroup hierarchy's mount: the cgroup at its root and where it is mounted."""


def _memory_mounts(root: Path) -> tuple[Mount | None, Mount | None]:
    """``(v1 mount, v2 mount)`` from ``/proc/self/mountinfo`` (None when absent): the v1
    hierarchy that carries the memory controller and the cgroup2 mount."""
    v1: Mount | None = None
    v2: Mount | None = None
    for line in (root / "proc/self/mountinfo").read_text().splitlines():
        left, sep, right = line.partition(" - ")
        words, tail = left.split(), right.split()
        if not sep or len(words) < 5 or len(tail) < 3:
            continue
        mount_root, point = words[3], root / words[4].lstrip("/")
        if tail[0] == "cgroup" and "memory" in tail[2].split(",") and v1 is None:
            v1 = (mount_root, point)
        elif tail[0] == "cgroup2" and v2 is None:
            v2 = (mount_root, point)
    return v1, v2


def _own_cgroups(root: Path) -> tuple[str | None, str | None]:
    """``(v1 memory cgroup path, v2 cgroup path)`` of this process (None when absent)."""
    v1 = v2 = None
    for line in (root / "proc/self/cgroup").read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif parts[0] == "0" and controllers == "":
            v2 = path
    return v1, v2


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


def read_level(here: Path, version: str) -> CgroupLevel | None:
    """Cgroup ``here`` of a ``version`` hierarchy: its limit (None: none) and working set
    (usage less the inactive page cache); None when its usage cannot be read."""
    limit_file, usage_file, inactive_key = (
        ("memory.max", "memory.current", "inactive_file")
        if version == "v2"
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    usage = _read_int(here / usage_file)
    if usage is None:
        return None
    limit = _read_int(here / limit_file)
    working = max(0, usage - _inactive_file(here / "memory.stat", inactive_key))
    return CgroupLevel(here, limit if limit is not None and limit < UNLIMITED else None, working)


def _levels(start: Path, top: Path, version: str) -> tuple[CgroupLevel, ...]:
    """The cgroups from ``start`` up to ``top`` (the mount point) whose usage is readable."""
    levels, here = [], start
    while True:
        level = read_level(here, version)
        if level is not None:
            levels.append(level)
        if here == top or top not in here.parents:
            return tuple(levels)
        here = here.parent


def _cgroup_dir(point: Path, mount_root: str, path: str) -> Path:
    """Where cgroup ``path`` is under a mount of the hierarchy's ``mount_root``."""
    rel = path
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        rel = path[len(mount_root):]
    return point / rel.lstrip("/") if rel.strip("/") else point


def read_cgroup(root: Path = Path("/")) -> tuple[str, tuple[CgroupLevel, ...]]:
    """``(version, levels)`` of this process's memory cgroup: the v1 memory controller when a
    v1 hierarchy carries it, else cgroup v2; ``("none", ())`` when neither can be read."""
    try:
        (v1_mount, v2_mount), (v1_path, v2_path) = _memory_mounts(root), _own_cgroups(root)
    except OSError:
        return "none", ()
    for version, mount, path in (("v1", v1_mount, v1_path), ("v2", v2_mount, v2_path)):
        if mount is not None and path is not None:
            mount_root, point = mount
            return version, _levels(_cgroup_dir(point, mount_root, path), point, version)
    return "none", ()


def env_limit(environ: dict[str, str] | None = None) -> int | None:
    """``DWDP_MEMORY_LIMIT`` in bytes (the downward API writes plain bytes); None when unset
    or empty. ``ValueError`` (one line naming the variable, the value and the rule) for
    anything but a positive integer."""
    text = (os.environ if environ is None else environ).get(Env.MEMORY_LIMIT, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(
            f"{Env.MEMORY_LIMIT.value}: {text!r} is not a positive number of bytes (the "
            f"container's memory limit, as the downward API writes it: 6442450944 for 6Gi)"
        )
    return int(text)


def host_budget(root: Path = Path("/"), environ: dict[str, str] | None = None) -> HostBudget:
    """This process's host memory budget, measured now (module docstring)."""
    version, levels = read_cgroup(root)
    return HostBudget(mem_available(root), levels, env_limit(environ), version)


def oom_kills(path: Path, version: str) -> int:
    """The processes of cgroup ``path`` the kernel's OOM killer has killed (0 unknown)."""
    name = "memory.oom_control" if version == "v1" else "memory.events"
    try:
        words = (path / name).read_text().split()
        return int(words[words.index("oom_kill") + 1])
    except (OSError, ValueError, IndexError):
        return 0


def oom_cause(root: Path = Path("/")) -> str:
    """Why a child of this process was SIGKILLed, when its cgroup says so: ``OOM-killed: ...``
    naming the limit, or "" when no cgroup of the branch counted an OOM kill."""
    version, levels = read_cgroup(root)
    for level in levels:
        if level.limit is not None and oom_kills(level.path, version):
            return (f"OOM-killed: the container reached its memory limit of "
                    f"{gib(level.limit)} GiB (cgroup {version} {level.path}); raise "
                    f"resources.limits.memory, or lower what the ranks take (kvCache."
                    f"freeMemoryFraction or maxTokens, ranksPerPod)")
    return ""
