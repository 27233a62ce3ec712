"""The container build files keep the rules a cluster operator expects of an image.

Each of images/{operator,worker,router}/Dockerfile: several stages; every base image an
exact tag (a patch version, never ``latest``); Debian packages pinned to a version; pip
bound to images/constraints.txt, which pins every package exactly; the final stage runs as
a numeric non-root user, installs no compiler or headers, and carries the OCI labels
version, revision and source from build arguments. scripts/build-images.sh passes those
arguments (checked through its --dry-run, which needs no engine).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import dwdp

REPO = Path(__file__).resolve().parents[2]
IMAGES = ("operator", "worker", "router")
EXACT_BASE = re.compile(r"^[a-z0-9./-]+:\d+\.\d+\.\d+-[a-z0-9-]+(@sha256:[0-9a-f]{64})?$")
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|clang|make|build-essential|[a-z0-9.+-]+-dev)\b")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _stages(steps: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for step in steps:
        if step[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(step)
    return stages


@pytest.mark.parametrize("name", IMAGES)
def test_dockerfile_rules(name: str) -> None:
    steps = _instructions(REPO / "images" / name / "Dockerfile")
    args = {
        k: v
        for word, rest in steps
        if word == "ARG" and "=" in rest
        for k, v in [rest.split("=", 1)]
    }
    stages = _stages(steps)
    assert len(stages) >= 2, "multi-stage: a build stage and a final stage"
    named: dict[str, list[tuple[str, str]]] = {}
    for stage in stages:
        words = stage[0][1].split()
        base = words[0]
        base = args.get(base.strip("${}"), base) if base.startswith("$") else base
        # an exact tag, or an earlier stage of this file
        assert base in named or EXACT_BASE.match(base), f"base image {base!r} is not an exact tag"
        if len(words) == 3 and words[1].upper() == "AS":
            named[words[2]] = stage
    for word, rest in steps:
        if word == "RUN" and "apt-get install" in rest:
            packages = [
                p
                for p in rest.split("apt-get install", 1)[1].split("&&")[0].split()
                if not p.startswith("-")
            ]
            assert packages and all("=" in p for p in packages), f"unpinned: {packages}"
        if word == "RUN" and "pip" in rest and "install" in rest:
            assert any(w == "ENV" and "PIP_CONSTRAINT=" in r for w, r in steps), rest
    # the final image: the last stage and the stages it is built on
    final: list[tuple[str, str]] = []
    stage = stages[-1]
    while True:
        final = stage + final
        base = stage[0][1].split()[0]
        if base not in named:
            break
        stage = named[base]
    users = [rest for word, rest in final if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users
    for word, rest in final:
        if word == "RUN" and "apt-get install" in rest:
            assert not BUILD_TOOLS.search(rest), f"build tools in the final stage: {rest}"
    labels = " ".join(rest for word, rest in final if word == "LABEL")
    for key, arg in (("version", "VERSION"), ("revision", "REVISION"), ("source", "SOURCE")):
        assert f'org.opencontainers.image.{key}="${{{arg}}}"' in labels, key
        assert any(w == "ARG" and r.split("=")[0] == arg for w, r in final), arg
    assert any(word == "COPY" and "--from=build" in rest for word, rest in final)
    # layered: the product's files are the final image's last layer, on a stage named
    # `runtime` (what the local build stores and reuses), and the build args that change with
    # every build (revision, creation time) come after every layer, so a change to src/ or a
    # new commit rebuilds nothing below the product
    layers = [i for i, (word, _) in enumerate(final) if word in ("RUN", "COPY", "ADD")]
    if any(w == "COPY" and r.split()[0] == "src" for w, r in steps):  # builds the product
        assert final[layers[-1]] == ("COPY", "--from=product /product/ /"), final[layers[-1]]
        assert stages[-1][0] == ("FROM", "runtime") and "product" in named
        # the product stage is built on no stage of this file: not on the dependencies
        assert named["product"][0][1].split()[0] not in named
    moving = [i for i, (w, r) in enumerate(final) if w == "ARG" and r.startswith(("REVISION",
                                                                                   "CREATED"))]
    assert moving and min(moving) > layers[-1], "REVISION and CREATED after the last layer"
    # the README is no input of any image
    assert not any(w in ("COPY", "ADD") and "README" in r for w, r in steps)


def test_constraints_pin_every_package_exactly() -> None:
    lines = [
        line.strip()
        for line in (REPO / "images" / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines
    bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", line)]
    assert bad == []
    names = {line.split("==")[0].lower().replace("_", "-") for line in lines}
    for needed in ("pip", "setuptools", "torch", "cuda-bindings", "nixl", "kopf", "vllm-router"):
        assert needed in names, needed


def test_build_script_labels_the_images_with_the_version_and_revision() -> None:
    env = {**os.environ, "REGISTRY": "reg.example/ml", "ENGINE": "buildah"}
    proc = subprocess.run(
        [str(REPO / "scripts" / "build-images.sh"), "--dry-run", "--push"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    commands = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    builds = [c for c in commands if c[:2] == ["buildah", "build"]]
    pushes = [c for c in commands if c[:2] == ["buildah", "push"]]
    version = dwdp.__version__
    assert [c[c.index("--tag") + 1] for c in builds] == [
        f"reg.example/ml/dwdp-{name}:{version}" for name in IMAGES
    ]
    assert [c[2] for c in pushes] == [f"reg.example/ml/dwdp-{name}:{version}" for name in IMAGES]
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    for c in builds:
        build_args = {
            c[i + 1].split("=")[0]: c[i + 1].split("=", 1)[1]
            for i, w in enumerate(c)
            if w == "--build-arg"
        }
        assert build_args["VERSION"] == version
        assert build_args["REVISION"].removesuffix("-dirty") == (revision or "unknown")
        assert build_args["SOURCE"] and build_args["CREATED"]
        assert c[-1] == "."


def test_install_doc_deployment_passes_the_models() -> None:
    """The DwdpDeployments of docs/install.md (the first one, which a newcomer copies, and
    the one of the DRA and placement section) are valid and ask for the GPUs, the pull
    Secret and the worker image the page describes."""
    import yaml

    from dwdp.api.deployment import DwdpDeploymentSpec
    from dwdp.api.enums import Role
    from dwdp.operator import constants as c
    from dwdp.operator.builders import role_template

    text = (REPO / "docs" / "install.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "DwdpDeployment" in b]
    first, dra = (DwdpDeploymentSpec.model_validate(yaml.safe_load(b)["spec"]) for b in blocks)
    template = role_template(first, Role.CONTEXT)
    assert template["resources"]["requests"][c.GPU_RESOURCE] == 4
    assert template["resources"]["limits"][c.GPU_RESOURCE] == 4
    assert template["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["image"].endswith(f"/dwdp-worker:{dwdp.__version__}")
    # the section on DRA and placement: each role claims its template (4 GPUs per context
    # pod, 1 per generation pod) and asks no device plugin
    for role, claimed in ((Role.CONTEXT, "h200-x4"), (Role.GENERATION, "h200-x1")):
        template = role_template(dra, role)
        assert template["resourceClaims"] == [
            {"name": c.GPU_CLAIM, "resourceClaimTemplateName": claimed}
        ]
        assert c.GPU_RESOURCE not in template["resources"].get("limits", {})
        assert template["image"] == first.image
