//go:build unix

package main

import (
	"os/exec"
	"syscall"
)

// killProcessGroup starts cmd in a process group of its own and, when its context
// ends, kills the whole group.
func killProcessGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
}
