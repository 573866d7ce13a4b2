//go:build unix

package noloss_test

import (
	"os/exec"
	"syscall"
)

// killProcessGroup makes cmd run in a process group of its own, killed whole when
// cmd's context ends: the script's children (the chroot's rabbitmqctl and its Erlang
// VM) go with it.
func killProcessGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}
