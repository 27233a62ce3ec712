"""The pure parts of the local cluster's images: the build's input hash (what goes into an
image, so an unchanged input never rebuilds), the store's lookup (only images of the
checkout's sources), the names and the rebuild's clean-up."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dwdp_dev.devcluster import images, paths

REPO = Path(__file__).resolve().parents[2]


def test_the_hash_covers_what_the_dockerfile_copies(tmp_path: Path, monkeypatch) -> None:
    sources = images._copy_sources(REPO / "images" / "operator" / "Dockerfile")
    # product code only (and the pinned versions of its dependencies); no README.md
    inputs = {"images/constraints.txt", "pyproject.toml", "images/requirements.py",
              "images/product.sh", "src"}
    assert set(sources) == inputs
    assert not any(s.startswith("/") for s in sources)  # no --from stage paths
    # A copy of the inputs: the same hash; a changed source file or Dockerfile: another.
    for rel in ("images/operator", "images/constraints.txt", *sources):
        src, dst = REPO / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(src.readlink())
        elif src.is_dir():
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(src, dst, symlinks=True, ignore=skip)
        else:
            dst.write_bytes(src.read_bytes())
    first = images.input_hash("operator")
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    assert images.input_hash("operator") == first
    pycache = tmp_path / "src" / "dwdp" / "operator" / "__pycache__"
    pycache.mkdir(exist_ok=True)
    (pycache / "x.pyc").write_bytes(b"junk")
    assert images.input_hash("operator") == first
    plan = tmp_path / "src" / "dwdp" / "operator" / "plan.py"
    plan.write_text(plan.read_text() + "\n# changed\n")
    assert images.input_hash("operator") != first
    with pytest.raises(images.ImageError, match="no image 'nope'"):
        images.input_hash("nope")


def test_a_test_image_lives_in_tools_and_its_hash_covers_the_rank_program() -> None:
    """The test rank program's image: its Dockerfile is under tools/images (never among the
    product's images/) and it copies the rank program alone of the development distribution,
    so a change to the local cluster's code does not rebuild it."""
    dockerfile = images.dockerfile_path("rank-standin")
    assert dockerfile == REPO / "tools" / "images" / "rank-standin" / "Dockerfile"
    assert not (REPO / "images" / "rank-standin").exists()
    copied = images._copy_sources(dockerfile)
    assert "tools/dwdp_dev/operator/rankprog.py" in copied
    assert not any(c.startswith("tools/dwdp_dev/devcluster") for c in copied)
    assert "tools/dwdp_dev" not in copied
    assert images.dockerfile_path("operator") == REPO / "images" / "operator" / "Dockerfile"
    with pytest.raises(images.ImageError, match="neither images/nope/Dockerfile nor tools/"):
        images.dockerfile_path("nope")


def test_an_image_built_on_another_takes_its_hash_and_its_local_name(monkeypatch) -> None:
    """The stand-in image is built on the operator image: the build names it in its private
    storage, and a change to the operator's inputs changes the stand-in's hash too."""
    args = images.build_args("rank-standin", "localhost/base:1")
    assert args["OPERATOR_IMAGE"] == "localhost/dwdp-operator:local"
    assert "ARG OPERATOR_IMAGE" in images.dockerfile_path("rank-standin").read_text()
    first = images.input_hash("rank-standin")
    monkeypatch.setitem(images.BUILD_ARGS, "operator", {"X": "1"})
    assert images.input_hash("rank-standin") != first


def test_per_image_build_args_name_the_base_and_enter_the_hash(monkeypatch) -> None:
    worker = images.build_args("worker", "localhost/base:1")
    assert worker["PYTHON_IMAGE"] == worker["BUILD_IMAGE"] == "localhost/base:1"
    assert worker["EXTRAS"] == "worker,cuda"  # no mpi4py: nothing to compile
    assert worker["PIP_NO_CACHE_DIR"] == ""  # pip ignores it: the mounted cache is used
    assert images.build_args("operator", "b") == {"PYTHON_IMAGE": "b", "PIP_NO_CACHE_DIR": ""}
    first = images.input_hash("worker")
    monkeypatch.setitem(images.BUILD_ARGS, "worker", {**images.BUILD_ARGS["worker"], "X": "1"})
    assert images.input_hash("worker") != first


