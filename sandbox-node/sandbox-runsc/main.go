// Command sandbox-runsc stands in for runsc under containerd's gVisor shim
// (the shim's `binary_name`) so that a pod can come back from a memory image
// instead of starting fresh. Everything else passes through to runsc
// unchanged, by exec.
//
// The shim runs `runsc create --bundle B ... ID` and then `runsc start ID`
// for the pod's sandbox (pause) container and then for each of its
// containers. When the pod carries the annotation sandbox.dev/restore-from
// (containerd passes it into each container's OCI spec when configured to:
// pod_annotations), naming a complete image of the pod's namespace in the
// checkpoint store, each `start` becomes `runsc restore --detach
// --image-path IMAGE ID`: gVisor restores the whole sandbox once the last of
// the checkpointed containers is there, matching them by container name.
//
// The decision is taken once per pod, when its sandbox container is created,
// and recorded under runsc's state root; the pod's containers follow it, each
// name once: a container the kubelet restarts later starts fresh in the
// restored sandbox. An
// image that is missing, incomplete or written by another runsc build is
// not restored: the pod starts fresh (the operator sees that memory was lost
// from the agent, which then is a new process).
//
// A pod whose sandbox was checkpointed (sandbox-checkpoint marked it ended)
// never starts containers again: the kubelet restarts the containers of a
// pod whose processes all stopped, and fresh processes would change the
// workspace that the image expects as it was. Its containers are deleted
// with --force (see onDelete).
//
// Environment (from containerd's): SANDBOX_RUNSC, the real runsc (required);
// SANDBOX_CHECKPOINTS, the checkpoint store (without it, everything passes
// through).
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"sandbox-operator.local/sandbox-node/internal/store"
)

const (
	restoreAnnotation  = "sandbox.dev/restore-from"
	typeAnnotation     = "io.kubernetes.cri.container-type"
	sandboxIDAnnot     = "io.kubernetes.cri.sandbox-id"
	namespaceAnnot     = "io.kubernetes.cri.sandbox-namespace"
	podUIDAnnot        = "io.kubernetes.cri.sandbox-uid"
	containerNameAnnot = "io.kubernetes.cri.container-name"
)

func main() {
	runsc := os.Getenv("SANDBOX_RUNSC")
	if runsc == "" {
		fail("SANDBOX_RUNSC is not set: it names the runsc this command runs")
	}
	args := os.Args[1:]
	if checkpoints := os.Getenv("SANDBOX_CHECKPOINTS"); checkpoints != "" {
		var err error
		args, err = rewrite(args, store.Store(checkpoints), runsc)
		if err != nil {
			fail(err.Error())
		}
	}
	err := syscall.Exec(runsc, append([]string{runsc}, args...), os.Environ())
	fail(fmt.Sprintf("exec %s: %v", runsc, err))
}

func fail(message string) {
	fmt.Fprintln(os.Stderr, "sandbox-runsc: "+message)
	os.Exit(1)
}

// rewrite returns the runsc command line to run for args.
func rewrite(args []string, checkpoints store.Store, runsc string) ([]string, error) {
	at := subcommand(args)
	if at < 0 || len(args) < at+2 {
		return args, nil
	}
	root := globalFlag(args[:at], "root")
	if root == "" {
		return args, nil
	}
	switch args[at] {
	case "create", "start", "delete":
	default:
		return args, nil
	}
	// The container ID names files of ours: the last argument of these three.
	id := args[len(args)-1]
	if strings.ContainsAny(id, "/") || id == "." || id == ".." {
		return nil, fmt.Errorf("container ID %q is not a file name", id)
	}
	records := store.Records(root)
	switch args[at] {
	case "create":
		bundle := commandFlag(args[at+1:], "bundle")
		if bundle == "" {
			return args, nil
		}
		return args, onCreate(root, id, bundle, checkpoints, runsc)
	case "start":
		image, err := os.ReadFile(filepath.Join(records, id+".restore"))
		if err != nil {
			return args, nil
		}
		restore := []string{"restore", "--detach", "--image-path=" + string(image), id}
		return append(append([]string{}, args[:at]...), restore...), nil
	case "delete":
		_ = os.Remove(filepath.Join(records, id+".restore"))
		restored, _ := filepath.Glob(filepath.Join(records, id+".restored-*"))
		for _, path := range restored {
			_ = os.Remove(path)
		}
		return onDelete(args, at, records, id, checkpoints, runsc), nil
	}
	return args, nil
}

