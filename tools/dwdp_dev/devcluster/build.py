"""Builds the Go multi-call binary of the local control plane, cached by a hash of its inputs.

The binary (subcommands ``etcd``, ``apiserver``, ``controller-manager``, ``scheduler``,
``kubelet``, ``kube-proxy`` (the real node's, :mod:`dwdp_dev.devcluster.realnode`),
``version``) is built from ``tools/devcluster/go`` with ``go build`` into
``<cache>/bin/devcluster-<hash>``, where the hash covers go.mod, go.sum, the Go sources, the
linker flags and the Go version. While those are unchanged the cached binary is reused, also
by a fresh clone. A file lock keeps two concurrent builds from racing. The real node's pod
sandbox process (``go/pause``, static, standard library only) and its DNS server
(``go/coredns``, a module of its own) are built the same way into ``<cache>/bin/pause-<hash>``
and ``<cache>/bin/coredns-<hash>`` by :func:`build_pause` and :func:`build_coredns`, only when
a real node is asked for; umoci (``go/umoci``), which the image store uses, by
:func:`build_umoci`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dwdp_dev.devcluster import paths


class BuildError(RuntimeError):
    """The binary could not be built (no Go toolchain, or ``go build`` failed)."""


def kubernetes_version() -> str:
    """Return the pinned ``k8s.io/kubernetes`` release of the wrapper module, e.g. ``v1.37.2``.

    Raises BuildError if go.mod does not pin it.
    """
    text = (paths.GO_DIR / "go.mod").read_text()
    match = re.search(r"^\s*k8s\.io/kubernetes\s+(v\S+)", text, re.MULTILINE)
    if not match:
        raise BuildError(f"{paths.GO_DIR / 'go.mod'} does not require k8s.io/kubernetes")
    return match.group(1)


def _ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return " ".join(
        [
            "-s",
            "-w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    )


def _go() -> str:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if not go:
        raise BuildError("no Go toolchain on PATH (need Go >= 1.26 to build the control plane)")
    return go


def _go_version(go: str) -> str:
    out = subprocess.run([go, "version"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def input_hash(go: str | None = None) -> str:
    """Return the hex digest (16 chars) of everything the binary is built from."""
    go = go or _go()
    h = hashlib.sha256()
    for path in sorted(paths.GO_DIR.iterdir()):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(_ldflags(kubernetes_version()).encode())
    h.update(_go_version(go).encode())
    h.update(os.environ.get("GOTOOLCHAIN", "").encode())
    return h.hexdigest()[:16]


def binary_path(go: str | None = None) -> Path:
    """Return where the binary for the current inputs lives (it may not exist yet)."""
    return paths.cache_dir() / "bin" / f"devcluster-{input_hash(go)}"


def find_binary() -> Path | None:
    """Return the built binary for the current inputs, or None if it is not built.

    ``$DWDP_DEVCLUSTER_BIN`` overrides the lookup (a binary built elsewhere).
    """
    env = os.environ.get("DWDP_DEVCLUSTER_BIN")
    if env:
        return Path(env)
    try:
        path = binary_path()
    except BuildError:
        return None
    return path if path.is_file() else None


def build(verbose: bool = False) -> Path:
    """Build the binary if its inputs changed; return its path.

    Output of ``go build`` goes to ``<cache>/bin/build.log``. A cold build takes many
    minutes and a few GiB of memory; a cached one returns at once.
    Raises BuildError if there is no Go toolchain or the build fails.
    """
    env_bin = os.environ.get("DWDP_DEVCLUSTER_BIN")
    if env_bin:
        return Path(env_bin)
    try:
        go = _go()
    except BuildError:
        # No Go here: a binary built earlier (the newest in the cache) still serves.
        cached = sorted(
            (paths.cache_dir() / "bin").glob("devcluster-*"), key=lambda p: p.stat().st_mtime
        )
        cached = [p for p in cached if ".tmp" not in p.name]
        if cached:
            return cached[-1]
        raise
    target = binary_path(go)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # built by whoever held the lock
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        log = target.parent / "build.log"
        cmd = [
            go,
            "build",
            "-trimpath",
            "-ldflags",
            _ldflags(kubernetes_version()),
            "-o",
            str(tmp),
            ".",
        ]
        start = time.monotonic()
        print(
            f"dwdp dev: building the control plane with {go} (first build about 11 minutes "
            f"and 3 GB of memory on 2 cores; log {log})",
            file=sys.stderr,
            flush=True,
        )
        with open(log, "w") as out:
            out.write(" ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.run(
                cmd,
                cwd=paths.GO_DIR,
                stdout=None if verbose else out,
                stderr=subprocess.STDOUT if not verbose else None,
                check=False,
            )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = log.read_text()[-2000:] if not verbose else ""
            raise BuildError(f"go build failed (exit {proc.returncode}); see {log}\n{tail}")
        os.replace(tmp, target)
        for old in target.parent.glob("devcluster-*"):
            if old != target and ".tmp" not in old.name:
                old.unlink(missing_ok=True)
        with open(log, "a") as out:
            out.write(f"built {target} in {time.monotonic() - start:.0f} s\n")
    return target


def build_pause() -> Path:
    """Build the static pod-sandbox binary of the real node (``go/pause``) if its source
    changed; return its path (``<cache>/bin/pause-<hash>``, a few seconds to build).

    Raises BuildError if there is no Go toolchain and none is cached, or the build fails.
    """
    return _build_small("pause", paths.GO_DIR, "./pause", [paths.GO_DIR / "pause" / "main.go"])


def build_coredns() -> Path:
    """Build the real node's DNS server (``go/coredns``: CoreDNS with the plugins the local
    cluster uses, a Go module of its own) if its inputs changed; return its path
    (``<cache>/bin/coredns-<hash>``; about 2 minutes the first time, most of it fetching
    modules from the Go module proxy).

    Raises BuildError if there is no Go toolchain and none is cached, or the build fails.
    """
    module = paths.GO_DIR / "coredns"
    return _build_small(
        "coredns", module, ".", [module / n for n in ("main.go", "go.mod", "go.sum")]
    )


def build_umoci() -> Path:
    """Build umoci v0.6.0 (``go/umoci``: a module whose ``tool`` is umoci's command, pinned by
    its go.mod and go.sum) if its inputs changed; return its path (``<cache>/bin/umoci-<hash>``;
    seconds, after fetching its modules from the Go module proxy). The image store's layouts
    are made and unpacked with it: Debian bookworm's umoci 0.4.7 cannot read zstd layers.

    Raises BuildError if there is no Go toolchain and none is cached, or the build fails.
    """
    module = paths.GO_DIR / "umoci"
    return _build_small("umoci", module, "github.com/opencontainers/umoci/cmd/umoci",
                        [module / n for n in ("go.mod", "go.sum")])


def _build_small(name: str, cwd: Path, package: str, sources: list[Path]) -> Path:
    """Build the static binary ``name`` of ``package`` (relative to ``cwd``) into
    ``<cache>/bin/<name>-<hash>``, the hash covering ``sources`` and the Go version; reuse
    it while they are unchanged, and remove older builds of ``name``. Without a Go
    toolchain the newest cached build serves. Raises BuildError."""
    bin_dir = paths.cache_dir() / "bin"
    try:
        go = _go()
    except BuildError:
        cached = sorted(bin_dir.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        cached = [p for p in cached if ".tmp" not in p.name]
        if cached:
            return cached[-1]
        raise
    h = hashlib.sha256()
    for src in sources:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(_go_version(go).encode())
    target = bin_dir / f"{name}-{h.hexdigest()[:16]}"
    if target.is_file():
        return target
    bin_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    proc = subprocess.run(
        [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(tmp), package],
        cwd=cwd,
        env={**os.environ, "CGO_ENABLED": "0"},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(
            f"go build of {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    os.replace(tmp, target)
    for old in bin_dir.glob(f"{name}-*"):
        if old != target and ".tmp" not in old.name:
            old.unlink(missing_ok=True)
    return target
