// The local cluster's DNS server (real node only): CoreDNS with the plugins its Corefile
// uses and no others. Built by `build.build_coredns()` into its own cached binary; the
// Corefile is written by dwdp_dev/devcluster/clusterdns.py.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() { coremain.Run() }
