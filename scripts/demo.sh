#!/usr/bin/env bash
# The README's demo command. From nothing on a fresh machine: makes the virtual environment
# .venv with every Python package, builds the local control plane (cached), then runs the
# driver scripts/demo.py: the embedded cluster, the operator installed by its Helm chart, a
# tiny DeepSeek-V3-family checkpoint, examples/04-demo.yaml applied (2 DWDP groups of 4 ranks
# and a generation server, with vllm-router in front), requests through the router (a context
# rank prefills, the generation server decodes; each answer says which) checked against a
# single-process reference, time to Ready and requests/s through the router, teardown.
# The cluster's node is a real one (containerd, the kubelet, kube-proxy): the system packages
# it and the image builds need are installed first (scripts/system-packages.sh), and the driver
# builds the operator and worker images (cached; the worker's takes minutes the first time).
# Options go to the driver: --keep (leave it running; prints how to reach and stop it),
# --state-dir DIR, --requests N, --node process (process kubelets instead: no packages, no
# images; pods run from .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

PY=${PYTHON:-python3}
# the options first (the system's Python, standard library only): a typo fails before minutes
# of set-up; --help prints and stops here
status=0
node=$("$PY" scripts/demo.py --parse-only "$@") || status=$?
[ "$status" -eq 10 ] && { printf '%s\n' "$node"; exit 0; }  # the help
[ "$status" -eq 0 ] || exit "$status"
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import dwdp.worker.loading.checkpoint, dwdp.operator, fastapi, httpx, kopf" 2>/dev/null; then
  log "installing Python packages (first run: a few minutes)"
  # -qq: errors only (with -q pip warns about every release of lm-eval's pytablewriter whose
  # metadata it refuses, some 480 lines)
  .venv/bin/python -m pip install -qq --upgrade pip
  .venv/bin/python -m pip install -qq -e ".[test]" -e ./tools
fi
export PATH="$PWD/.venv/bin:$PATH"

if [ "$node" = real ]; then  # process kubelets need no packages and no images
  . scripts/system-packages.sh
  install_system_packages
fi

log "building the local control plane (first build: about 11 minutes on 2 cores; cached afterwards)"
dwdp dev build --tools

log "running the demo"
exec .venv/bin/python scripts/demo.py "$@"