def test_lookup_refuses_an_image_built_from_other_sources(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path))
    layout = tmp_path / "images" / "oci" / "dwdp-operator-x"
    layout.mkdir(parents=True)
    ref = images.reference("operator")
    tag = {"org.opencontainers.image.ref.name": "0.1.0"}
    (layout / "index.json").write_text(
        json.dumps({"manifests": [{"digest": "sha256:ab", "annotations": tag}]})
    )
    entry = {"name": "operator", "layout": str(layout), "tag": "0.1.0", "digest": "sha256:ab"}
    store = tmp_path / "images" / "refs.json"
    store.write_text(json.dumps({ref: {**entry, "inputs": images.input_hash("operator")}}))
    found, why = images.lookup(ref)
    assert found is not None and found.digest == "sha256:ab" and why == ""
    assert images.lookup(ref.rsplit(":", 1)[0] + "@sha256:ab")[0] is not None
    store.write_text(json.dumps({ref: {**entry, "inputs": "0" * 16}}))
    assert images.lookup(ref)[0] is None and "other sources" in images.lookup(ref)[1]
    assert "not in the local store" in images.lookup("dwdp-worker:dev")[1]


@pytest.mark.parametrize("name", ["operator/", "../images/operator", "Operator", ""])
def test_an_image_name_that_is_no_folder_name_is_one_clear_error(name, capsys) -> None:
    """``dwdp dev images --only NAME`` with a path or a bad name: one line on stderr naming
    the rule, exit status 1 (it was a FileNotFoundError traceback from the log path)."""
    from dwdp.cli import main

    assert main(["dev", "images", "--only", name]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and f"no image {name!r}" in out.err
    assert "lowercase letters, digits and '-'" in out.err


def test_a_rebuild_frees_the_superseded_image_before_it_builds(tmp_path: Path, monkeypatch) -> None:
    """The worker image's build needs 19 GB more disk at its peak: the copies it replaces
    (layout and unpacked root, 10 GB) go before the build, not after (CI ran out of disk);
    the other image's copies stay."""
    monkeypatch.setenv("DWDP_CACHE_DIR", str(tmp_path))
    store = tmp_path / "images"
    refs = {}
    for name, digest in (("worker", "sha256:" + "a" * 64), ("operator", "sha256:" + "b" * 64)):
        (store / "oci" / f"dwdp-{name}-old").mkdir(parents=True)
        (store / "rootfs" / digest[7:39]).mkdir(parents=True)
        refs[images.reference(name)] = {
            "name": name,
            "layout": str(store / "oci" / f"dwdp-{name}-old"),
            "tag": "0.1.0",
            "digest": digest,
        }
    (store / "refs.json").write_text(json.dumps(refs))
    seen: list[set[str]] = []

    def build(name, layout, tag, progress, on=None):
        seen.append(
            {p.name for p in (store / "oci").iterdir()}
            | {p.name for p in (store / "rootfs").iterdir()}
        )
        (layout / "blobs").mkdir(parents=True)
        return "sha256:" + "c" * 64

    monkeypatch.setattr(images, "_build", build)
    monkeypatch.setattr(images, "_index_tag", lambda layout, tag: None)
    images.build_image("worker")
    assert seen == [{"dwdp-operator-old", "b" * 32}]  # the worker's old copies were gone
    assert images._read_refs()[images.reference("worker")]["digest"] == "sha256:" + "c" * 64


def _copy_inputs(dst: Path) -> None:
    """The repository files the product images are built from, copied into ``dst``."""
    for rel in ("images", "pyproject.toml", "src"):
        src = REPO / rel
        if src.is_dir():
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(src, dst / rel, symlinks=True, ignore=skip)
        else:
            shutil.copy2(src, dst / rel)


def test_the_runtime_hash_covers_the_dependencies_not_the_sources(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The layered images (a ``runtime`` and a ``product`` stage): the stored runtime (their
    dependencies) is keyed by the Dockerfile, the constraints, images/requirements.py and the
    requirements of the extras the image installs; a source change, a new version or
    description, another extra (``test``) or a README edit leave it (and a README edit the
    image too) as it is."""
    for name in ("operator", "worker"):
        assert {"runtime", "product"} <= images._stage_names(images.dockerfile_path(name))
    assert "runtime" not in images._stage_names(images.dockerfile_path("rank-standin"))
    _copy_inputs(tmp_path)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    runtime, image = images.runtime_hash("worker"), images.input_hash("worker")
    (tmp_path / "README.md").write_text("edited\n")
    assert images.input_hash("worker") == image
    plan = tmp_path / "src" / "dwdp" / "operator" / "plan.py"
    plan.write_text(plan.read_text() + "\n# changed\n")
    assert images.runtime_hash("worker") == runtime and images.input_hash("worker") != image
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace('description = "', 'description = "Edited. ', 1))
    assert images.runtime_hash("worker") == runtime
    # another extra (the tests' tools) is no input of an image's dependencies
    assert images._extras("operator") == ["operator"] and images._extras("worker") == [
        "worker", "cuda"]
    operator = images.runtime_hash("operator")
    pyproject.write_text(text.replace('"pytest>=8",', '"pytest>=9", "openai>=9",', 1))
    assert images.runtime_hash("worker") == runtime and images.runtime_hash("operator") == operator
    pyproject.write_text(text.replace('"numpy>=1.26",', '"numpy>=1.27",', 1))
    assert images.runtime_hash("worker") != runtime
    assert images.runtime_hash("operator") == operator  # numpy is the worker's alone
    pyproject.write_text(text)
    constraints = tmp_path / "images" / "constraints.txt"
    constraints.write_text(constraints.read_text() + "# changed\n")
    assert images.runtime_hash("worker") != runtime


def test_one_product_layer_serves_both_images_and_follows_the_sources(
    tmp_path: Path, monkeypatch
) -> None:
    """The product stage reads the same in the operator's and the worker's Dockerfile (their
    comments aside), so :func:`product_hash` is one value and the layer is built once for both;
    it changes with the sources and product.sh, not with the worker's build args (the stage
    does not use them), a README edit or a comment."""
    _copy_inputs(tmp_path)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path)
    product = images.product_hash("operator")
    assert images.product_hash("worker") == product
    assert "src" in images._copies(images._stage(images.dockerfile_path("worker"), "product"))
    monkeypatch.setitem(images.BUILD_ARGS, "worker", {**images.BUILD_ARGS["worker"], "X": "1"})
    (tmp_path / "README.md").write_text("edited\n")
    dockerfile = tmp_path / "images" / "worker" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("# ---", "# a comment\n# ---", 1))
    assert images.product_hash("worker") == product
    engine = tmp_path / "src" / "dwdp" / "worker" / "engine" / "paged.py"
    engine.write_text(engine.read_text() + "\n# changed\n")
    changed = images.product_hash("worker")
    assert changed != product and images.product_hash("operator") == changed
    script = tmp_path / "images" / "product.sh"
    script.write_text(script.read_text() + "\n# changed\n")
    assert images.product_hash("operator") != changed
    with pytest.raises(images.ImageError, match="no stage 'product'"):
        images._stage(REPO / "tools" / "images" / "rank-standin" / "Dockerfile", "product")


def test_a_layout_keeps_only_the_blobs_its_index_reaches(tmp_path: Path) -> None:
    """After the product layer and the labels are added to the runtime's copy, the runtime's
    manifest and configs are unreachable: they go (``_drop_unreferenced``), the image's stay."""

    def blob(doc: dict | bytes) -> str:
        data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        digest = hashlib.sha256(data).hexdigest()
        (tmp_path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (tmp_path / "blobs" / "sha256" / digest).write_bytes(data)
        return "sha256:" + digest

    layers = [{"digest": blob(b"base")}, {"digest": blob(b"deps")}]
    old = blob({"config": {"digest": blob({"old": 1})}, "layers": layers})
    new_layers = [*layers, {"digest": blob(b"product")}]
    config = blob({"new": 1})
    new = blob({"config": {"digest": config}, "layers": new_layers})
    (tmp_path / "index.json").write_text(json.dumps({"manifests": [{"digest": new}]}))
    images._drop_unreferenced(tmp_path)
    kept = {"sha256:" + p.name for p in (tmp_path / "blobs" / "sha256").iterdir()}
    assert kept == {new, config, *(layer["digest"] for layer in new_layers)}
    assert old not in kept
