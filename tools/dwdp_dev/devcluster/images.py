"""Daemonless, cached image builds and the local OCI image store of the process kubelet.

``build_image("operator")`` builds ``images/operator/Dockerfile`` without a container
engine daemon:

1. a Debian base (``debootstrap --variant=minbase`` of :data:`BASE_SUITE` with Python) made
   into an OCI image layout with ``umoci`` (``<store>/base/<suite>-<hash>``, built once);
2. ``buildah build`` (vfs storage and chroot isolation in a private storage root, so it works
   as root in a container without overlayfs or user namespaces) of the Dockerfile with
   ``PYTHON_IMAGE`` set to that base, pushed as an OCI layout to
   ``<store>/oci/dwdp-<name>-<hash>`` and named in ``<store>/refs.json`` by its reference
   (``ghcr.io/dwdp/dwdp-<name>:<version>``, what the chart renders by default).

An image whose Dockerfile has a ``runtime`` stage (everything but the product: base, system
packages, the dependencies) and a ``product`` stage (the dwdp package's files alone, staged in
``/product``), as the operator's and the worker's have, is built in layers: the runtime is built
once per :func:`runtime_hash` (the Dockerfile, the constraints, images/requirements.py and
pyproject.toml's dependency lists; not the sources) into ``<store>/runtime/`` (the
:data:`RUNTIMES_KEPT` most recently used per name are kept); the product stage is built once
per :func:`product_hash` (its instructions and what it copies: the same for the operator and
the worker, so one build serves both) into ``<store>/product/<hash>.tar``; and the image is a
hard-linked copy of the runtime's layout plus that tar as one layer (``umoci raw add-layer``),
with the labels. So a change to src/ builds one thin layer (seconds) and a node imports only
that; every other layer keeps its digest, and a node's containerd, which keeps layers by
digest, has them already.

``<hash>`` covers the Dockerfile, images/constraints.txt, every file the Dockerfile COPYs
from the repository (bytecode and ``*.egg-info`` left out, as .dockerignore leaves them out of
the build context), the base and the recipe version, so an unchanged input never rebuilds, in
this checkout or in a clean clone of it; the labels' revision and creation time are those of
the first build of these inputs. The store (``<cache>/images``, the cache of
:mod:`dwdp_dev.devcluster.paths`) is what the process kubelet runs images from
(:func:`lookup`, :func:`unpack`). An OCI layout is pushed to any registry with
``skopeo copy oci:<layout>:<tag> docker://<registry>/<name>:<tag>``.

pip in the build uses the host's CA bundle (``$PIP_CERT``, ``$SSL_CERT_FILE`` or the
Debian bundle) and index (``$PIP_INDEX_URL``) through a pip.conf mounted for the RUN steps
only (buildah ``-v``), and the host's pip cache (``$PIP_CACHE_DIR`` or ``~/.cache/pip``,
created if missing) mounted the same way, never baked into the image. Per-image build args
(:data:`BUILD_ARGS`: the worker's build stage on the base, its extras) are part of the hash.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dwdp_dev.devcluster import paths

log = logging.getLogger("dwdp_dev.devcluster.images")

BASE_SUITE = "bookworm"
"""The Debian release of the base (Python 3.11)."""
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASE_MIRROR = "http://deb.debian.org/debian"
RECIPE = "3"
"""Bumped when the way images are built changes (part of every hash)."""
LAYER_COMPRESSION = "zstd"
"""How the store's layers are compressed (those buildah pushes, the product layer). zstd, not
gzip: the worker's 6.5 GB of dependencies compress about 8 times faster on 2 cores (and a
little smaller), and a node's containerd (1.5 or later) reads them faster. umoci 0.5 or later
reads them (:func:`_umoci`). A registry whose clients predate zstd takes a gzip copy:
``skopeo copy --dest-compress-format gzip``."""
REGISTRY = "ghcr.io/dwdp"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SKIP = ("__pycache__",)
_SKIP_SUFFIXES = (".pyc", ".egg-info")
"""Never hashed (nor in the build context: .dockerignore): bytecode and the ``*.egg-info``
that ``pip install -e .`` writes into src/, so an installed checkout and a clean clone of the
same inputs share their images."""
BASE_ARG = "{base}"
"""In :data:`BUILD_ARGS`, replaced by the local base's name in the build's storage."""
BUILD_ARGS: dict[str, dict[str, str]] = {
    # Both stages on the local base (bookworm's python3 3.11: binary wheels of every
    # dependency, no compiler) and the extras without mpi4py (compiled from source).
    "worker": {"BUILD_IMAGE": BASE_ARG, "EXTRAS": "worker,cuda"},
}
"""The build args of the local build of each image beyond PYTHON_IMAGE (the base), VERSION,
REVISION and CREATED: the one home of the per-image settings (part of the image's hash)."""
BUILT_ON: dict[str, str] = {"rank-standin": "operator"}
"""Images built on another image of the store (``FROM ${OPERATOR_IMAGE}``: the build arg is
the other image's name in upper case + ``_IMAGE``): that image is built first, its hash is
part of this one's, and the build gets it by name in its private storage."""
LOCAL_NAMES: dict[str, tuple[str, ...]] = {
    "worker": ("dwdp-worker:dev",),
    "rank-standin": ("dwdp-rank-standin:dev",),
}
"""More names a real node gives an image when it imports it, beside its reference: the
examples name the worker image ``dwdp-worker:dev``, and the operator tests' worker pods name
the test rank program's image ``dwdp-rank-standin:dev`` (``dwdp_dev.operator.cluster``); the
process kubelet finds neither name in the store and runs those pods from the host's .venv."""
PIP_CACHE_ARG = {"PIP_NO_CACHE_DIR": ""}
"""What every local build passes: an empty PIP_NO_CACHE_DIR (pip ignores it) lets a
Dockerfile that takes it as an ARG use the pip cache mounted for its RUN steps."""


class ImageError(RuntimeError):
    """An image could not be built or read (a missing tool, a failed step)."""


@dataclass(frozen=True)
class StoredImage:
    """An image of the local store: its OCI layout, tag and manifest digest."""

    reference: str
    layout: Path
    tag: str
    digest: str

    @property
    def repository(self) -> str:
        """The reference without its tag, e.g. ``ghcr.io/dwdp/dwdp-worker``."""
        return self.reference.rsplit(":", 1)[0]

    @property
    def image_id(self) -> str:
        """What a kubelet reports as a container's ``imageID`` for this image:
        ``<repository>@<manifest digest>``, as for an image pulled from a registry."""
        return f"{self.repository}@{self.digest}"


def store_dir() -> Path:
    """Return the local OCI image store (``<cache>/images``)."""
    return paths.cache_dir() / "images"


def _need(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        raise ImageError(
            f"building images needs {', '.join(missing)} on PATH "
            f"(Debian: apt-get install {' '.join(missing)})"
        )


def _umoci() -> str:
    """The umoci this module runs: v0.6.0, built from the Go module proxy and cached
    (:func:`build.build_umoci`); Debian bookworm's 0.4.7 cannot unpack zstd layers."""
    from dwdp_dev.devcluster import build

    try:
        return str(build.build_umoci())
    except build.BuildError as exc:
        raise ImageError(f"umoci (for the image layouts): {exc}") from None


def _repo() -> Path:
    if paths.REPO_ROOT is None:
        raise ImageError("image builds need a source checkout (no pyproject.toml found)")
    return paths.REPO_ROOT


def version() -> str:
    """The package version (``dwdp.__version__``), the images' default tag."""
    from dwdp import __version__

    return __version__


def reference(name: str) -> str:
    """The reference an image is stored under: ``ghcr.io/dwdp/dwdp-<name>:<version>``."""
    return f"{REGISTRY}/dwdp-{name}:{version()}"


# ----------------------------------------------------------------------------- hashing
def _copy_sources(dockerfile: Path) -> list[str]:
    """The repository paths a Dockerfile COPYs from the build context (not ``--from``)."""
    return _copies(dockerfile.read_text())


def _copies(text: str) -> list[str]:
    """The repository paths that the Dockerfile instructions ``text`` COPY (or ADD) from the
    build context (not ``--from``)."""
    text = re.sub(r"\\\n", " ", text)
    out: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        out += args[:-1]
    return out


def _hash_tree(h: hashlib._Hash, root: Path, rel: str) -> None:
    path = root / rel
    if path.is_symlink():
        h.update(f"L {rel} {os.readlink(path)}\0".encode())
    elif path.is_dir():
        for child in sorted(path.iterdir()):
            if child.name in _SKIP or child.suffix in _SKIP_SUFFIXES:
                continue
            _hash_tree(h, root, f"{rel}/{child.name}")
    elif path.is_file():
        h.update(f"F {rel} {path.stat().st_mode & 0o111:o}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    else:
        raise ImageError(f"the Dockerfile copies {rel}, which the repository lacks")


def base_hash() -> str:
    """Hex digest (16 chars) of the base recipe: suite, packages, mirror, recipe version."""
    spec = json.dumps([BASE_SUITE, BASE_PACKAGES, BASE_MIRROR, RECIPE])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def dockerfile_path(name: str) -> Path:
    """The Dockerfile of image ``name``: ``images/<name>/Dockerfile`` (the product's images)
    or ``tools/images/<name>/Dockerfile`` (test images, never published). Raises ImageError
    when neither exists or ``name`` is not a folder name."""
    if re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) is None:
        raise ImageError(
            f"no image {name!r}: an image name is a folder of images/ or tools/images/ "
            "(lowercase letters, digits and '-', e.g. operator)"
        )
    repo = _repo()
    for folder in ("images", "tools/images"):
        dockerfile = repo / folder / name / "Dockerfile"
        if dockerfile.is_file():
            return dockerfile
    raise ImageError(
        f"no image {name!r}: neither images/{name}/Dockerfile nor "
        f"tools/images/{name}/Dockerfile exists"
    )


def input_hash(name: str) -> str:
    """Hex digest (16 chars) of everything image ``name`` is built from."""
    on = f"on {input_hash(BUILT_ON[name])}\0".encode() if name in BUILT_ON else b""
    sources = set(_copy_sources(dockerfile_path(name)))
    h = _recipe_hash(name, f"{RECIPE}\0{base_hash()}\0{version()}\0", sources, on)
    return h.hexdigest()[:16]


def _recipe_hash(name: str, head: str, sources: set[str], extra: bytes = b"") -> Any:
    """A sha256 over ``head``, image ``name``'s build args, ``extra``, its Dockerfile,
    images/constraints.txt and the repository paths ``sources``."""
    repo = _repo()
    h = hashlib.sha256(head.encode())
    h.update(json.dumps(build_args(name, BASE_ARG), sort_keys=True).encode() + b"\0")
    h.update(extra)
    _hash_tree(h, repo, str(dockerfile_path(name).relative_to(repo)))
    _hash_tree(h, repo, "images/constraints.txt")
    for src in sorted(sources):
        _hash_tree(h, repo, src.rstrip("/"))
    return h


def build_args(name: str, base: str) -> dict[str, str]:
    """The build args of image ``name`` beyond VERSION, REVISION and CREATED, with ``base``
    (the base image's name) for PYTHON_IMAGE and wherever :data:`BUILD_ARGS` says so."""
    extra = {k: base if v == BASE_ARG else v for k, v in BUILD_ARGS.get(name, {}).items()}
    if name in BUILT_ON:
        extra[_built_on_arg(name)] = _local_name(BUILT_ON[name])
    return {"PYTHON_IMAGE": base, **PIP_CACHE_ARG, **extra}


def _built_on_arg(name: str) -> str:
    """The build arg naming the image ``name`` is built on (``OPERATOR_IMAGE``)."""
    return BUILT_ON[name].upper().replace("-", "_") + "_IMAGE"


def _local_name(name: str) -> str:
    """Image ``name`` as a build's private storage holds it."""
    return f"localhost/dwdp-{name}:local"


# ----------------------------------------------------------------------------- running
def _run(cmd: list[str], logf: Path, *, cwd: Path | None = None, what: str = "") -> None:
    with open(logf, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        began = time.monotonic()
        proc = subprocess.run(
            cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        out.write(f"# exit {proc.returncode} after {time.monotonic() - began:.1f} s\n")
    if proc.returncode != 0:
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
        raise ImageError(
            f"{what or cmd[0]} failed (exit {proc.returncode}); full log {logf}\n{tail}"
        )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _say(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)
    else:
        log.info("%s", message)


def _index_tag(layout: Path, tag: str) -> str | None:
    """The manifest digest that ``tag`` names in an OCI layout, or None."""
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, ValueError):
        return None
    for m in index.get("manifests") or []:
        if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag:
            return str(m["digest"])
    return None


def ensure_base(progress: Callable[[str], None] | None = None) -> Path:
    """Build the Debian base as an OCI layout (tag ``base``) unless it exists; return it."""
    layout = store_dir() / "base" / f"{BASE_SUITE}-{base_hash()}"
    if _index_tag(layout, "base"):
        return layout
    _need("debootstrap")
    with _locked(store_dir() / "base" / ".lock"):
        if _index_tag(layout, "base"):
            return layout
        logf = store_dir() / "base" / "build.log"
        logf.write_text("")
        start = time.monotonic()
        _say(progress, f"images: debootstrap {BASE_SUITE} base (a few minutes; log {logf})")
        tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=layout.parent))
        try:
            oci, bundle = tmp / "oci", tmp / "bundle"
            _run([_umoci(), "init", "--layout", str(oci)], logf)
            _run([_umoci(), "new", "--image", f"{oci}:base"], logf)
            _run([_umoci(), "unpack", "--image", f"{oci}:base", str(bundle)], logf)
            rootfs = bundle / "rootfs"
            _run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    BASE_SUITE,
                    str(rootfs),
                    BASE_MIRROR,
                ],
                logf,
                what="debootstrap",
            )
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
                for child in (rootfs / junk).glob("*"):
                    if child.is_file() and child.name != "lock":
                        child.unlink()
            for rel in ("etc/resolv.conf", "etc/hostname"):
                (rootfs / rel).unlink(missing_ok=True)
            _say(progress, f"images: base unpacked ({time.monotonic() - start:.0f} s), packing")
            _run([_umoci(), "repack", "--image", f"{oci}:base", str(bundle)], logf)
            _run(
                [
                    _umoci(),
                    "config",
                    "--image",
                    f"{oci}:base",
                    "--config.env",
                    f"PATH={BASE_PATH}",
                    "--config.cmd",
                    "/bin/bash",
                    "--os",
                    "linux",
                    "--architecture",
                    "amd64",
                ],
                logf,
            )
            _run([_umoci(), "gc", "--layout", str(oci)], logf)
            shutil.rmtree(layout, ignore_errors=True)
            os.replace(oci, layout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(progress, f"images: base {layout} built in {time.monotonic() - start:.0f} s")
    return layout


def _pip_conf(folder: Path) -> list[str]:
    """buildah ``-v`` words that give the RUN steps the host's CA bundle and index."""
    ca = next(
        (
            c
            for c in (
                os.environ.get("PIP_CERT"),
                os.environ.get("SSL_CERT_FILE"),
                "/etc/ssl/certs/ca-certificates.crt",
            )
            if c and os.path.isfile(c)
        ),
        None,
    )
    lines = ["[global]"]
    volumes: list[str] = []
    if ca:
        lines.append("cert = /run/dwdp-build/ca.crt")
        volumes += ["-v", f"{ca}:/run/dwdp-build/ca.crt:ro"]
    for key, env in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        if os.environ.get(env):
            lines.append(f"{key} = {os.environ[env]}")
    conf = folder / "pip.conf"
    conf.write_text("\n".join(lines) + "\n")
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    cache.mkdir(parents=True, exist_ok=True)
    return [*volumes, "-v", f"{conf}:/etc/pip.conf:ro", "-v", f"{cache}:/root/.cache/pip"]


def _revision(repo: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    rev = out.stdout.strip() or "unknown"
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{rev}-dirty" if rev != "unknown" and dirty else rev


def _read_refs() -> dict[str, dict]:
    try:
        return dict(json.loads((store_dir() / "refs.json").read_text()))
    except (OSError, ValueError):
        return {}


def _write_refs(refs: dict[str, dict]) -> None:
    tmp = store_dir() / f".refs.json.{os.getpid()}"
    tmp.write_text(json.dumps(refs, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, store_dir() / "refs.json")


def build_image(
    name: str = "operator", progress: Callable[[str], None] | None = None
) -> StoredImage:
    """Build image ``name`` (:func:`dockerfile_path`) unless its inputs are unchanged;
    return it as stored (its reference also names it in the store for the kubelet).

    Raises ImageError naming a missing tool (debootstrap, umoci, buildah) or the failed
    step and its log.
    """
    # the image it is built on first, outside the store's lock (held again below)
    on = build_image(BUILT_ON[name], progress) if name in BUILT_ON else None
    digest_in = input_hash(name)
    ref = reference(name)
    layout = store_dir() / "oci" / f"dwdp-{name}-{digest_in}"
    tag = version()
    with _locked(store_dir() / ".lock"):
        digest = _index_tag(layout, tag)
        if digest:
            _say(progress, f"images: {ref} up to date ({layout.name})")
        else:
            _drop_superseded(name, layout)
            digest = _build(name, layout, tag, progress, on=on)
        refs = _read_refs()
        entry = {
            "name": name,
            "layout": str(layout),
            "tag": tag,
            "digest": digest,
            "inputs": digest_in,
        }
        if refs.get(ref) != entry:
            refs[ref] = entry
            _write_refs(refs)
        for old in (store_dir() / "oci").glob(f"dwdp-{name}-*"):
            if old != layout and not any(e["layout"] == str(old) for e in refs.values()):
                shutil.rmtree(old, ignore_errors=True)
        _prune_rootfs({_rootfs_key(str(e["digest"])) for e in refs.values()})
    return StoredImage(ref, layout, tag, digest)


def _drop_superseded(name: str, keep: Path) -> None:
    """Before a build of ``name``: its other stored layouts, its entry in the refs and the
    unpacked roots no entry needs any more (unless a pod still mounts one) go now rather than
    after the build. The build needs several times the image's size free at its peak (vfs
    copies of both stages, the committed layer, the pushed layout, then the unpacked root: the
    worker image's took 19 GB more than the disk held before it, measured with its superseded
    copies gone), and the superseded copies of a worker image are 10 GB."""
    refs = _read_refs()
    if refs.pop(reference(name), None) is not None:
        _write_refs(refs)
    for old in (store_dir() / "oci").glob(f"dwdp-{name}-*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
    _prune_rootfs({_rootfs_key(str(e["digest"])) for e in refs.values()})


def _rootfs_key(digest: str) -> str:
    return digest.partition(":")[2][:32]


def _prune_rootfs(keep: set[str]) -> None:
    """Remove unpacked roots of images no longer stored, unless a mount (of any process,
    in any mount namespace: a running pod's overlay) still uses them."""
    top = store_dir() / "rootfs"
    old = [d for d in top.glob("*") if d.is_dir() and d.name not in keep and d.name[0] != "."]
    if not old:
        return
    mounts = ""
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        with contextlib.suppress(OSError):
            mounts += info.read_text(errors="replace")
    for d in old:
        if str(d) not in mounts:
            shutil.rmtree(d, ignore_errors=True)


class _Buildah:
    """One build's private buildah storage (vfs, chroot isolation) holding the base and, for
    an image built on another (:data:`BUILT_ON`), that image; removed on exit."""

    def __init__(self, name: str, logf: Path, tmp: Path, on: StoredImage | None) -> None:
        self.name, self.logf, self.tmp, self.on = name, logf, tmp, on
        self.work = store_dir() / "buildah"
        self.storage = ["--storage-driver", "vfs", "--root", str(self.work / "root"),
                        "--runroot", str(self.work / "run")]
        self.based = f"localhost/dwdp-base:{BASE_SUITE}-{base_hash()}"
        self.ready = False

    def __enter__(self) -> _Buildah:
        shutil.rmtree(self.work, ignore_errors=True)
        return self

    def _prepare(self) -> None:
        """The storage and the images the Dockerfile starts from, on first use (a build whose
        runtime and product layer are both stored needs neither)."""
        if self.ready:
            return
        self.ready = True
        # buildah derives a container name from an oci: path, which a folder like ~/.cache
        # cannot be part of: the base goes into the private storage by name.
        into = f"containers-storage:[vfs@{self.work / 'root'}+{self.work / 'run'}]"
        base = ensure_base()
        _run(["skopeo", "copy", "--quiet", f"oci:{base}:base", into + self.based], self.logf)
        if self.on is not None:
            on_name = into + _local_name(BUILT_ON[self.name])
            _run(["skopeo", "copy", "--quiet", f"oci:{self.on.layout}:{self.on.tag}", on_name],
                 self.logf)

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def build(self, local: str, tag: str, target: str | None = None) -> None:
        """``buildah build`` of the Dockerfile (its ``target`` stage) as ``local``."""
        self._prepare()
        repo = _repo()
        args = {**build_args(self.name, self.based), "VERSION": tag, **_stamp()}
        _run(
            ["buildah", *self.storage, "build", "--pull-never", "--isolation", "chroot",
             "--file", str(dockerfile_path(self.name)), "--tag", local,
             *(["--target", target] if target else []),
             *(w for k, v in args.items() for w in ("--build-arg", f"{k}={v}")),
             *_pip_conf(self.tmp), str(repo)],
            self.logf,
            what=f"buildah build of {dockerfile_path(self.name).relative_to(repo)}"
            + (f" (stage {target})" if target else ""),
        )

    def push(self, local: str, layout: Path, tag: str) -> None:
        """``local`` into the OCI layout ``layout`` (tag ``tag``), replacing it whole."""
        with _replacing(layout) as staging:
            _run(["buildah", *self.storage, "push", "--compression-format", LAYER_COMPRESSION,
                  local, f"oci:{staging}:{tag}"], self.logf)

    def files(self, local: str, path: str, dest: Path) -> None:
        """Copy folder ``path`` of image ``local`` to ``dest`` (owners and modes kept)."""
        self._prepare()
        ctr = subprocess.run(["buildah", *self.storage, "from", "--pull-never", local],
                             capture_output=True, text=True, check=False)
        if ctr.returncode != 0:
            raise ImageError(f"buildah from {local} failed: {ctr.stderr.strip()[-500:]}")
        name = ctr.stdout.strip().splitlines()[-1]
        try:
            mnt = subprocess.run(["buildah", *self.storage, "mount", name], capture_output=True,
                                 text=True, check=True).stdout.strip()
            _run(["cp", "-a", f"{mnt}/{path.strip('/')}/.", str(dest)], self.logf)
        finally:
            subprocess.run(["buildah", *self.storage, "rm", name], capture_output=True,
                           check=False)


def _build(
    name: str,
    layout: Path,
    tag: str,
    progress: Callable[[str], None] | None,
    *,
    on: StoredImage | None = None,
) -> str:
    """Build ``name`` into ``layout`` (tag ``tag``); ``on``: the stored image it is built on
    (:data:`BUILT_ON`), copied into the build's storage under its local name. An image whose
    Dockerfile has the stages ``runtime`` and ``product`` is built in layers
    (:func:`_add_product`); any other in one ``buildah build``."""
    base_layout = store_dir() / "base" / f"{BASE_SUITE}-{base_hash()}"
    _need(
        "buildah", "skopeo", *([] if _index_tag(base_layout, "base") else ["debootstrap"])
    )
    ensure_base(progress)
    start = time.monotonic()
    logf = store_dir() / f"build-{name}.log"
    logf.write_text("")
    layered = {"runtime", "product"} <= _stage_names(dockerfile_path(name))
    _say(progress, f"images: building dwdp-{name} with buildah "
                   f"({'in layers' if layered else 'minutes'}; log {logf})")
    local = f"localhost/dwdp-{name}:{layout.name.rsplit('-', 1)[1]}"
    with tempfile.TemporaryDirectory(prefix="dwdp-build-") as tmp, \
            _Buildah(name, logf, Path(tmp), on) as bah:
        if layered:
            runtime = _runtime_layout(name, bah, tag, progress)
            product = _product_tar(bah, tag, Path(tmp), progress)
            _add_product(runtime, product, layout, tag, logf)
        else:
            bah.build(local, tag)
            bah.push(local, layout, tag)
    digest = _index_tag(layout, tag)
    if not digest:
        raise ImageError(f"the build wrote no tag {tag} to {layout}")
    size = sum(f.stat().st_size for f in (layout / "blobs").rglob("*") if f.is_file())
    _say(
        progress,
        f"images: {reference(name)} built in {time.monotonic() - start:.0f} s "
        f"({size / 2**20:.0f} MiB compressed) -> {layout}",
    )
    return digest


# ----------------------------------------------------------------------------- layers
RUNTIMES_KEPT = 2
"""Runtime layouts (an image's dependencies) kept per image name, the most recently used:
two checkouts of different dependencies do not evict each other's."""


def _stage_names(dockerfile: Path) -> set[str]:
    """The ``AS`` names of a Dockerfile's stages."""
    text = dockerfile.read_text()
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, re.MULTILINE | re.IGNORECASE))


def runtime_hash(name: str) -> str:
    """Hex digest (16 chars) of what image ``name``'s ``runtime`` stage is built from: the
    image's inputs but the sources, with the requirements of the image's extras
    (:func:`_extras`, listed by images/requirements.py) standing for pyproject.toml (a new
    version or description, or a change to another extra such as ``test``, does not rebuild
    the dependencies)."""
    import tomllib

    sources = set(_copy_sources(dockerfile_path(name))) - {"src", "pyproject.toml"}
    h = _recipe_hash(name, f"runtime\0{RECIPE}\0{base_hash()}\0", sources)
    project = tomllib.loads((_repo() / "pyproject.toml").read_text())["project"]
    spec = importlib.util.spec_from_file_location("requirements", _repo() / REQUIREMENTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        deps = module.requirements(project, _extras(name))
    except KeyError as exc:
        raise ImageError(f"{dockerfile_path(name)}: {exc.args[0]}") from None
    h.update(json.dumps(deps).encode())
    return h.hexdigest()[:16]


REQUIREMENTS = "images/requirements.py"
"""What a runtime stage runs to list the dependencies of the image's extras."""


def _extras(name: str) -> list[str]:
    """The dwdp extras image ``name`` installs: its ``EXTRAS`` build arg (:data:`BUILD_ARGS`),
    else the Dockerfile's ``ARG EXTRAS=`` default."""
    value = BUILD_ARGS.get(name, {}).get("EXTRAS")
    if value is None:
        found = re.search(r"^ARG\s+EXTRAS=(\S+)", dockerfile_path(name).read_text(), re.MULTILINE)
        value = found.group(1) if found else ""
    return [extra for extra in value.split(",") if extra]


def _runtime_layout(
    name: str, bah: _Buildah, tag: str, progress: Callable[[str], None] | None
) -> Path:
    """The stored OCI layout of image ``name``'s ``runtime`` stage (its dependencies), built
    now unless stored (``<store>/runtime/dwdp-<name>-<runtime_hash>``); the least recently
    used beyond :data:`RUNTIMES_KEPT` are removed."""
    layout = store_dir() / "runtime" / f"dwdp-{name}-{runtime_hash(name)}"
    if _index_tag(layout, tag):
        _say(progress, f"images: dwdp-{name}'s dependencies up to date ({layout.name})")
    else:
        _say(progress, f"images: dwdp-{name}'s dependencies changed or are new: building them "
                       "(minutes; the worker's about 5)")
        local = f"localhost/dwdp-{name}-runtime:{layout.name.rsplit('-', 1)[1]}"
        bah.build(local, tag, target="runtime")
        bah.push(local, layout, tag)
    _keep_recent(layout, f"dwdp-{name}-*", RUNTIMES_KEPT)
    return layout


def _keep_recent(used: Path, pattern: str, keep: int) -> None:
    """Mark ``used`` as just used; of the others beside it that match ``pattern``, remove all
    but the ``keep - 1`` most recently used."""
    os.utime(used)
    others = sorted((p for p in used.parent.glob(pattern) if p != used),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[keep - 1:]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


PRODUCTS_KEPT = 2
"""Product layers kept (shared by the images whose product stage reads the same)."""


def _stage(dockerfile: Path, name: str) -> str:
    """The instructions of stage ``name`` of a Dockerfile (``FROM ... AS name`` to the next
    ``FROM``), comments and blank lines left out."""
    lines, inside = [], False
    for line in dockerfile.read_text().splitlines():
        if re.match(r"\s*FROM\s", line, re.IGNORECASE):
            inside = re.search(rf"\sAS\s+{re.escape(name)}\s*$", line, re.IGNORECASE) is not None
        if inside and line.strip() and not line.lstrip().startswith("#"):
            lines.append(line.rstrip())
    if not lines:
        raise ImageError(f"{dockerfile} has no stage {name!r}")
    return "\n".join(lines) + "\n"


def product_hash(name: str) -> str:
    """Hex digest (16 chars) of what image ``name``'s ``product`` stage is built from: its
    instructions (comments aside), the base and what it copies (the sources, pyproject.toml,
    images/product.sh, the constraints). Images whose product stages read the same share one
    product layer: it is built once for all of them."""
    stage = _stage(dockerfile_path(name), "product")
    h = hashlib.sha256(f"product\0{RECIPE}\0{base_hash()}\0".encode())
    h.update(stage.encode())
    for src in sorted(set(_copies(stage))):
        _hash_tree(h, _repo(), src.rstrip("/"))
    return h.hexdigest()[:16]


def _product_tar(
    bah: _Buildah, tag: str, tmp: Path, progress: Callable[[str], None] | None
) -> Path:
    """The ``product`` stage's ``/product`` folder as an uncompressed tar, stored as
    ``<store>/product/<product_hash>.tar``: built now unless another image (or an earlier
    build) stored it; the least recently used beyond :data:`PRODUCTS_KEPT` are removed."""
    path = store_dir() / "product" / f"{product_hash(bah.name)}.tar"
    if path.is_file():
        _say(progress, f"images: the product layer is stored already ({path.name})")
    else:
        _say(progress, "images: building the product layer (the dwdp package; seconds)")
        local = f"localhost/dwdp-{bah.name}-product:{path.stem}"
        bah.build(local, tag, target="product")
        files = tmp / "product"
        files.mkdir()
        bah.files(local, "/product", files)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        _run(["tar", "-C", str(files), "--numeric-owner", "-cf", str(part), "."], bah.logf)
        os.replace(part, path)
    _keep_recent(path, "*.tar", PRODUCTS_KEPT)
    return path


def _add_product(runtime: Path, product: Path, layout: Path, tag: str, logf: Path) -> None:
    """``layout``: the ``runtime`` layout (its blobs hard-linked: the same layers, by digest)
    plus one layer, the tar ``product`` (:func:`_product_tar`), with the build's labels."""
    with _replacing(layout) as staging:
        # the blobs hard-linked (never written in place: umoci writes new ones beside them);
        # the index, which umoci rewrites, copied
        _run(["cp", "-al", str(runtime), str(staging)], logf)
        for small in ("index.json", "oci-layout"):
            (staging / small).unlink()
            shutil.copy2(runtime / small, staging / small)
        image = f"{staging}:{tag}"
        _run([_umoci(), "raw", "add-layer", "--compress", LAYER_COMPRESSION, "--image", image,
              "--history.created_by",
              "COPY --from=product /product/ /", str(product)], logf)
        labels = {"version": tag, **_stamp()}
        _run([_umoci(), "config", "--image", image,
              *(w for k, v in labels.items()
                for w in ("--config.label", f"org.opencontainers.image.{k.lower()}={v}"))],
             logf)
        _drop_unreferenced(staging)


def _drop_unreferenced(layout: Path) -> None:
    """Remove the blobs that ``layout``'s index does not reach (what umoci's edits leave
    behind: the runtime's manifest and configs). ``umoci gc`` does the same but reads every
    blob to check it: 20 s for the worker's 3.3 GB."""
    keep: set[str] = set()
    docs = [json.loads((layout / "index.json").read_text())]
    while docs:
        doc = docs.pop()
        for child in doc.get("manifests") or []:
            keep.add(child["digest"])
            docs.append(_blob(layout, child["digest"]))
        for leaf in [doc.get("config"), *(doc.get("layers") or [])]:
            if leaf:
                keep.add(leaf["digest"])
    for blob in (layout / "blobs").glob("*/*"):
        if f"{blob.parent.name}:{blob.name}" not in keep:
            blob.unlink()


@contextlib.contextmanager
def _replacing(layout: Path) -> Iterator[Path]:
    """A staging folder beside ``layout`` for a new layout, which replaces ``layout`` whole
    once the block ends without an error (the staging folder is removed if it raises)."""
    staging = layout.with_name(f".{layout.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
        shutil.rmtree(layout, ignore_errors=True)
        os.replace(staging, layout)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stamp() -> dict[str, str]:
    """The build args (and labels) that change with every build: REVISION and CREATED."""
    return {"REVISION": _revision(_repo()),
            "CREATED": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# ----------------------------------------------------------------------------- the kubelet's side
def lookup(ref: str) -> tuple[StoredImage | None, str]:
    """The stored image of a pod's ``image`` (``repo:tag`` or ``repo@sha256:...``) and "",
    or None and why not: not in the store, or (in a source checkout) built from sources
    other than the checkout's, which would run code the checkout no longer has."""
    refs = _read_refs()
    entry = refs.get(ref)
    if entry is None and "@" in ref:
        repo, _, digest = ref.partition("@")
        entry = next(
            (
                e
                for r, e in refs.items()
                if r.rsplit(":", 1)[0] == repo and e.get("digest") == digest
            ),
            None,
        )
    if entry is None:
        return None, f"not in the local store {store_dir()}"
    layout = Path(entry["layout"])
    found = _index_tag(layout, entry["tag"])
    if found is None:
        return None, f"its layout {layout} is gone"
    name = entry.get("name")
    if name and paths.REPO_ROOT is not None:
        try:
            current = input_hash(name)
        except (ImageError, OSError):
            current = ""
        if current != entry.get("inputs"):
            return None, (
                f"stored from other sources than {paths.REPO_ROOT} (`dwdp dev images --only"
                f" {name}` rebuilds it)"
            )
    return StoredImage(ref, layout, entry["tag"], found), ""


def _blob(layout: Path, digest: str) -> dict:
    algo, _, hexd = digest.partition(":")
    return dict(json.loads((layout / "blobs" / algo / hexd).read_text()))


def image_config(image: StoredImage) -> dict:
    """The image's ``config`` (Entrypoint, Cmd, Env, User, WorkingDir, Labels)."""
    manifest = _blob(image.layout, image.digest)
    return dict(_blob(image.layout, manifest["config"]["digest"]).get("config") or {})


def unpack(image: StoredImage) -> Path:
    """Unpack the image's root filesystem once per manifest digest; return the rootfs folder
    (``<store>/rootfs/<digest>/rootfs``; callers mount it read-only, e.g. as an overlay's
    lower layer)."""
    dest = store_dir() / "rootfs" / _rootfs_key(image.digest)
    rootfs = dest / "rootfs"
    if rootfs.is_dir():
        return rootfs
    with _locked(store_dir() / "rootfs" / ".lock"):
        if rootfs.is_dir():
            return rootfs
        tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        logf = store_dir() / "rootfs" / "unpack.log"
        _run(
            [_umoci(), "unpack", "--image", f"{image.layout}:{image.tag}", str(tmp)],
            logf,
            what=f"umoci unpack of {image.reference}",
        )
        os.replace(tmp, dest)
    return rootfs
