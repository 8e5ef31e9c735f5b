package main

import (
	"fmt"
	"log"
	"os"
	"path/filepath"
	"syscall"
)

// Each volume is an ext4 filesystem of the requested size in a sparse image
// file, loop-mounted at the volume's directory for as long as the driver
// keeps the volume. A workspace therefore fills up at its size with ENOSPC,
// and statfs (df, the kubelet's volume stats) reports that size, as on a real
// block-backed CSI driver. This kernel has no quota support, so project
// quotas on a shared filesystem were not an option.

const volumeFS = "ext4"

// makeFilesystem creates the image of `size` bytes, formats it and mounts it
// at `dir` (created here), leaving an empty root that any UID may write.
func makeFilesystem(image, dir string, size int64) error {
	file, err := os.OpenFile(image, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = file.Truncate(size) // sparse: only what is written takes disk space
	if closeErr := file.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return err
	}
	// -m 0: no blocks reserved for root, the whole size is the workspace's.
	// Lazy table and journal init: the fresh sparse file already reads as
	// zeros, and noinit_itable (below) keeps the kernel from zeroing them
	// again in the background.
	if err := run("mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o777); err != nil {
		return err
	}
	if err := mountImage(image, dir); err != nil {
		return err
	}
	// The workspace starts empty: users and snapshots should not meet
	// ext4's lost+found (fsck recreates it when it needs one).
	if err := os.Remove(filepath.Join(dir, "lost+found")); err != nil {
		return err
	}
	// 0777 like an emptyDir: pods run as arbitrary non-root UIDs and must
	// be able to write.
	return os.Chmod(dir, 0o777)
}

// mountImage loop-mounts `image` at `dir`. discard lets deleted files give
// their space back to the node (the loop device punches holes in the image).
func mountImage(image, dir string) error {
	return run("mount", "-t", volumeFS, "-o", "loop,discard,noinit_itable", image, dir)
}

// unmountVolume unmounts everything stacked on dir: a volume's filesystem
// (its loop device goes with it: mount -o loop sets autoclear), or a
// published target's bind mounts.
func unmountVolume(dir string) error {
	for {
		mounted, err := isMountPoint(dir)
		if err != nil || !mounted {
			return err
		}
		if err := syscall.Unmount(dir, 0); err != nil {
			return fmt.Errorf("unmount %s: %w", dir, err)
		}
	}
}

// removeVolume undoes makeFilesystem, or whatever part of it happened.
func removeVolume(image, dir string) error {
	if err := unmountVolume(dir); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.Remove(image); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}

// mountAll mounts the filesystem of every known volume that is not mounted:
// after the driver restarted following a node reboot or a cleanup that
// unmounted them. A volume that cannot be mounted is logged and left for the
// calls that need it to report.
func (s *store) mountAll() {
	for _, v := range s.data.Volumes {
		if err := s.ensureMounted(v); err != nil {
			log.Printf("volume %s: %v", v.ID, err)
		}
	}
}

// ensureMounted mounts the volume's filesystem if it is not mounted.
func (s *store) ensureMounted(v *volume) error {
	if v.Filesystem == "" {
		return nil // a plain directory
	}
	dir := s.volumeDir(v.ID)
	mounted, err := isMountPoint(dir)
	if err != nil || mounted {
		return err
	}
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return err
	}
	return mountImage(s.volumeImage(v.ID), dir)
}
