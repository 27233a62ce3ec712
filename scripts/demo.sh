#!/usr/bin/env bash
# The README's demo command. From nothing on a fresh machine: installs the system packages the
# real node and the image builds need (scripts/system-packages.sh), then makes the virtual
# environment .venv with every Python package, builds the local control plane and builds the
# operator and worker images beside each other (each cached; the worker's dependencies take
# minutes the first time), then runs the driver scripts/demo.py: the embedded cluster (a real
# node: containerd, the kubelet, kube-proxy), the operator installed by its Helm chart, a tiny
# DeepSeek-V3-family checkpoint, examples/04-demo.yaml applied (2 DWDP groups of 4 ranks and a
# generation server, with vllm-router in front), requests through the router (a context rank
# prefills, the generation server decodes; each answer says which) checked against a
# single-process reference, time to Ready and requests/s through the router, teardown.
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
# The set-up runs in three phases; within each, steps run beside each other (2 cores: what waits
# on the network runs beside what computes). Each background step logs to $logs/<step>.log and
# prints one line when it ends; a failed step prints its log's tail and stops the demo.
logs=$(mktemp -d /tmp/dwdp-demo-setup.XXXXXX)
declare -A pids began
trap 'jobs -p | xargs -r kill 2>/dev/null' EXIT  # a failed step stops the others too
bg() {  # bg STEP COMMAND...: run COMMAND in the background, logged
  local step=$1; shift
  began[$step]=$SECONDS
  ( status=0; "$@" >"$logs/$step.log" 2>&1 || status=$?
    echo "$SECONDS" >"$logs/$step.end"; exit "$status" ) &
  pids[$step]=$!
}
await() {  # await STEP: wait for it; stop the demo if it failed
  local step=$1 status=0
  wait "${pids[$step]}" || status=$?
  if [ "$status" -ne 0 ]; then
    printf '\n%s failed (exit %s); the end of %s:\n' "$step" "$status" "$logs/$step.log" >&2
    tail -n 30 "$logs/$step.log" >&2
    exit "$status"
  fi
  printf '   %s done in %d s\n' "$step" $(($(cat "$logs/$step.end") - began[$step]))
}
venv() {  # .venv (scripts/venv.sh), unless it already imports the demo's packages
  if ! .venv/bin/python -c "import dwdp.worker.loading.checkpoint, dwdp.operator, fastapi, httpx, kopf" 2>/dev/null; then
    . scripts/venv.sh
    install_venv
  fi
}

# `dwdp dev build` and `dwdp dev images` need only the standard library (python3 -m
# dwdp_dev.devcluster, src/ and tools/ on PYTHONPATH): the control plane's build and the images
# do not wait for .venv.
dev() { PYTHONPATH="$PWD/src:$PWD/tools" "$PY" -m dwdp_dev.devcluster "$@"; }

log "set-up 1/2: system packages, .venv, the control plane and the images, beside each other"
if [ "$node" = real ]; then  # process kubelets need no packages and no images
  . scripts/system-packages.sh
  bg system-packages install_system_packages
fi
control_plane() {  # the Go modules, then the build (without Go it reports what is missing)
  if command -v go >/dev/null 2>&1; then
    (cd tools/dwdp_dev/devcluster/go && go mod download)
  fi
  dev build --tools
}
bg control-plane control_plane
bg venv venv
if [ "$node" = real ]; then
  await system-packages
  # the images print their own progress; the worker's dependencies take minutes the first time
  dev images --only operator --only worker >/dev/null
fi
await control-plane
await venv
export PATH="$PWD/.venv/bin:$PATH"
rm -rf "$logs"

log "set-up 2/2: the demo (the node imports the worker image beside the operator's install)"
exec .venv/bin/python scripts/demo.py "$@"
