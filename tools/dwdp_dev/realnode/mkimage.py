#!/usr/bin/env python3
"""Pack static binaries into a one-layer OCI image archive (oci-layout + index.json) that
`ctr -n k8s.io image import` accepts; no registry and no Docker needed.

Usage: mkimage.py OUT.tar NAME[:TAG] ENTRYPOINT SRC=DEST [SRC=DEST ...] [--link DEST=TARGET ...]
Example: mkimage.py /tmp/pause.tar registry.k8s.io/pause:3.10 /pause /tmp/rn/bin/pause=/pause
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sys
import tarfile
import time


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def layer(files: list[tuple[str, str]], links: list[tuple[str, str]]) -> tuple[bytes, bytes]:
    """Return (uncompressed tar, gzip) of the files, plus /tmp, /etc, /proc, /sys, /dev."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = {"tmp", "etc", "proc", "sys", "dev", "bin", "var", "root"}
        for _, dest in files + links:
            parts = dest.strip("/").split("/")[:-1]
            for i in range(len(parts)):
                dirs.add("/".join(parts[: i + 1]))
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            info.mtime = 0
            tar.addfile(info)
        for src, dest in files:
            with open(src, "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(dest.strip("/"))
            info.size, info.mode, info.mtime = len(data), 0o755, 0
            tar.addfile(info, io.BytesIO(data))
        for dest, target in links:
            info = tarfile.TarInfo(dest.strip("/"))
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 0
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tar_bytes = raw.getvalue()
    return tar_bytes, gzip.compress(tar_bytes, mtime=0)


def main(argv: list[str]) -> None:
    out, name, entry, *rest = argv
    files = [tuple(a.split("=", 1)) for a in rest if not a.startswith("--link") and "=" in a]
    links = []
    it = iter(rest)
    for a in it:
        if a == "--link":
            links.append(tuple(next(it).split("=", 1)))
    files = [f for f in files if f not in links]
    tar_bytes, gz = layer(files, links)
    config = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(0)),
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [entry], "Env": ["PATH=/bin:/usr/bin:/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_sha(tar_bytes)]},
        "history": [{"created_by": "dwdp realnode mkimage.py"}],
    }
    cfg = json.dumps(config).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _sha(cfg), "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _sha(gz), "size": len(gz)}],
    }).encode()
    ref = name if "/" in name.split(":")[0] or "." in name.split("/")[0] else f"docker.io/library/{name}"
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": _sha(manifest), "size": len(manifest),
                       "annotations": {"io.containerd.image.name": ref,
                                       "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]}}],
    }).encode()
    with tarfile.open(out, "w") as tar:
        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", index)
        for blob in (cfg, manifest, gz):
            add("blobs/sha256/" + _sha(blob).split(":")[1], blob)
    print(ref, _sha(manifest))


if __name__ == "__main__":
    main(sys.argv[1:])
