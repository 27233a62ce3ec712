#!/bin/bash
# Start Debian's containerd 1.6 without systemd (prototype, issue 36): config containerd.toml
# (root/state/socket under /tmp/rn/containerd, cgroupfs, overlayfs, runc,
# restrict_oom_score_adj), then import the pause and busybox OCI archives made by mkimage.py.
set -e
D=/tmp/rn/containerd
mkdir -p $D /tmp/rn/cni/net.d
cp "$(dirname "$0")/containerd.toml" $D/config.toml
cd $D
setsid containerd --config $D/config.toml </dev/null >>$D/containerd.log 2>&1 &
echo $! > $D/pid
for i in $(seq 50); do [ -S $D/containerd.sock ] && break; sleep 0.1; done
for img in /tmp/rn/pause.tar /tmp/rn/busybox.tar; do
  [ -f $img ] && ctr --address $D/containerd.sock -n k8s.io image import $img
done
echo "containerd pid $(cat $D/pid)"
