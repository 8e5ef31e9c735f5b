// Command registrar registers a CSI driver with the kubelet's plugin watcher,
// like github.com/kubernetes-csi/node-driver-registrar (which the Go module
// proxy reachable here does not serve): it asks the driver for its name, then
// serves the kubelet plugin registration API on
// <plugin-registration-dir>/<driver name>-reg.sock until it is stopped.
// The kubelet finds that socket, calls GetInfo to learn the driver's CSI
// endpoint, registers the driver (CSINode, node annotation) and reports the
// outcome through NotifyRegistrationStatus.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"sandbox-operator.local/csi-devcluster/internal/unixgrpc"
)

var version = "devcluster"

type registrar struct {
	registerapi.UnimplementedRegistrationServer
	driverName string
	endpoint   string
	statusFile string
}

func (r *registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	log.Printf("kubelet asked for plugin info")
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driverName,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		// Like upstream: a rejected registration is fatal, so it shows as a
		// dead component instead of a silently unusable driver.
		log.Fatalf("kubelet rejected the registration of %s: %s", r.driverName, st.Error)
	}
	log.Printf("kubelet registered %s", r.driverName)
	if r.statusFile != "" {
		if err := os.WriteFile(r.statusFile, []byte("registered\n"), 0o644); err != nil {
			log.Printf("writing %s: %v", r.statusFile, err)
		}
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// driverName asks the CSI driver for its name, retrying until it answers:
// the registrar may start before the driver's socket exists.
func driverName(address string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	target := "unix://" + strings.TrimPrefix(address, "unix://")
	for {
		conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			var info *csi.GetPluginInfoResponse
			info, err = csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
			cancel()
			conn.Close()
			if err == nil {
				return info.GetName(), nil
			}
		}
		if time.Now().After(deadline) {
			return "", err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func main() {
	csiAddress := flag.String("csi-address", "", "the driver's CSI socket, as this process reaches it")
	kubeletPath := flag.String("kubelet-registration-path", "", "the driver's CSI socket, as the kubelet reaches it (default: --csi-address)")
	registrationDir := flag.String("plugin-registration-dir", "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registration directory")
	statusFile := flag.String("status-file", "", "file written once the kubelet confirmed the registration")
	socketName := flag.String("socket-name", "", "name of the registration socket (default: <driver name>-reg.sock); the kubelet accepts any name, and a short one keeps a deep kubelet root dir within the 107 bytes of a unix socket path")
	showVersion := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *showVersion {
		fmt.Println(version)
		return
	}
	if *csiAddress == "" {
		log.Fatal("--csi-address is required")
	}
	if *kubeletPath == "" {
		*kubeletPath = strings.TrimPrefix(*csiAddress, "unix://")
	}
	name, err := driverName(*csiAddress, 60*time.Second)
	if err != nil {
		log.Fatalf("no answer from the CSI driver at %s: %v", *csiAddress, err)
	}
	if *statusFile != "" {
		_ = os.Remove(*statusFile)
	}
	if *socketName == "" {
		*socketName = name + "-reg.sock"
	}
	socket := filepath.Join(*registrationDir, *socketName)
	server := grpc.NewServer()
	registerapi.RegisterRegistrationServer(server, &registrar{
		driverName: name, endpoint: *kubeletPath, statusFile: *statusFile,
	})
	log.Printf("registrar %s for %s (endpoint %s) serving on %s", version, name, *kubeletPath, socket)
	// Removing the socket first is what tells the kubelet's plugin watcher
	// that the driver is gone (it deregisters it).
	if err := unixgrpc.Serve(socket, server, func() { _ = os.Remove(socket) }); err != nil {
		log.Fatal(err)
	}
}
