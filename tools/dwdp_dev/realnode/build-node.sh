#!/bin/bash
cd /work/wt-node/tools/dwdp_dev/devcluster/go
start=$(date +%s)
GOMAXPROCS=1 nice -n 19 go build -p 1 -trimpath -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean" -o /tmp/rn/bin/devnode ./node
rc=$?
echo "rc=$rc elapsed=$(($(date +%s)-start))s"
