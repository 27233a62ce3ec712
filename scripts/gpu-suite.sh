#!/usr/bin/env bash
# The GPU suite (tests/gpu, `pytest -m gpu`) on a CUDA machine whose Python has torch,
# transformers and triton but none of the worker's other packages, and no network.
#
#   scripts/gpu-suite.sh wheels
#       Here, with PyPI: downloads into .whl/ the worker's Python packages that such a machine
#       lacks (FastAPI, pydantic, pyzmq, msgpack, cuda-bindings, ...; each a wheel for CPython
#       3.12 on x86-64 Linux) and NIXL's CUDA 13 wheel without the parts no test loads, so that
#       .whl/ stays under about 60 MB. Run once; .whl/ is ignored by git.
#   scripts/gpu-suite.sh run [PYTEST ARGS...]
#       There: unpacks every wheel of .whl/ whose package the machine does not already have
#       into /tmp/gpu-suite-site, runs `pytest -m gpu tests/gpu` (or the pytest arguments
#       given) and writes the log, with the card's name in the file name, to
#       bench/results/gpu-suite[-$GPU_SUITE_NAME]-<card>.txt and, where $OUT names a folder, there too
#       (a machine lent through a remote runner gives back only that folder). Exits with
#       pytest's status.
#   scripts/gpu-suite.sh exec COMMAND [ARGS...]
#       There: the same packages and PYTHONPATH, then COMMAND (a bench, a diagnostic).
#
# With the device tool of this workplace the run is one call: command
# `scripts/gpu-suite.sh run`, carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.whl
# The worker's packages beyond torch, transformers, safetensors and tokenizers, with their
# dependencies; what the machine already has is left as it is (see `run`).
PACKAGES=(fastapi uvicorn pydantic pyzmq msgpack msgspec prometheus-client PyYAML httpx
          cuda-bindings apache-tvm-ffi jsonschema attrs jsonschema-specifications referencing
          rpds-py)
# Without their dependencies (xgrammar's are torch, transformers, triton, numpy, pydantic and
# apache-tvm-ffi: the machine has the first four, PACKAGES brings the others).
NO_DEPS=(xgrammar==0.2.9)
NIXL=nixl-cu13==1.5.1
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_26_x86_64)

download_wheels() {
  local py=${PYTHON:-python3}
  mkdir -p "$WHEELS"
  grep -qx "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >>.git/info/exclude
  "$py" -m pip download -q "${PLATFORM[@]}" -d "$WHEELS" "${PACKAGES[@]}"
  "$py" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${NO_DEPS[@]}"
  # NIXL's wheel needs torch and numpy (the machine has both): no dependencies. Its expert-
  # parallel extensions (nixl_ep_cu13, three builds of 31 MB for torch 2.12 to 2.14) and UCX's
  # perftest are left out: the tests load the agent and UCX's transports only.
  local tmp
  tmp=$(mktemp -d)
  "$py" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$tmp" "$NIXL" nixl==1.5.1
  mv "$tmp"/nixl-1.5.1-*.whl "$WHEELS"/
  local wheel=("$tmp"/nixl_cu13-*.whl) dest=$PWD/$WHEELS
  (mkdir "$tmp/x" && cd "$tmp/x" && unzip -q "${wheel[0]}" \
     && rm -rf nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest* \
     && zip -q -9 -r "$dest/$(basename "${wheel[0]}")" .)
  rm -rf "$tmp"
  du -sh "$WHEELS"
}

install_wheels() {
  # A wheel is a zip of the package's files: unpacked, not installed through pip (the machine
  # has no network, and a package already there keeps its version).
  local site=$1
  rm -rf "$site" && mkdir -p "$site"
  python3 - "$WHEELS" "$site" <<'EOF'
import importlib.metadata as md, pathlib, re, sys, zipfile
wheels, site = pathlib.Path(sys.argv[1]), sys.argv[2]
added, kept = [], []
for wheel in sorted(wheels.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        kept.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        zipfile.ZipFile(wheel).extractall(site)
        added.append(wheel.name.split("-")[0] + " " + wheel.name.split("-")[1])
print("carried:", ", ".join(added) or "nothing")
print("the machine's own:", ", ".join(kept) or "nothing")
EOF
}

prepare() {
  local site=/tmp/gpu-suite-site
  if [ -d "$WHEELS" ]; then
    install_wheels "$site"
  else
    echo "no $WHEELS/: nothing carried (scripts/gpu-suite.sh wheels makes it)"
  fi
  export PYTHONPATH="$PWD/src:$PWD/tools:$site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
}

run_suite() {
  local name=${GPU_SUITE_NAME:+-$GPU_SUITE_NAME}
  prepare
  local card
  card=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null \
         | tr 'A-Z' 'a-z' | grep -o 'h100\|h200\|b200\|gb200\|a100\|l40s' | head -1 || true)
  local log=bench/results/gpu-suite$name-${card:-unknown}.txt
  mkdir -p bench/results
  local status=0
  {
    echo "# scripts/gpu-suite.sh run $*"
    echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
      git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    else
      echo "no nvidia-smi on PATH"
    fi
    python3 -c 'import sys, torch, transformers, triton; print("python", sys.version.split()[0],
      "torch", torch.__version__, "transformers", transformers.__version__, "triton",
      triton.__version__)'
    python3 -c 'import nixl' 2>/dev/null && echo "nixl: importable" || echo "nixl: not importable"
    python3 -m pytest -p no:cacheprovider -m gpu -rA --durations=15 "${@:-tests/gpu}"
  } 2>&1 | tee "$log" ${OUT:+"$OUT/${log##*/}"} || status=$?
  echo "written: $log"
  return "$status"
}

case "${1:-}" in
  wheels) download_wheels ;;
  run) shift; run_suite "$@" ;;
  exec) shift; prepare; exec "$@" ;;
  *) echo "usage: scripts/gpu-suite.sh wheels | run [PYTEST ARGS...] | exec COMMAND..." >&2
     exit 2 ;;
esac
