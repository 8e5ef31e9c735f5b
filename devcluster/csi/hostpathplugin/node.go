package main

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// The node service bind-mounts the volume directory (its filesystem's mount
// point) at the kubelet's target path. The driver runs as a host process in the kubelet's mount namespace,
// so the mount is visible to the kubelet and the container runtime as it is.

func (d *driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: d.nodeID}, nil
}

func (d *driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{
			Type: csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		}},
	}}}, nil
}

func (d *driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	target := req.GetTargetPath()
	if req.GetVolumeId() == "" || target == "" {
		return nil, errorf(codes.InvalidArgument, "volume id and target path are required")
	}
	if err := checkCapabilities([]*csi.VolumeCapability{req.GetVolumeCapability()}); err != nil {
		return nil, err
	}
	d.store.mu.Lock()
	v, ok := d.store.data.Volumes[req.GetVolumeId()]
	var mountErr error
	if ok {
		mountErr = d.store.ensureMounted(v)
	}
	d.store.mu.Unlock()
	if !ok {
		return nil, errorf(codes.NotFound, "volume %s not found", req.GetVolumeId())
	}
	if mountErr != nil {
		return nil, errorf(codes.Internal, "mounting volume %s: %v", v.ID, mountErr)
	}
	mounted, err := isMountPoint(target)
	if err != nil {
		return nil, errorf(codes.Internal, "%v", err)
	}
	if mounted {
		return &csi.NodePublishVolumeResponse{}, nil // idempotent
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, errorf(codes.Internal, "%v", err)
	}
	source := d.store.volumeDir(req.GetVolumeId())
	if err := syscall.Mount(source, target, "", syscall.MS_BIND, ""); err != nil {
		return nil, errorf(codes.Internal, "bind mount %s on %s: %v", source, target, err)
	}
	if req.GetReadonly() {
		// A bind mount ignores MS_RDONLY on creation; it takes a remount.
		flags := uintptr(syscall.MS_BIND | syscall.MS_REMOUNT | syscall.MS_RDONLY)
		if err := syscall.Mount("", target, "", flags, ""); err != nil {
			_ = syscall.Unmount(target, 0)
			return nil, errorf(codes.Internal, "read-only remount of %s: %v", target, err)
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := req.GetTargetPath()
	if req.GetVolumeId() == "" || target == "" {
		return nil, errorf(codes.InvalidArgument, "volume id and target path are required")
	}
	if err := unmountVolume(target); err != nil {
		return nil, errorf(codes.Internal, "%v", err)
	}
	if err := os.Remove(target); err != nil && !os.IsNotExist(err) {
		return nil, errorf(codes.Internal, "%v", err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (d *driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	path := req.GetVolumePath()
	if req.GetVolumeId() == "" || path == "" {
		return nil, errorf(codes.InvalidArgument, "volume id and path are required")
	}
	d.store.mu.Lock()
	_, ok := d.store.data.Volumes[req.GetVolumeId()]
	d.store.mu.Unlock()
	if !ok {
		return nil, errorf(codes.NotFound, "volume %s not found", req.GetVolumeId())
	}
	var fs syscall.Statfs_t
	if err := syscall.Statfs(path, &fs); err != nil {
		if os.IsNotExist(err) {
			return nil, errorf(codes.NotFound, "%s: %v", path, err)
		}
		return nil, errorf(codes.Internal, "%v", err)
	}
	size := int64(fs.Bsize)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{
			Unit:      csi.VolumeUsage_BYTES,
			Total:     int64(fs.Blocks) * size,
			Available: int64(fs.Bavail) * size,
			Used:      int64(fs.Blocks-fs.Bfree) * size,
		},
		{
			Unit:      csi.VolumeUsage_INODES,
			Total:     int64(fs.Files),
			Available: int64(fs.Ffree),
			Used:      int64(fs.Files - fs.Ffree),
		},
	}}, nil
}

// isMountPoint reports whether `path` is a mount point, from the kernel's
// mount table (comparing st_dev with the parent misses bind mounts of a
// directory of the same filesystem, which is what this driver makes).
func isMountPoint(path string) (bool, error) {
	clean, err := filepath.Abs(path)
	if err != nil {
		return false, err
	}
	file, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	defer file.Close()
	scanner := bufio.NewScanner(file)
	scanner.Buffer(make([]byte, 64*1024), 1024*1024)
	for scanner.Scan() {
		fields := strings.Fields(scanner.Text())
		if len(fields) > 4 && unescapeMount(fields[4]) == clean {
			return true, nil
		}
	}
	return false, scanner.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for space, ...).
func unescapeMount(field string) string {
	if !strings.Contains(field, `\`) {
		return field
	}
	var b strings.Builder
	for i := 0; i < len(field); i++ {
		if field[i] == '\\' && i+3 < len(field) {
			var value byte
			ok := true
			for _, c := range field[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				value = value*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(value)
				i += 3
				continue
			}
		}
		b.WriteByte(field[i])
	}
	return b.String()
}
