"""The product images in layers (images/*/Dockerfile, ``dwdp_dev.devcluster.images``): built
twice by the real daemonless build, with a one-line change to src/ between the builds, an image
keeps every layer but the last by digest (its dependencies and base: what a node's containerd
and a registry already hold) and only the product's thin layer is new; the stored runtime (the
dependencies) is built once and reused. The operator image stands for both layered images: the
worker's build runs the same steps over 6 GB of dependencies (minutes instead of one).

In a store of its own (``DWDP_CACHE_DIR``), the Debian base hard-linked from the session's store
when it has one, and a copy of the repository's inputs, so the session's images stay as they
are."""

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
    base = images.store_dir() / "base" / f"{images.BASE_SUITE}-{images.base_hash()}"
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path / "cache"))
    if images._index_tag(base, "base"):
        target = images.store_dir() / "base" / base.name
        target.parent.mkdir(parents=True)
        subprocess.run(["cp", "-al", str(base), str(target)], check=True)
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
    first = images.build_image("operator")
    before = _layers(first)  # read now: the second build replaces the first's layout
    runtimes = list((images.store_dir() / "runtime").iterdir())
    plan = own_store / "src" / "dwdp" / "operator" / "plan.py"
    plan.write_text(plan.read_text() + "\n# a one-line change\n")
    (own_store / "README.md").write_text("not an input of any image\n")
    second = images.build_image("operator")
    assert second.digest != first.digest
    after = _layers(second)
    assert len(after) == len(before) >= 3  # base, dependencies, product
    assert [layer["digest"] for layer in after[:-1]] == [layer["digest"] for layer in before[:-1]]
    assert after[-1]["digest"] != before[-1]["digest"]
    assert after[-1]["size"] < 8 * 2**20 < sum(layer["size"] for layer in after[:-1])
    # the dependencies were built once: the second build reused the stored runtime
    assert list((images.store_dir() / "runtime").iterdir()) == runtimes
    # the new layer holds the changed module, and only the product
    layer = second.layout / "blobs" / "sha256" / after[-1]["digest"].split(":")[1]
    names = subprocess.run(["tar", "-tzf", str(layer)], capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(n.endswith("dwdp/operator/plan.py") for n in names)
    assert not any("site-packages/kopf" in n for n in names)
