package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
)

// volume and snapshot are what state.json records; the directories and tar
// files under the data dir are the data.
type volume struct {
	ID       string `json:"id"`
	Name     string `json:"name"`
	Size     int64  `json:"size"`
	Snapshot string `json:"sourceSnapshot,omitempty"`
	Volume   string `json:"sourceVolume,omitempty"`
	Created  int64  `json:"created"`
	// Filesystem is "ext4" for a volume kept in an image file of its size,
	// mounted at its directory; empty for a plain directory (volumes made by
	// an older driver, which enforced no size).
	Filesystem string `json:"filesystem,omitempty"`
}

type snapshot struct {
	ID      string `json:"id"`
	Name    string `json:"name"`
	Source  string `json:"sourceVolume"`
	Size    int64  `json:"size"`
	Created int64  `json:"created"`
}

type stateFile struct {
	Volumes   map[string]*volume   `json:"volumes"`
	Snapshots map[string]*snapshot `json:"snapshots"`
}

// store is the driver's state: the maps, persisted to state.json after each
// change so that a restarted driver still knows its volumes and snapshots.
// The mutex covers the maps only; copying data (tar) runs outside it, with
// `busy` marking names whose operation is in progress.
type store struct {
	dir  string
	mu   sync.Mutex
	data stateFile
	busy map[string]bool
}

func openStore(dir string) (*store, error) {
	for _, sub := range []string{"volumes", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o750); err != nil {
			return nil, err
		}
	}
	s := &store{dir: dir, busy: map[string]bool{}}
	s.data = stateFile{Volumes: map[string]*volume{}, Snapshots: map[string]*snapshot{}}
	raw, err := os.ReadFile(s.path())
	if err == nil {
		if err := json.Unmarshal(raw, &s.data); err != nil {
			return nil, fmt.Errorf("%s: %w", s.path(), err)
		}
	} else if !os.IsNotExist(err) {
		return nil, err
	}
	if s.data.Volumes == nil {
		s.data.Volumes = map[string]*volume{}
	}
	if s.data.Snapshots == nil {
		s.data.Snapshots = map[string]*snapshot{}
	}
	return s, nil
}

func (s *store) path() string { return filepath.Join(s.dir, "state.json") }

func (s *store) volumeDir(id string) string { return filepath.Join(s.dir, "volumes", id) }

func (s *store) volumeImage(id string) string {
	return filepath.Join(s.dir, "volumes", id+".img")
}

func (s *store) snapshotFile(id string) string {
	return filepath.Join(s.dir, "snapshots", id+".tar")
}

// save writes state.json atomically; callers hold mu.
func (s *store) save() error {
	raw, err := json.MarshalIndent(s.data, "", "  ")
	if err != nil {
		return err
	}
	tmp := s.path() + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, s.path())
}

// claim marks `key` as in progress. A second request for the same name while
// the first still copies data (a sidecar retries after its RPC timeout) gets
// Aborted, which the CSI spec reserves for exactly this, and retries later.
func (s *store) claim(key string) error {
	if s.busy[key] {
		return errorf(codes.Aborted, "an operation on %s is in progress", key)
	}
	s.busy[key] = true
	return nil
}

func (s *store) release(key string) {
	s.mu.Lock()
	delete(s.busy, key)
	s.mu.Unlock()
}

func (s *store) volumeByName(name string) *volume {
	for _, v := range s.data.Volumes {
		if v.Name == name {
			return v
		}
	}
	return nil
}

func (s *store) snapshotByName(name string) *snapshot {
	for _, snap := range s.data.Snapshots {
		if snap.Name == name {
			return snap
		}
	}
	return nil
}

func now() int64 { return time.Now().UnixNano() }

func timeOf(nanos int64) time.Time { return time.Unix(0, nanos) }
