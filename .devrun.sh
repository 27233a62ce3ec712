#!/usr/bin/env bash
export DWDP_CACHE_DIR=$PWD/.devcache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 scripts/gpu-suite.sh exec python3 bench/spec_decode.py --device cuda 2>&1 | grep -v "DEBUG    torch.__trace\|Loading weights\|carried:\|machine's own\|Writing model" | tail -12
cp bench/results/spec_decode-cuda.json "$OUT"/
GPU_SUITE_NAME=spec-greedy timeout 200 scripts/gpu-suite.sh run tests/gpu/test_speculative_gpu.py -q 2>&1 | tail -4
cp bench/results/gpu-suite-spec-greedy-*.txt "$OUT"/
