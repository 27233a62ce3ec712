#!/bin/bash
# Start the real kubelet (prototype, issue 36) against the throwaway control plane that up.py
# prepared in $1 (default /tmp/rn/cp). Background process; pid in $1/run/real-kubelet.pid.
S=${1:-/tmp/rn/cp}
BIN=${DEVNODE_BIN:-/tmp/rn/bin/devnode}
HOST_IP=${HOST_IP:-192.0.2.2}
mkdir -p "$S/kubelet" "$S/pod-logs" "$S/logs" "$S/run"
cd "$S"
setsid "$BIN" kubelet \
  --config="$S/kubelet.yaml" \
  --kubeconfig="$S/node.kubeconfig" \
  --root-dir="$S/kubelet" \
  --cert-dir="$S/kubelet/pki" \
  --hostname-override=rn-node \
  --node-ip="$HOST_IP" \
  --v=2 \
  </dev/null >>"$S/logs/real-kubelet.log" 2>&1 &
echo $! > "$S/run/real-kubelet.pid"
echo "kubelet pid $(cat "$S/run/real-kubelet.pid"), log $S/logs/real-kubelet.log"
