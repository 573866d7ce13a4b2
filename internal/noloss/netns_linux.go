package noloss

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"syscall"
)

// setns is the system call's number (package syscall has no SYS_SETNS on amd64).
var setns = map[string]uintptr{"amd64": 308, "arm64": 268, "riscv64": 268, "loong64": 268, "386": 346, "arm": 375, "ppc64le": 350, "s390x": 339}[runtime.GOARCH]

// dialIn returns dial made in the network namespace at path: on a thread of its own
// that enters the namespace (setns) and ends with the dial (locked, never unlocked:
// Go discards the thread), so the socket belongs to that namespace and the rest of
// the process stays where it was.
func dialIn(path string, dial func(network, addr string) (net.Conn, error)) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		type result struct {
			conn net.Conn
			err  error
		}
		done := make(chan result, 1)
		go func() {
			runtime.LockOSThread()
			f, err := os.Open(path)
			if err != nil {
				done <- result{nil, fmt.Errorf("network namespace: %w", err)}
				return
			}
			defer f.Close()
			if setns == 0 {
				done <- result{nil, fmt.Errorf("network namespace %s: setns's number on %s is not known here", path, runtime.GOARCH)}
				return
			}
			if _, _, errno := syscall.RawSyscall(setns, f.Fd(), syscall.CLONE_NEWNET, 0); errno != 0 {
				done <- result{nil, fmt.Errorf("setns %s: %w", path, errno)}
				return
			}
			conn, err := dial(network, addr)
			done <- result{conn, err}
		}()
		r := <-done
		return r.conn, r.err
	}
}
