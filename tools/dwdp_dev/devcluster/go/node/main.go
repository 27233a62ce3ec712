// Command devnode is a prototype multi-call binary holding the real kubelet and kube-proxy of
// the same pinned Kubernetes release as the control plane (issue 36, feasibility probe).
//
// Usage: devnode kubelet|kube-proxy|version [flags...]
//
// It lives in its own package so the control plane binary (and its cache hash, which covers
// only the top-level files of tools/devcluster/go) is unchanged.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/component-base/version"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s kubelet|kube-proxy|version [flags...]\n", filepath.Base(os.Args[0]))
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	name, args := os.Args[1], os.Args[2:]
	switch name {
	case "kubelet":
		cmd := kubelet.NewKubeletCommand(context.Background())
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "kube-proxy", "proxy":
		cmd := proxy.NewProxyCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "version":
		fmt.Println(version.Get().GitVersion)
	default:
		usage()
		os.Exit(2)
	}
}
