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
	"time"

	"sandbox-operator.local/sandbox-node/internal/checkpoint"
)

func main() {
	node := checkpoint.Flags()
	namespace := flag.String("namespace", "", "the pod's namespace")
	uid := flag.String("pod-uid", "", "the pod's UID")
	key := flag.String("key", "", "the image's name in the namespace")
	flag.Parse()
	runsc, checkpoints, err := node()
	if err != nil {
		fail(err)
	}
	if *uid == "" {
		fail(fmt.Errorf("--pod-uid is required"))
	}
	began := time.Now()
	taken, err := checkpoint.Take(runsc, checkpoints, *namespace, *uid, *key)
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
