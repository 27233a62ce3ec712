package main

import (
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// runEtcd starts a single-member embedded etcd and serves until SIGTERM or SIGINT.
// Flags: --data-dir, --listen-client-url, --listen-peer-url (plain http on loopback).
// Returns the process exit status.
func runEtcd(args []string) int {
	fs := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "etcd-data", "directory of the etcd data")
	clientURL := fs.String("listen-client-url", "http://127.0.0.1:2379", "client URL")
	peerURL := fs.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL")
	quotaBytes := fs.Int64("quota-backend-bytes", 2<<30, "backend size quota in bytes")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cu, err := url.Parse(*clientURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: bad --listen-client-url: %v\n", err)
		return 2
	}
	pu, err := url.Parse(*peerURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: bad --listen-peer-url: %v\n", err)
		return 2
	}
	cfg := embed.NewConfig()
	cfg.Name = "devcluster"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.QuotaBackendBytes = *quotaBytes
	cfg.LogLevel = "warn"
	// A test cluster favours start-up time over durability of the last writes.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: start: %v\n", err)
		return 1
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		fmt.Fprintln(os.Stderr, "etcd: not ready after 60 s")
		return 1
	}
	fmt.Fprintf(os.Stderr, "etcd: ready on %s\n", cu.String())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-sig:
		fmt.Fprintf(os.Stderr, "etcd: %v, stopping\n", s)
	case err := <-e.Err():
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	}
	return 0
}
