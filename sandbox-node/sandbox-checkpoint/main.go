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
// workspace stays what the image expects); see checkpoint.Take.
//
// Prints one JSON object: {"image", "bytes", "seconds"}; exit status 1 and
// the reason on stderr otherwise.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"sandbox-operator.local/sandbox-node/internal/checkpoint"
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
	runs := checkpoint.Runsc{Path: *runsc, Root: *root, Flags: runscFlags}
	taken, err := checkpoint.Take(runs, store.Store(*storeDir), *namespace, *uid, *key)
	if err != nil {
		fail(err)
	}
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{
		"image": taken.Image, "bytes": taken.Bytes, "seconds": time.Since(began).Seconds(),
	})
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "sandbox-checkpoint: "+err.Error())
	os.Exit(1)
}
