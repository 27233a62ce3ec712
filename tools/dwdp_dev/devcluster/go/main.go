// Command devcluster is the multi-call binary of dwdp's local control plane.
//
// Usage: devcluster etcd|apiserver|controller-manager|scheduler|kubelet|kube-proxy|version [flags...]
//
// Each component runs as its own process of this binary, so feature gates, metrics
// registries and klog flags (all process-global) never clash. kubelet and kube-proxy are the
// real node's (dwdp dev up --node real), from the same pinned Kubernetes release.
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
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s etcd|apiserver|controller-manager|scheduler|kubelet|kube-proxy|version [flags...]\n",
		filepath.Base(os.Args[0]))
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	name, args := os.Args[1], os.Args[2:]
	switch name {
	case "etcd":
		os.Exit(runEtcd(args))
	case "apiserver", "kube-apiserver":
		cmd := apiserver.NewAPIServerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "controller-manager", "kube-controller-manager":
		cmd := controllermanager.NewControllerManagerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "scheduler", "kube-scheduler":
		cmd := scheduler.NewSchedulerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
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
