package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// defaultSize is the capacity recorded for a volume whose request names none.
const defaultSize = 1 << 30

type driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	name      string
	nodeID    string
	snapshots bool
	store     *store
}

func newDriver(name, nodeID, dataDir string, snapshots bool) (*driver, error) {
	s, err := openStore(dataDir)
	if err != nil {
		return nil, err
	}
	s.mountAll()
	return &driver{name: name, nodeID: nodeID, snapshots: snapshots, store: s}, nil
}

func newID() string {
	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		panic(err)
	}
	return hex.EncodeToString(raw)
}

// ---- identity ----------------------------------------------------------------

func (d *driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.name, VendorVersion: version}, nil
}

func (d *driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	// No VOLUME_ACCESSIBILITY_CONSTRAINTS: one node, so volumes carry no
	// topology and PVs get no node affinity.
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
			Type: csi.PluginCapability_Service_CONTROLLER_SERVICE,
		}},
	}}}, nil
}

func (d *driver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

// ---- controller ----------------------------------------------------------------

func (d *driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	kinds := []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	}
	if d.snapshots {
		kinds = append(kinds,
			csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
			csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)
	}
	var caps []*csi.ControllerServiceCapability
	for _, kind := range kinds {
		caps = append(caps, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: kind}},
		})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func checkCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return errorf(codes.InvalidArgument, "volume capabilities missing")
	}
	for _, c := range caps {
		if c.GetBlock() != nil {
			return errorf(codes.InvalidArgument, "block volumes are not supported")
		}
		if c.GetMount() == nil {
			return errorf(codes.InvalidArgument, "access type must be mount")
		}
	}
	// Every access mode is fine: all pods are on this one node and share
	// the directory through bind mounts.
	return nil
}

func (d *driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, errorf(codes.InvalidArgument, "name missing")
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	size := req.GetCapacityRange().GetRequiredBytes()
	limit := req.GetCapacityRange().GetLimitBytes()
	if size == 0 {
		size = limit
	}
	if size == 0 {
		size = defaultSize
	}
	var fromSnapshot, fromVolume string
	if src := req.GetVolumeContentSource(); src != nil {
		fromSnapshot = src.GetSnapshot().GetSnapshotId()
		fromVolume = src.GetVolume().GetVolumeId()
	}

	s := d.store
	s.mu.Lock()
	if v := s.volumeByName(req.GetName()); v != nil {
		s.mu.Unlock()
		// Idempotent retry (e.g. after the provisioner's RPC timeout).
		if v.Size < req.GetCapacityRange().GetRequiredBytes() || (limit > 0 && v.Size > limit) ||
			v.Snapshot != fromSnapshot || v.Volume != fromVolume {
			return nil, errorf(codes.AlreadyExists, "volume %s exists with other parameters", req.GetName())
		}
		return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
	}
	if err := s.claim("volume/" + req.GetName()); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	defer s.release("volume/" + req.GetName())
	var sourceFile, sourceDir string
	if fromSnapshot != "" {
		snap, ok := s.data.Snapshots[fromSnapshot]
		if !ok || !d.snapshots {
			s.mu.Unlock()
			return nil, errorf(codes.NotFound, "snapshot %s not found", fromSnapshot)
		}
		if snap.Size > size {
			s.mu.Unlock()
			return nil, errorf(codes.OutOfRange, "snapshot %s is %d bytes, more than the %d requested", fromSnapshot, snap.Size, size)
		}
		sourceFile = s.snapshotFile(snap.ID)
	}
	if fromVolume != "" {
		src, ok := s.data.Volumes[fromVolume]
		if !ok {
			s.mu.Unlock()
			return nil, errorf(codes.NotFound, "volume %s not found", fromVolume)
		}
		if err := s.ensureMounted(src); err != nil {
			s.mu.Unlock()
			return nil, errorf(codes.Internal, "mounting volume %s: %v", fromVolume, err)
		}
		if src.Size > size {
			s.mu.Unlock()
			return nil, errorf(codes.OutOfRange, "volume %s is %d bytes, more than the %d requested", fromVolume, src.Size, size)
		}
		sourceDir = s.volumeDir(src.ID)
	}
	s.mu.Unlock()

	v := &volume{ID: newID(), Name: req.GetName(), Size: size, Snapshot: fromSnapshot, Volume: fromVolume, Created: now(), Filesystem: volumeFS}
	dir, image := s.volumeDir(v.ID), s.volumeImage(v.ID)
	if err := makeFilesystem(image, dir, size); err != nil {
		_ = removeVolume(image, dir)
		return nil, errorf(codes.Internal, "creating the volume's filesystem: %v", err)
	}
	var err error
	switch {
	case sourceFile != "":
		err = run("tar", "--extract", "--numeric-owner", "--file", sourceFile, "--directory", dir)
	case sourceDir != "":
		err = run("cp", "--archive", "--reflink=auto", sourceDir+"/.", dir+"/")
	}
	if err != nil {
		_ = removeVolume(image, dir)
		return nil, errorf(codes.Internal, "populating volume: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.data.Volumes[v.ID] = v
	if err := s.save(); err != nil {
		delete(s.data.Volumes, v.ID)
		_ = removeVolume(image, dir)
		return nil, errorf(codes.Internal, "saving state: %v", err)
	}
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
}

func (d *driver) csiVolume(v *volume) *csi.Volume {
	out := &csi.Volume{VolumeId: v.ID, CapacityBytes: v.Size}
	if v.Snapshot != "" {
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: v.Snapshot}}}
	}
	if v.Volume != "" {
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: v.Volume}}}
	}
	return out
}

