#!/bin/bash
# Start the real kube-proxy (prototype, issue 36) with $1/kube-proxy.yaml (mode from
# RN_PROXY_MODE at up.py time, default iptables). The Service CIDR (10.0.0.0/24) must be
# routed to a local device FIRST, or a ClusterIP without DNAT would leave the machine by the
# default route. This kernel has no dummy links ("ip link add x type dummy": Unknown device
# type), so lo:   ip route add 10.0.0.0/24 dev lo
S=${1:-/tmp/rn/cp}
BIN=${DEVNODE_BIN:-/tmp/rn/bin/devnode}
ip route show 10.0.0.0/24 | grep -q 'dev lo' || { echo "no local route for the Service CIDR" >&2; exit 1; }
cd "$S"
setsid "$BIN" kube-proxy --config="$S/kube-proxy.yaml" --v=2 </dev/null >>"$S/logs/real-kube-proxy.log" 2>&1 &
echo $! > "$S/run/real-kube-proxy.pid"
echo "kube-proxy pid $(cat "$S/run/real-kube-proxy.pid"), log $S/logs/real-kube-proxy.log"
