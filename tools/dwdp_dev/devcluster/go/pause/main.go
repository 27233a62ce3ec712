// Command pause is the pod sandbox ("pause") process of the real node (dwdp dev up --node
// real): it sleeps until SIGINT/SIGTERM and reaps zombies, like registry.k8s.io/pause (which
// cannot be pulled here: no registry is reachable). Built static (CGO_ENABLED=0) and packed
// into a one-layer OCI image by dwdp_dev.devcluster.realnode.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