func (d *driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, errorf(codes.InvalidArgument, "volume id missing")
	}
	s := d.store
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.data.Volumes[id]; !ok {
		return &csi.DeleteVolumeResponse{}, nil // already gone: idempotent
	}
	if err := removeVolume(s.volumeImage(id), s.volumeDir(id)); err != nil {
		return nil, errorf(codes.Internal, "%v", err)
	}
	delete(s.data.Volumes, id)
	if err := s.save(); err != nil {
		return nil, errorf(codes.Internal, "saving state: %v", err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (d *driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, errorf(codes.InvalidArgument, "volume id missing")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, errorf(codes.InvalidArgument, "volume capabilities missing")
	}
	d.store.mu.Lock()
	_, ok := d.store.data.Volumes[req.GetVolumeId()]
	d.store.mu.Unlock()
	if !ok {
		return nil, errorf(codes.NotFound, "volume %s not found", req.GetVolumeId())
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// CreateSnapshot tars the volume directory, synchronously: the snapshot is
// cut and complete when the call returns (ready_to_use=true), like the
// upstream hostpath driver. It is a copy of a live directory, not an atomic
// point-in-time image: writers must be quiet while it runs.
func (d *driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if !d.snapshots {
		return nil, errorf(codes.Unimplemented, "snapshots are disabled for this driver")
	}
	if req.GetName() == "" || req.GetSourceVolumeId() == "" {
		return nil, errorf(codes.InvalidArgument, "name and source volume id are required")
	}
	s := d.store
	s.mu.Lock()
	if snap := s.snapshotByName(req.GetName()); snap != nil {
		s.mu.Unlock()
		if snap.Source != req.GetSourceVolumeId() {
			return nil, errorf(codes.AlreadyExists, "snapshot %s exists for another volume", req.GetName())
		}
		return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(snap)}, nil
	}
	source, ok := s.data.Volumes[req.GetSourceVolumeId()]
	if !ok {
		s.mu.Unlock()
		return nil, errorf(codes.NotFound, "volume %s not found", req.GetSourceVolumeId())
	}
	if err := s.ensureMounted(source); err != nil {
		s.mu.Unlock()
		return nil, errorf(codes.Internal, "mounting volume %s: %v", source.ID, err)
	}
	if err := s.claim("snapshot/" + req.GetName()); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	defer s.release("snapshot/" + req.GetName())
	snap := &snapshot{ID: newID(), Name: req.GetName(), Source: source.ID, Size: source.Size, Created: now()}
	sourceDir := s.volumeDir(source.ID)
	s.mu.Unlock()

	file := s.snapshotFile(snap.ID)
	tmp := file + ".partial"
	// Plain tar, no compression: gzip would make a 1 GiB snapshot CPU-bound
	// on a 2-core machine for little gain on a scratch disk.
	if err := run("tar", "--create", "--numeric-owner", "--sparse", "--file", tmp, "--directory", sourceDir, "."); err != nil {
		_ = os.Remove(tmp)
		return nil, errorf(codes.Internal, "tar: %v", err)
	}
	if err := os.Rename(tmp, file); err != nil {
		return nil, errorf(codes.Internal, "%v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.data.Snapshots[snap.ID] = snap
	if err := s.save(); err != nil {
		delete(s.data.Snapshots, snap.ID)
		_ = os.Remove(file)
		return nil, errorf(codes.Internal, "saving state: %v", err)
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(snap)}, nil
}

func csiSnapshot(snap *snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     snap.ID,
		SourceVolumeId: snap.Source,
		// The source volume's capacity: restoreSize must fit the PVC that
		// restores it, and the PVC asks for at least the source's size.
		SizeBytes:    snap.Size,
		CreationTime: timestamppb.New(timeOf(snap.Created)),
		ReadyToUse:   true,
	}
}

func (d *driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if !d.snapshots {
		return nil, errorf(codes.Unimplemented, "snapshots are disabled for this driver")
	}
	id := req.GetSnapshotId()
	if id == "" {
		return nil, errorf(codes.InvalidArgument, "snapshot id missing")
	}
	s := d.store
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.data.Snapshots[id]; !ok {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	if err := os.Remove(s.snapshotFile(id)); err != nil && !os.IsNotExist(err) {
		return nil, errorf(codes.Internal, "%v", err)
	}
	delete(s.data.Snapshots, id)
	if err := s.save(); err != nil {
		return nil, errorf(codes.Internal, "saving state: %v", err)
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

func (d *driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	if !d.snapshots {
		return nil, errorf(codes.Unimplemented, "snapshots are disabled for this driver")
	}
	s := d.store
	s.mu.Lock()
	var found []*snapshot
	for _, snap := range s.data.Snapshots {
		if req.GetSnapshotId() != "" && snap.ID != req.GetSnapshotId() {
			continue
		}
		if req.GetSourceVolumeId() != "" && snap.Source != req.GetSourceVolumeId() {
			continue
		}
		found = append(found, snap)
	}
	s.mu.Unlock()
	sort.Slice(found, func(i, j int) bool { return found[i].ID < found[j].ID })
	start := 0
	if token := req.GetStartingToken(); token != "" {
		n, err := strconv.Atoi(token)
		if err != nil || n < 0 || n > len(found) {
			return nil, errorf(codes.Aborted, "invalid starting token %q", token)
		}
		start = n
	}
	end := len(found)
	if limit := int(req.GetMaxEntries()); limit > 0 && start+limit < end {
		end = start + limit
	}
	resp := &csi.ListSnapshotsResponse{}
	for _, snap := range found[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(snap)})
	}
	if end < len(found) {
		resp.NextToken = strconv.Itoa(end)
	}
	return resp, nil
}

// run executes a data-copying helper; its output goes into the error.
func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %v: %v: %s", name, args, err, out)
	}
	return nil
}
