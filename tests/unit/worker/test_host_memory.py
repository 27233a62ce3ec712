"""A rank's host memory budget comes from its container, not the node: cgroup v1 and v2 read
through ``/proc/self/cgroup`` and ``mountinfo`` (fake trees here, one real v1/v2 cgroup of
this host at the end), ``DWDP_MEMORY_LIMIT`` where no cgroup says, and the KV pool's refusal
naming the budget when it cannot hold one request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dwdp.api.launch import KvCacheConfig
from dwdp.worker import memory
from dwdp.worker.engine.kv_pool import KvPoolError
from dwdp.worker.host_memory import (
    CgroupLevel,
    HostBudget,
    host_budget,
    oom_cause,
    read_cgroup,
)
from dwdp_dev.worker.cgroups import memory_cgroup

GIB = 2**30
MEMINFO = "MemTotal:       25165824 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB available


def _tree(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(MEMINFO)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def test_v2_takes_the_tightest_level_and_leaves_the_page_cache_out(tmp_path) -> None:
    """A container (no limit of its own) in a pod limited to 4 GiB: the pod's limit less the
    pod's working set (usage less inactive file pages) is the budget."""
    pod, ctr = "sys/fs/cgroup/kubepods/pod1", "sys/fs/cgroup/kubepods/pod1/ctr"
    root = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", V2_MOUNT, {
        f"{ctr}/memory.max": "max\n",
        f"{ctr}/memory.current": str(GIB) + "\n",
        f"{ctr}/memory.stat": "anon 100\ninactive_file 0\n",
        f"{pod}/memory.max": str(4 * GIB) + "\n",
        f"{pod}/memory.current": str(3 * GIB // 2) + "\n",
        f"{pod}/memory.stat": f"anon 1\nactive_file 2\ninactive_file {GIB // 2}\n",
    })
    budget = host_budget(root, environ={})
    assert budget.cgroup == "v2" and budget.limit == 4 * GIB
    assert budget.working_set == GIB  # the container's own
    assert budget.available == 3 * GIB  # 4 GiB less the pod's 1 GiB working set
    assert "kubepods/pod1" in budget.limited_by and "cgroup v2" in budget.describe()


