"""Enter a container's root filesystem and exec its process (the process kubelet's chroot).

Run by the container script of an image pod, inside the pod's mount namespace once the
root filesystem and the volumes are mounted: ``python -I enter.py SPEC.json``. SPEC holds
``root``, ``workdir``, ``uid``, ``gid``, ``groups``, ``env``, ``argv``, ``no_new_privs``
and ``keep_caps`` (capability names kept in the bounding set; null keeps them all). The
order is that of a container runtime: chroot, chdir, bounding set, groups, gid, uid,
no_new_privs, exec (``argv[0]`` looked up on the container's PATH inside the root).
Standard library only: the helper runs with the host's Python before the exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAPS = (
    "chown",
    "dac_override",
    "dac_read_search",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "linux_immutable",
    "net_bind_service",
    "net_broadcast",
    "net_admin",
    "net_raw",
    "ipc_lock",
    "ipc_owner",
    "sys_module",
    "sys_rawio",
    "sys_chroot",
    "sys_ptrace",
    "sys_pacct",
    "sys_admin",
    "sys_boot",
    "sys_nice",
    "sys_resource",
    "sys_time",
    "sys_tty_config",
    "mknod",
    "lease",
    "audit_write",
    "audit_control",
    "setfcap",
    "mac_override",
    "mac_admin",
    "syslog",
    "wake_alarm",
    "block_suspend",
    "audit_read",
    "perfmon",
    "bpf",
    "checkpoint_restore",
)
"""Linux capability names by number (capability.h)."""


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return len(CAPS) - 1


def main(argv: list[str]) -> int:
    """Enter the root of ``argv[1]``'s spec and exec; returns only on failure."""
    with open(argv[1]) as f:
        spec = json.load(f)
    last = _last_cap()  # read before the chroot (the root's /proc may differ)
    os.chroot(spec["root"])
    os.chdir("/")
    workdir = spec.get("workdir") or "/"
    with contextlib.suppress(OSError):  # a read-only root: the script made it beforehand
        os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    keep = spec.get("keep_caps")
    if keep is not None:
        wanted = {c.lower().removeprefix("cap_") for c in keep}
        for number in range(last + 1):
            name = CAPS[number] if number < len(CAPS) else ""
            if name not in wanted:
                _prctl(PR_CAPBSET_DROP, number)
    os.setgroups([int(g) for g in spec.get("groups") or []])
    os.setgid(int(spec["gid"]))
    os.setuid(int(spec["uid"]))
    if spec.get("no_new_privs"):
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    command = [str(a) for a in spec["argv"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    # The PATH lookup by hand: os.execvpe imports modules the root may not have.
    folders = env.get("PATH", "/usr/bin:/bin").split(":") if "/" not in command[0] else [""]
    error: OSError = FileNotFoundError(2, "No such file or directory")
    for folder in folders:
        path = os.path.join(folder, command[0]) if folder else command[0]
        try:
            os.execve(path, command, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            error = exc if not isinstance(error, PermissionError) else error
        except OSError as exc:
            error = exc
    print(f"dwdp-enter: exec {command[0]!r}: {error.strerror}", file=sys.stderr, flush=True)
    return 126 if isinstance(error, PermissionError) else 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