// onDelete forces the deletion of a container of a checkpointed pod, once
// its gVisor sandbox process is gone. The sandbox stops with the checkpoint,
// but the shim's first delete comes while that process is still going away
// (freeing the memory it held takes its time): runsc then refuses to delete
// a container it still sees running, cannot reach the sandbox to destroy
// the container, or cannot remove the pod's cgroup that the process is still
// in, and containerd retries with a doubling backoff, which held the pod's
// deletion 5-7 s after a save that took a third of a second. Nothing
// of such a pod is to run again, so there is nothing for a refusal to
// protect.
func onDelete(args []string, at int, records, id string, checkpoints store.Store, runsc string) []string {
	pod := filepath.Join(records, id+".pod")
	uid, err := os.ReadFile(pod)
	if err != nil {
		return args
	}
	_ = os.Remove(pod)
	if !checkpoints.Ended(string(uid)) {
		return args
	}
	awaitSandboxGone(runsc, args[:at], id, sandboxExitLimit)
	for _, arg := range args[at+1:] {
		if arg == "--force" || arg == "-force" || arg == "--force=true" {
			return args
		}
	}
	forced := append(append([]string{}, args[:at+1]...), "--force")
	return append(forced, args[at+1:]...)
}

// sandboxExitLimit bounds the wait for a checkpointed sandbox's process to
// exit (measured: well under a second for a 1 GiB sandbox); past it, the
// delete goes ahead and containerd's retries take over.
const sandboxExitLimit = 10 * time.Second

// awaitSandboxGone waits until the process of container id's gVisor sandbox
// (the pid of `runsc state`) is gone, or limit has passed.
func awaitSandboxGone(runsc string, globals []string, id string, limit time.Duration) {
	command := append(append([]string{}, globals...), "state", id)
	out, err := exec.Command(runsc, command...).Output()
	if err != nil {
		return
	}
	var state struct {
		Pid int `json:"pid"`
	}
	if json.Unmarshal(out, &state) != nil || state.Pid <= 0 {
		return
	}
	for deadline := time.Now().Add(limit); time.Now().Before(deadline) && !gone(state.Pid); {
		time.Sleep(20 * time.Millisecond)
	}
}

// gone says whether process pid has exited and been reaped: runsc asks
// kill(pid, 0), which succeeds for a zombie too.
func gone(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return errors.Is(err, os.ErrNotExist)
}