def test_v1_inside_a_container_reads_its_own_cgroup_at_the_mount_root(tmp_path) -> None:
    """Without a cgroup namespace a container's /proc/self/cgroup names the host's path while
    its memory hierarchy is mounted from that path: the files are at the mount point."""
    path = "/dwdp-node-0/kubepods/burstable/podX/c0ffee"
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755\n"
        f"35 31 0:32 {path} /sys/fs/cgroup/memory ro,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / /sys/fs/cgroup/unified ro - cgroup2 cgroup2 rw\n"
    )
    mem = "sys/fs/cgroup/memory"
    root = _tree(tmp_path, f"5:memory:{path}\n0::/\n", mountinfo, {
        f"{mem}/memory.limit_in_bytes": str(2 * GIB),
        f"{mem}/memory.usage_in_bytes": str(GIB),
        f"{mem}/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file {GIB // 4}\n",
    })
    budget = host_budget(root, environ={})
    assert budget.cgroup == "v1"  # the memory controller is on v1 beside the unified mount
    assert (budget.limit, budget.working_set) == (2 * GIB, 3 * GIB // 4)
    assert budget.available == 2 * GIB - 3 * GIB // 4


def test_v1_without_a_limit_leaves_the_host(tmp_path) -> None:
    mem = "sys/fs/cgroup/memory"
    root = _tree(tmp_path, "4:memory:/\n",
                 "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", {
                     f"{mem}/memory.limit_in_bytes": "9223372036854771712",
                     f"{mem}/memory.usage_in_bytes": str(GIB),
                 })
    budget = host_budget(root, environ={})
    assert budget.limit is None and budget.available == 20 * GIB
    assert budget.limited_by == "host MemAvailable"


def test_the_operators_limit_is_an_upper_bound_where_no_cgroup_has_a_limit() -> None:
    """Pods started as plain processes (the local cluster's process kubelet) sit in a cgroup
    of no container: its working set (everything else running there) does not count against
    ``DWDP_MEMORY_LIMIT``; a container's cgroup, with a limit of its own, does."""
    session = CgroupLevel(Path("/sys/fs/cgroup/user.slice"), None, 5 * GIB)
    shared = HostBudget(host_available=20 * GIB, levels=(session,), env_limit=6 * GIB)
    assert (shared.available, shared.limited_by) == (6 * GIB, "DWDP_MEMORY_LIMIT")
    assert "working set 5.00 GiB of a cgroup without a limit, not counted" in shared.describe()
    pod = CgroupLevel(Path("/sys/fs/cgroup/kubepods/pod"), 8 * GIB, 5 * GIB)
    contained = HostBudget(host_available=20 * GIB, levels=(pod,), env_limit=6 * GIB)
    assert (contained.available, contained.limited_by) == (1 * GIB, "DWDP_MEMORY_LIMIT")
    assert "working set 5.00 GiB, host" in contained.describe()


def test_the_operators_limit_counts_where_no_cgroup_can_be_read(tmp_path) -> None:
    root = _tree(tmp_path, "", "", {})
    assert read_cgroup(root) == ("none", ())
    budget = host_budget(root, environ={"DWDP_MEMORY_LIMIT": str(6 * GIB)})
    assert (budget.limit, budget.available, budget.limited_by) == (
        6 * GIB, 6 * GIB, "DWDP_MEMORY_LIMIT")
    for bad in ("lots", "6Gi", "-5", "0", "1e9"):
        with pytest.raises(ValueError, match=f"DWDP_MEMORY_LIMIT: '{bad}' is not a positive"):
            host_budget(root, environ={"DWDP_MEMORY_LIMIT": bad})


def _in_cgroup(limit: int) -> str:
    """What ``host_budget`` reports in a child process in a new memory cgroup of this host
    limited to ``limit`` bytes."""
    code = ("from dwdp.worker.host_memory import host_budget; "
            "b = host_budget(); print(b.limit, b.available, b.limited_by)")
    with memory_cgroup(limit, "dwdp-test") as group:
        return subprocess.run(group.join_command([sys.executable, "-c", code]), check=True,
                              capture_output=True, text=True).stdout


def test_a_real_cgroup_of_this_host_sets_the_budget() -> None:
    """The host's own memory controller: a process in a 3 GiB cgroup sees 3 GiB, less what
    it uses, as its budget, whatever the host has free."""
    if os.geteuid() != 0:
        pytest.fail("making a memory cgroup needs root (the test command runs as root)")
    limit, available, by = _in_cgroup(3 * GIB).split(maxsplit=2)
    assert int(limit) == 3 * GIB
    assert 2 * GIB < int(available) < 3 * GIB and by.startswith("cgroup")


class _Config:
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 4, 4, 2, 64

    def get_text_config(self):
        return self


class _Model:
    config, dtype = _Config(), pytest.importorskip("torch").bfloat16

    def parameters(self):
        return iter(())

    def buffers(self):
        return iter(())


class _NoDwdp:
    def status(self):
        return {}

    def buffer_ranges(self):
        return []


def test_a_pool_that_does_not_fit_the_container_is_refused_naming_the_budget(monkeypatch):
    """A pod of 2 ranks whose container may take 0.5 GiB more (the operator's 2 GiB limit
    less a 1.5 GiB working set, in a pod cgroup limited to 3 GiB): the margin kept, each
    rank's share less the vLLM staging buffer cannot hold one request of 65536 tokens (2048
    bytes each); the one-line refusal names the settings, the bytes one request needs, the
    budget and the staging buffer."""
    used = CgroupLevel(Path("/sys/fs/cgroup/pod"), 3 * GIB, 3 * GIB // 2)
    budget = HostBudget(host_available=20 * GIB, levels=(used,), env_limit=2 * GIB)
    monkeypatch.setattr(memory, "host_budget", lambda: budget)
    staging = memory.Staging(8192, "kvTransfer.vllm.stagingTokens 8192")
    with pytest.raises(KvPoolError) as err:
        memory.size_rank_memory(_Model(), _NoDwdp(), memory.MemoryWatch("cpu"),
                                kv=KvCacheConfig(), max_num_tokens=8192, max_model_len=65536,
                                host_sharers=2, staging=staging)
    line = str(err.value)
    assert "\n" not in line
    for part in ("freeMemoryFraction 0.9", "maxModelLen 65536 tokens (0.12 GiB)",
                 "host memory budget 0.50 GiB (DWDP_MEMORY_LIMIT; limit 2.00 GiB",
                 "margin of 0.25 GiB, shared by 2 ranks",
                 "staging buffer of 0.02 GiB (kvTransfer.vllm.stagingTokens 8192)"):
        assert part in line, (part, line)


def test_a_sigkill_in_a_cgroup_that_counted_an_oom_kill_is_named_oom(tmp_path) -> None:
    """What the launcher writes for a rank killed by signal 9 without a cause of its own:
    the container's limit when its cgroup counted an OOM kill, nothing otherwise."""
    mem = "sys/fs/cgroup/memory"
    files = {f"{mem}/memory.limit_in_bytes": str(3 * GIB),
             f"{mem}/memory.usage_in_bytes": str(3 * GIB),
             f"{mem}/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"}
    mount = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    root = _tree(tmp_path, "4:memory:/\n", mount, files)
    assert oom_cause(root) == ""
    (root / mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    cause = oom_cause(root)
    assert cause.startswith("OOM-killed: the container reached its memory limit of 3.00 GiB")
    assert "resources.limits.memory" in cause
