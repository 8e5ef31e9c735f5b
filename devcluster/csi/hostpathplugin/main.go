// Command hostpathplugin is a small CSI driver that keeps each volume as an
// ext4 filesystem of its size (a loop-mounted sparse image file) under one
// data directory of the node and snapshots it with tar.
//
// It stands in for github.com/kubernetes-csi/csi-driver-host-path, which the
// Go module proxy reachable from the development machines does not serve. It
// follows that driver's model (tar snapshots, controller and node service in
// one process) but enforces each volume's size, and is for single-node
// development and test clusters only: no topology, no block volumes, no
// expansion. It runs as root (mount, loop devices).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"sandbox-operator.local/csi-devcluster/internal/unixgrpc"
)

var version = "devcluster"

func main() {
	endpoint := flag.String("endpoint", "", "unix socket to serve CSI on (path or unix:// URL)")
	driverName := flag.String("drivername", "hostpath.csi.k8s.io", "CSI driver name")
	nodeID := flag.String("nodeid", "", "node id reported by NodeGetInfo (the Kubernetes node name)")
	dataDir := flag.String("datadir", "", "directory holding volumes, snapshots and the state file")
	snapshots := flag.Bool("snapshots", true, "advertise and serve CREATE_DELETE_SNAPSHOT and LIST_SNAPSHOTS")
	showVersion := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *showVersion {
		fmt.Println(version)
		return
	}
	if *endpoint == "" || *nodeID == "" || *dataDir == "" {
		log.Fatal("--endpoint, --nodeid and --datadir are required")
	}
	driver, err := newDriver(*driverName, *nodeID, *dataDir, *snapshots)
	if err != nil {
		log.Fatalf("cannot open data dir: %v", err)
	}
	socket := strings.TrimPrefix(*endpoint, "unix://")
	server := grpc.NewServer(grpc.UnaryInterceptor(logCalls))
	csi.RegisterIdentityServer(server, driver)
	csi.RegisterControllerServer(server, driver)
	csi.RegisterNodeServer(server, driver)
	log.Printf("%s %s serving on %s (node %s, data %s, snapshots %v)",
		*driverName, version, socket, *nodeID, *dataDir, *snapshots)
	if err := unixgrpc.Serve(socket, server, nil); err != nil {
		log.Fatal(err)
	}
}

// logCalls logs every call and its outcome: the only trace of what the
// sidecars and the kubelet asked for, in the component's log file.
func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	began := time.Now()
	resp, err := handler(ctx, req)
	method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
	if method == "Probe" || method == "NodeGetVolumeStats" {
		if err != nil {
			log.Printf("%s failed: %v", method, err)
		}
		return resp, err
	}
	if err != nil {
		log.Printf("%s %v -> error %v (%s)", method, req, err, time.Since(began).Round(time.Millisecond))
	} else {
		log.Printf("%s %v -> ok (%s)", method, req, time.Since(began).Round(time.Millisecond))
	}
	return resp, err
}

func errorf(code codes.Code, format string, args ...any) error {
	return status.Errorf(code, format, args...)
}
