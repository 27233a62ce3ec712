"""The product images in layers (images/*/Dockerfile, ``dwdp_dev.devcluster.images``): the
worker image, built twice by the real daemonless build with a one-line change to src/ between
the builds, keeps every layer but the last by digest (its base and dependencies: what a node's
containerd and a registry already hold) and only the product's thin layer is new; the stored
runtime (the dependencies) is reused and README.md is no input. The operator image built next
takes the same product layer without building it again. Every stored layer is
zstd-compressed.

In a store of its own (``DWDP_CACHE_DIR``) and a copy of the repository's inputs, so the
session's images stay as they are. The Debian base and both runtimes are hard-linked from the
session's store, where the worker image is built first when missing (the cluster tests need it
there anyway): the test itself builds product layers only, seconds each."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dwdp_dev.devcluster import images, paths

REPO = Path(__file__).resolve().parents[2]


def _layers(image: images.StoredImage) -> list[dict]:
    index = json.loads((image.layout / "index.json").read_text())
    (manifest,) = [m for m in index["manifests"] if m["digest"] == image.digest]
    blob = image.layout / "blobs" / "sha256" / manifest["digest"].split(":")[1]
    return list(json.loads(blob.read_text())["layers"])


@pytest.fixture
def own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    images.build_image("worker")  # the session's: its runtime and the operator's (built on it)
    session = images.store_dir()
    stored = [session / "base" / f"{images.BASE_SUITE}-{images.base_hash()}"]
    stored += [session / "runtime" / f"dwdp-{n}-{images.runtime_hash(n)}"
               for n in ("worker", "operator")]
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path / "cache"))
    for layout in stored:
        if images._index_tag(layout, "base") or images._index_tag(layout, images.version()):
            target = images.store_dir() / layout.relative_to(session)
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-al", str(layout), str(target)], check=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    for rel in ("images", "pyproject.toml", "src"):
        if (REPO / rel).is_dir():
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(REPO / rel, repo / rel, ignore=skip)
        else:
            shutil.copy2(REPO / rel, repo / rel)
    monkeypatch.setattr(paths, "REPO_ROOT", repo)
    return repo


def test_a_source_change_rebuilds_only_the_product_layer(own_store: Path) -> None:
    first = images.build_image("worker")
    before = _layers(first)  # read now: the second build replaces the first's layout
    runtimes = sorted((images.store_dir() / "runtime").iterdir())
    engine = own_store / "src" / "dwdp" / "worker" / "engine" / "paged.py"
    engine.write_text(engine.read_text() + "\n# a one-line change\n")
    (own_store / "README.md").write_text("not an input of any image\n")
    second = images.build_image("worker")
    assert second.digest != first.digest
    after = _layers(second)
    assert len(after) == len(before) >= 3  # base, dependencies, product
    assert [layer["digest"] for layer in after[:-1]] == [layer["digest"] for layer in before[:-1]]
    assert after[-1]["digest"] != before[-1]["digest"]
    assert after[-1]["size"] < 8 * 2**20 < sum(layer["size"] for layer in after[:-1])
    # every layer is zstd-compressed (what buildah pushed and the product's)
    zstd = "application/vnd.oci.image.layer.v1.tar+zstd"
    assert [layer["mediaType"] for layer in after] == [zstd] * len(after)
    # the dependencies were not built again: the stored runtime is the one the build used
    assert sorted((images.store_dir() / "runtime").iterdir()) == runtimes
    # the layout holds the image's blobs and nothing else (no leftovers of the layer's edits)
    blobs = {p.name for p in (second.layout / "blobs" / "sha256").iterdir()}
    manifest = json.loads((second.layout / "blobs" / "sha256" / second.digest[7:]).read_text())
    wanted = {d["digest"][7:] for d in [manifest["config"], *after]} | {second.digest[7:]}
    assert blobs == wanted
    # the new layer holds the changed module, and only the product
    layer = second.layout / "blobs" / "sha256" / after[-1]["digest"].split(":")[1]
    names = subprocess.run(["tar", "--zstd", "-tf", str(layer)], capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(n.endswith("dwdp/worker/engine/paged.py") for n in names)
    assert not any("site-packages/torch" in n for n in names)
    assert not any(n.endswith("README.md") for n in names)

    # the operator image takes the same product layer, without building it again
    products = sorted((images.store_dir() / "product").iterdir())
    operator = images.build_image("operator")
    assert _layers(operator)[-1]["digest"] == after[-1]["digest"]
    assert sorted((images.store_dir() / "product").iterdir()) == products
    assert "buildah" not in (images.store_dir() / "build-operator.log").read_text()
