// Package checkpoint takes a running gVisor pod's image into the node's
// checkpoint store (see sandbox-checkpoint for the command, sandbox-node for
// the node component that runs it for the operator).
package checkpoint

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"sandbox-operator.local/sandbox-node/internal/store"
)

// Runsc is the node's runsc as the shim runs it.
type Runsc struct {
	Path  string   // the runsc binary (not sandbox-runsc)
	Root  string   // its state root, as the shim passes it
	Flags []string // global flags, name=value
	// How long a checkpoint may take before it is given up (killed, the
	// partial image removed); zero: DefaultTimeout.
	Timeout time.Duration
}

// DefaultTimeout bounds a checkpoint: minutes for the largest memory a
// sandbox holds (about 2.8 s per GiB measured on a 2-core node).
const DefaultTimeout = 10 * time.Minute

// Result is what a checkpoint took.
type Result struct {
	Image string `json:"image"`
	Bytes int64  `json:"bytes"`
}

// Take saves pod uid's gVisor sandbox, every container of it, as image key
// of namespace. The pod's processes stop with the image and the pod is
// marked ended (sandbox-runsc starts none of its containers again). The
// image is written beside its final place and renamed there once runsc is
// done, with its `complete` file last. On failure nothing is left in the
// store and the pod is not marked: gVisor resumes a sandbox whose save
// failed.
func Take(runsc Runsc, checkpoints store.Store, namespace, uid, key string) (Result, error) {

	image, err := checkpoints.Image(namespace, key)
	if err != nil {
		return Result{}, err
	}
	partial, err := checkpoints.Partial(namespace, key)
	if err != nil {
		return Result{}, err
	}
	sandbox, err := store.PodSandbox(runsc.Root, uid)
	if err != nil {
		return Result{}, err
	}
	build, err := store.RunscBuild(runsc.Path)
	if err != nil {
		return Result{}, err
	}
	if err := os.RemoveAll(partial); err != nil {
		return Result{}, err
	}
	if err := os.MkdirAll(partial, 0o700); err != nil {
		return Result{}, err
	}
	if err := checkpoints.End(uid); err != nil {
		return Result{}, err
	}
	args := []string{"--root=" + runsc.Root}
	for _, f := range runsc.Flags {
		args = append(args, "--"+f)
	}
	args = append(args, "checkpoint", "--image-path="+partial, sandbox)
	timeout := runsc.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if out, err := exec.CommandContext(ctx, runsc.Path, args...).CombinedOutput(); err != nil {
		_ = os.RemoveAll(partial)
		_ = checkpoints.Unend(uid)
		return Result{}, fmt.Errorf("runsc checkpoint of pod %s (sandbox %s): %v: %s", uid, sandbox, err, lastLines(out))
	}
	if err := os.WriteFile(filepath.Join(partial, store.CompleteFile), []byte(build+"\n"), 0o600); err != nil {
		return Result{}, err
	}
	if err := os.RemoveAll(image); err != nil && !errors.Is(err, os.ErrNotExist) {
		return Result{}, err
	}
	if err := os.Rename(partial, image); err != nil {
		return Result{}, err
	}
	return Result{Image: image, Bytes: store.SizeOf(image)}, nil
}

// lastLines keeps the end of runsc's output, where its error is.
func lastLines(out []byte) string {
	text := strings.TrimSpace(string(out))
	if len(text) > 2000 {
		text = "..." + text[len(text)-2000:]
	}
	return text
}

// Flags registers the flags both commands that take images share: --runsc,
// --root, --store and the repeatable --runsc-flag. The returned function,
// called after flag.Parse, gives their values or says which is missing.
func Flags() func() (Runsc, store.Store, error) {
	path := flag.String("runsc", "", "the runsc binary the node's shim runs (not sandbox-runsc)")
	root := flag.String("root", "", "runsc's state root, as the shim passes it")
	storeDir := flag.String("store", "", "the checkpoint store")
	var runscFlags Repeated
	flag.Var(&runscFlags, "runsc-flag", "a global runsc flag, name=value (repeatable)")
	return func() (Runsc, store.Store, error) {
		for name, value := range map[string]string{"runsc": *path, "root": *root, "store": *storeDir} {
			if value == "" {
				return Runsc{}, "", fmt.Errorf("--%s is required", name)
			}
		}
		return Runsc{Path: *path, Root: *root, Flags: runscFlags}, store.Store(*storeDir), nil
	}
}

// Repeated is a flag given any number of times.
type Repeated []string

func (r *Repeated) String() string     { return strings.Join(*r, ",") }
func (r *Repeated) Set(v string) error { *r = append(*r, v); return nil }
