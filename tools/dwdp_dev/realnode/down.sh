#!/bin/bash
# Tear down the real-node prototype (issue 36) and undo its host changes. Order matters:
# pods first (while kubelet+CNI can still tear their networks down), then kube-proxy rules,
# kubelet, containerd and its shims, mounts, bridge, routes, sysctls, control plane.
# Kills only pids recorded in pid files. Args: STATE_DIR (default /tmp/rn/cp).
S=${1:-/tmp/rn/cp}
D=/tmp/rn/containerd
BIN=${DEVNODE_BIN:-/tmp/rn/bin/devnode}
KUBECTL=${KUBECTL:-$HOME/.cache/dwdp/tools/kubectl-v37-2.0.0/bin/kubectl}
CTR="ctr --address $D/containerd.sock -n k8s.io"
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
stop() { local p; p=$(cat "$1" 2>/dev/null) || return 0; alive "$p" || return 0; kill "$p"
         for _ in $(seq 100); do alive "$p" || return 0; sleep 0.1; done; kill -9 "$p"; }

# 1. pods, through the API while the kubelet still runs (CNI DEL frees IPs, veths, netns)
if alive "$(cat $S/run/real-kubelet.pid 2>/dev/null)"; then
  $KUBECTL --kubeconfig $S/kubeconfig delete pods --all -A --grace-period=0 --force --wait=false >/dev/null 2>&1
  for _ in $(seq 150); do [ -z "$($CTR tasks ls -q 2>/dev/null)" ] && break; sleep 0.2; done
fi
# 2. kube-proxy and its rules (iptables and nftables)
stop $S/run/real-kube-proxy.pid
"$BIN" kube-proxy --cleanup >/dev/null 2>&1
# 3. kubelet
stop $S/run/real-kubelet.pid
# 4. whatever containerd still runs, then containerd and its shims (pids from shim.pid files)
if [ -S $D/containerd.sock ]; then
  for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks kill -s SIGKILL $t; done; sleep 0.5
  for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks rm -f $t; done
  for c in $($CTR containers ls -q 2>/dev/null); do $CTR containers rm $c; done
fi
shims=$(cat $D/state/io.containerd.runtime.v2.task/k8s.io/*/shim.pid 2>/dev/null)
stop $D/pid
for p in $shims; do alive $p && kill -9 $p; done
# 5. mounts under the kubelet root and containerd state/root (deepest first), CNI netns
grep -E " ($S/kubelet|$D)" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
for ns in $(ip netns list | awk '/^cni-/{print $1}'); do ip netns del $ns; done
# 6. bridge, Service route, kubelet's iptables chains, the no-off-host guard, sysctls
ip link del rnbr0 2>/dev/null
ip route del 10.0.0.0/24 dev lo 2>/dev/null
for ipt in iptables ip6tables; do
  for t in filter nat mangle; do
    $ipt -t $t -S | awk '/^-A/ && /KUBE-|rn-probe/' | sed 's/^-A/-D/' | while read -r rule; do
      eval "$ipt -t $t $rule" 2>/dev/null; done
    for c in $($ipt -t $t -S | awk '/^-N KUBE-/{print $2}'); do $ipt -t $t -F $c; done
    for c in $($ipt -t $t -S | awk '/^-N KUBE-/{print $2}'); do $ipt -t $t -X $c; done
  done
done
# iptables-nft tables that are left empty (only base chains, no rules) are removed
for tab in "ip filter" "ip nat" "ip mangle" "ip6 filter" "ip6 nat" "ip6 mangle"; do
  nft list table $tab >/dev/null 2>&1 || continue
  nft list table $tab | grep -qvE '^\s*(table|chain|type|\}|$)' || nft delete table $tab
done
# containerd 1.6 keeps shim sockets, fifos and the runc root under /run/containerd whatever
# its state= says; remove what is left empty
[ -d /run/containerd ] && find /run/containerd -depth -type d -empty -delete
sysctl -qw net.ipv4.ip_forward=${RN_IP_FORWARD:-0} net.ipv4.conf.all.route_localnet=0
# 7. control plane (devcluster API: stops etcd/apiserver/cm/scheduler, removes its pod route)
PYTHONPATH=$(cd "$(dirname "$0")/.." && cd .. && pwd) /work/main/.venv/bin/python \
  "$(dirname "$0")/up.py" $S 0.0.0.0 0.0.0.0/0 down
echo "down done"