// onCreate decides (for a pod's sandbox container) or follows (for its other
// containers) whether the container is restored, and refuses the containers
// of a pod that was checkpointed.
func onCreate(root, id, bundle string, checkpoints store.Store, runsc string) error {
	records := store.Records(root)
	annotations, err := readAnnotations(filepath.Join(bundle, "config.json"))
	if err != nil {
		return err
	}
	uid := annotations[podUIDAnnot]
	if uid != "" && checkpoints.Ended(uid) {
		return fmt.Errorf("pod %s was checkpointed; its containers do not start again (delete the pod)", uid)
	}
	if uid != "" {
		// For delete, which is given the container ID alone; without it, the
		// container is deleted as the shim asks (slower after a checkpoint).
		if err := os.MkdirAll(records, 0o700); err != nil {
			warn("%v", err)
		} else if err := os.WriteFile(filepath.Join(records, id+".pod"), []byte(uid), 0o600); err != nil {
			warn("%v", err)
		}
	}
	var image string
	switch annotations[typeAnnotation] {
	case "sandbox":
		if uid != "" {
			// For sandbox-checkpoint, which is asked by pod; a pod it cannot
			// record cannot be checkpointed, and still runs.
			if err := store.RecordPod(root, uid, id); err != nil {
				warn("%v", err)
				uid = ""
			}
		}
		image = restorable(annotations, checkpoints, runsc)
		if image != "" && uid != "" {
			// Once per pod: a sandbox the kubelet makes again for the same pod
			// (the first one died) starts fresh; the workspace has moved on
			// since the image.
			once := filepath.Join(records, "restored-pod-"+uid)
			if _, err := os.Stat(once); err == nil {
				warn("not restoring %s again into pod %s: it was restored once", image, uid)
				image = ""
			} else if err := os.MkdirAll(records, 0o700); err == nil {
				_ = os.WriteFile(once, nil, 0o600)
			}
		}
	case "container":
		image = followed(records, annotations)
	}
	if image == "" {
		return nil
	}
	if err := os.MkdirAll(records, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(records, id+".restore"), []byte(image), 0o600)
}

// followed is the image a container of a restoring pod is restored from: its
// pod's, the first time a container of its name is created in that sandbox.
// The kubelet restarts a container that exits under the same name, and a
// restart is a fresh start in the running, restored sandbox.
func followed(records string, annotations map[string]string) string {
	sandbox := annotations[sandboxIDAnnot]
	image, err := os.ReadFile(filepath.Join(records, sandbox+".restore"))
	if err != nil || strings.ContainsAny(sandbox, "/") {
		return ""
	}
	name := annotations[containerNameAnnot]
	if name == "" || strings.ContainsAny(name, "/") {
		return string(image)
	}
	once := filepath.Join(records, sandbox+".restored-"+name)
	if _, err := os.Stat(once); err == nil {
		return ""
	}
	_ = os.WriteFile(once, nil, 0o600)
	return string(image)
}

// restorable is the image a pod's sandbox restores from, or "" to start fresh.
func restorable(annotations map[string]string, checkpoints store.Store, runsc string) string {
	key := annotations[restoreAnnotation]
	if key == "" {
		return ""
	}
	image, err := checkpoints.Image(annotations[namespaceAnnot], key)
	if err != nil {
		warn("not restoring: %v", err)
		return ""
	}
	wrote, err := store.CompleteBuild(image)
	if err != nil {
		warn("not restoring: %v", err)
		return ""
	}
	current, err := store.RunscBuild(runsc)
	if err != nil {
		warn("not restoring %s: %v", image, err)
		return ""
	}
	if wrote != current {
		warn("not restoring %s: written by runsc %s, this node runs %s", image, wrote, current)
		return ""
	}
	return image
}

// warn goes to the shim's log (runsc's stderr).
func warn(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "sandbox-runsc: "+format+"\n", args...)
}

func readAnnotations(path string) (map[string]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.Unmarshal(data, &spec); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	return spec.Annotations, nil
}

// subcommand is the index of the first argument that is not a flag: the
// shim passes every global flag as --name=value.
func subcommand(args []string) int {
	for i, arg := range args {
		if !strings.HasPrefix(arg, "-") {
			return i
		}
	}
	return -1
}

// globalFlag is the value of --name=value among the global flags.
func globalFlag(globals []string, name string) string {
	for _, arg := range globals {
		for _, prefix := range []string{"--" + name + "=", "-" + name + "="} {
			if value, ok := strings.CutPrefix(arg, prefix); ok {
				return value
			}
		}
	}
	return ""
}

// commandFlag is the value of a subcommand's flag, as "--name value" or "--name=value".
func commandFlag(args []string, name string) string {
	for i, arg := range args {
		for _, flag := range []string{"--" + name, "-" + name} {
			if arg == flag && i+1 < len(args) {
				return args[i+1]
			}
			if value, ok := strings.CutPrefix(arg, flag+"="); ok {
				return value
			}
		}
	}
	return ""
}
