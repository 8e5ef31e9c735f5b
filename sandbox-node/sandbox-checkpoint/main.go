// Command sandbox-checkpoint saves a running gVisor pod, every container of
// it, into the node's checkpoint store, where sandbox-runsc restores it from
// when a pod naming the image in sandbox.dev/restore-from starts.
//
//	sandbox-checkpoint --runsc PATH --root DIR --store DIR \
//	    --namespace NS --pod-uid UID --key KEY [--runsc-flag name=value ...]
//
// --root is the runsc state root the shim uses; sandbox-runsc recorded there
// which gVisor sandbox runs the pod. The pod's processes stop when the image
// is taken (nothing runs between the image and the pod's deletion, so the
// workspace stays what the image expects), and the pod is marked ended so
// that the kubelet does not start its containers again. The image is written
// beside its final place and renamed there once runsc is done, with its
// `complete` file last. On failure nothing is left in the store and the pod
// is not marked: gVisor resumes a sandbox whose save failed.
//
// Prints one JSON object: {"image", "bytes", "seconds"}; exit status 1 and
// the reason on stderr otherwise.
package main

import (
	"encoding/json"
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

type flags []string

func (f *flags) String() string     { return strings.Join(*f, ",") }
func (f *flags) Set(v string) error { *f = append(*f, v); return nil }

func main() {
	runsc := flag.String("runsc", "", "the runsc binary the node's shim runs (not sandbox-runsc)")
	root := flag.String("root", "", "runsc's state root, as the shim passes it")
	storeDir := flag.String("store", "", "the checkpoint store")
	namespace := flag.String("namespace", "", "the pod's namespace")
	uid := flag.String("pod-uid", "", "the pod's UID")
	key := flag.String("key", "", "the image's name in the namespace")
	var runscFlags flags
	flag.Var(&runscFlags, "runsc-flag", "a global runsc flag, name=value (repeatable)")
	flag.Parse()
	for name, value := range map[string]string{"runsc": *runsc, "root": *root, "store": *storeDir, "pod-uid": *uid} {
		if value == "" {
			fail(fmt.Errorf("--%s is required", name))
		}
	}
	began := time.Now()
	image, size, err := checkpoint(*runsc, *root, store.Store(*storeDir), *namespace, *uid, *key, runscFlags)
	if err != nil {
		fail(err)
	}
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{
		"image": image, "bytes": size, "seconds": time.Since(began).Seconds(),
	})
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "sandbox-checkpoint: "+err.Error())
	os.Exit(1)
}

func checkpoint(runsc, root string, checkpoints store.Store, namespace, uid, key string, runscFlags []string) (string, int64, error) {
	image, err := checkpoints.Image(namespace, key)
	if err != nil {
		return "", 0, err
	}
	partial, err := checkpoints.Partial(namespace, key)
	if err != nil {
		return "", 0, err
	}
	sandbox, err := store.PodSandbox(root, uid)
	if err != nil {
		return "", 0, err
	}
	build, err := store.RunscBuild(runsc)
	if err != nil {
		return "", 0, err
	}
	if err := os.RemoveAll(partial); err != nil {
		return "", 0, err
	}
	if err := os.MkdirAll(partial, 0o700); err != nil {
		return "", 0, err
	}
	if err := checkpoints.End(uid); err != nil {
		return "", 0, err
	}
	args := []string{"--root=" + root}
	for _, f := range runscFlags {
		args = append(args, "--"+f)
	}
	args = append(args, "checkpoint", "--image-path="+partial, sandbox)
	if out, err := exec.Command(runsc, args...).CombinedOutput(); err != nil {
		_ = os.RemoveAll(partial)
		_ = checkpoints.Unend(uid)
		return "", 0, fmt.Errorf("runsc checkpoint of pod %s (sandbox %s): %v: %s", uid, sandbox, err, lastLines(out))
	}
	if err := os.WriteFile(filepath.Join(partial, store.CompleteFile), []byte(build+"\n"), 0o600); err != nil {
		return "", 0, err
	}
	if err := os.RemoveAll(image); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", 0, err
	}
	if err := os.Rename(partial, image); err != nil {
		return "", 0, err
	}
	return image, sizeOf(image), nil
}

func sizeOf(dir string) int64 {
	var total int64
	entries, _ := os.ReadDir(dir)
	for _, entry := range entries {
		if info, err := entry.Info(); err == nil {
			total += info.Size()
		}
	}
	return total
}

// lastLines keeps the end of runsc's output, where its error is.
func lastLines(out []byte) string {
	text := strings.TrimSpace(string(out))
	if len(text) > 2000 {
		text = "..." + text[len(text)-2000:]
	}
	return text
}
