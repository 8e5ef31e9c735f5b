// Package unixgrpc serves a gRPC server on a unix socket until SIGTERM or
// SIGINT: what the hostpath driver and the registrar both do, and both must
// do alike, since their sockets are how the sidecars and the kubelet find
// them (a stale socket left by a killed predecessor would make Listen fail;
// a socket left after a clean stop would point the kubelet at nothing).
//
// Imported as sandbox-operator.local/csi-devcluster/internal/unixgrpc: the
// module path devcluster/build.py gives these sources (go_source_module of
// the name "csi-devcluster" that devcluster/storage.py builds them under).
package unixgrpc

import (
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
)

// gracePeriod bounds a graceful stop: in-flight calls (a snapshot's tar of a
// large volume) may finish, but the component's stop must not hang on them.
const gracePeriod = 5 * time.Second

// Serve listens on socket (replacing a stale one, creating its directory)
// and serves until a signal arrives; then beforeStop runs (if given) and
// the server stops, gracefully for up to gracePeriod. The socket is removed
// once serving ends.
func Serve(socket string, server *grpc.Server, beforeStop func()) error {
	// The kubelet may create the directory too; whichever starts first wins.
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return err
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-stop
		log.Printf("stopping (%v)", sig)
		if beforeStop != nil {
			beforeStop()
		}
		done := make(chan struct{})
		go func() { server.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(gracePeriod):
			server.Stop()
		}
	}()
	err = server.Serve(listener)
	_ = os.Remove(socket)
	return err
}
