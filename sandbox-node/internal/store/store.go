// Package store is the node's checkpoint store: where a sandbox's memory
// image lives between a pause and the resume that restores it, and the small
// records sandbox-runsc and sandbox-checkpoint share about pods.
//
// Layout under the store directory (root-owned, never mounted into a pod):
//
//	<namespace>/<key>/          a complete image (runsc's checkpoint files)
//	<namespace>/<key>/complete  written last: the runsc version that took it
//	<namespace>/.<key>.partial/ an image being written (renamed when done)
//	.ended/<pod uid>            a pod whose sandbox was checkpointed: its
//	                            containers must not start again
//
// Names come from pod annotations, which a pod's author chooses: every name
// is checked against Kubernetes' DNS label rules before it becomes a path, so
// no annotation can reach outside the store.
package store

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// CompleteFile marks an image as whole; it holds the RunscBuild that wrote it.
const CompleteFile = "complete"

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)

// podUID: what a pod UID is, as a file name: a UUID from the API server, or a
// static pod's hash (hex, no dashes).
var podUID = regexp.MustCompile(`^[0-9a-f][0-9a-f-]{0,63}$`)

// Store is a checkpoint store directory.
type Store string

// CheckName says why name cannot name a namespace or an image, or nil.
func CheckName(what, name string) error {
	if len(name) > 63 || !dnsLabel.MatchString(name) {
		return fmt.Errorf("%s %q is not a DNS label (lower-case letters, digits and '-', at most 63)", what, name)
	}
	return nil
}

// Image is the directory of a complete image.
func (s Store) Image(namespace, key string) (string, error) {
	if err := CheckName("namespace", namespace); err != nil {
		return "", err
	}
	if err := CheckName("checkpoint key", key); err != nil {
		return "", err
	}
	return filepath.Join(string(s), namespace, key), nil
}

// Partial is where an image is written before it is complete.
func (s Store) Partial(namespace, key string) (string, error) {
	image, err := s.Image(namespace, key)
	if err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(image), "."+key+".partial"), nil
}

// RunscBuild names the runsc binary at path by its content. gVisor restores
// only what the same build saved, and a version string does not tell two
// builds of one commit (patched, or built by another toolchain) apart.
func RunscBuild(path string) (string, error) {
	file, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer file.Close()
	digest := sha256.New()
	if _, err := io.Copy(digest, file); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(digest.Sum(nil)), nil
}

// CompleteBuild is the RunscBuild a complete image was written by, or an
// error saying why the image is not there or not complete.
func CompleteBuild(image string) (string, error) {
	data, err := os.ReadFile(filepath.Join(image, CompleteFile))
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("no complete image at %s", image)
	}
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(data)), nil
}

func (s Store) ended(uid string) (string, error) {
	if !podUID.MatchString(uid) {
		return "", fmt.Errorf("pod UID %q is not a UID", uid)
	}
	return filepath.Join(string(s), ".ended", uid), nil
}

// End records that pod uid's sandbox is being checkpointed: from now on its
// containers do not start again (the kubelet would restart them, fresh, on
// the workspace the image expects unchanged).
func (s Store) End(uid string) error {
	path, err := s.ended(uid)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return os.WriteFile(path, nil, 0o600)
}

// Ended says whether pod uid was checkpointed (see End).
func (s Store) Ended(uid string) bool {
	path, err := s.ended(uid)
	if err != nil {
		return false
	}
	_, err = os.Stat(path)
	return err == nil
}

// Unend takes back End, for a checkpoint that failed (its sandbox runs on).
func (s Store) Unend(uid string) error {
	path, err := s.ended(uid)
	if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Records is sandbox-runsc's directory under runsc's state root: restore
// decisions by container ID, and each pod's current gVisor sandbox.
func Records(root string) string {
	return filepath.Join(root, "sandbox-runsc")
}

// RecordPod notes that pod uid runs in gVisor sandbox id (its sandbox container).
func RecordPod(root, uid, id string) error {
	if !podUID.MatchString(uid) {
		return fmt.Errorf("pod UID %q is not a UID", uid)
	}
	dir := filepath.Join(Records(root), "pods")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, uid), []byte(id), 0o600)
}

// PodSandbox is the gVisor sandbox (sandbox container ID) pod uid runs in.
func PodSandbox(root, uid string) (string, error) {
	if !podUID.MatchString(uid) {
		return "", fmt.Errorf("pod UID %q is not a UID", uid)
	}
	id, err := os.ReadFile(filepath.Join(Records(root), "pods", uid))
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("no gVisor sandbox of pod %s on this node", uid)
	}
	return strings.TrimSpace(string(id)), err
}

// ForgetEnded drops the ended marks older than age: by then their pods are
// long gone (the operator deletes a checkpointed pod at once).
func (s Store) ForgetEnded(age time.Duration) {
	dir := filepath.Join(string(s), ".ended")
	entries, _ := os.ReadDir(dir)
	for _, entry := range entries {
		if info, err := entry.Info(); err == nil && time.Since(info.ModTime()) > age {
			_ = os.Remove(filepath.Join(dir, entry.Name()))
		}
	}
}

// SizeOf is the size of the files of an image directory.
func SizeOf(dir string) int64 {
	var total int64
	entries, _ := os.ReadDir(dir)
	for _, entry := range entries {
		if info, err := entry.Info(); err == nil {
			total += info.Size()
		}
	}
	return total
}
