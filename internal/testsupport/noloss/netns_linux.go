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

// dialIn returns dial made in the network namespace at path: on a thread locked to
// it that enters the namespace (setns), dials, and goes back to its own namespace
// before it is unlocked, so the socket belongs to that namespace and the rest of the
// process stays where it was. A thread that cannot go back stays locked: Go discards
// it with its goroutine (or, the main thread, never runs anything on it again; it
// then shows the process in that namespace, to `ip netns pids` for one).
func dialIn(path string, dial func(network, addr string) (net.Conn, error)) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		type result struct {
			conn net.Conn
			err  error
		}
		done := make(chan result, 1)
		go func() {
			runtime.LockOSThread()
			home, err := os.Open("/proc/thread-self/ns/net")
			if err != nil {
				runtime.UnlockOSThread()
				done <- result{nil, fmt.Errorf("network namespace: %w", err)}
				return
			}
			defer home.Close()
			f, err := os.Open(path)
			if err != nil {
				runtime.UnlockOSThread() // still at home
				done <- result{nil, fmt.Errorf("network namespace: %w", err)}
				return
			}
			defer f.Close()
			if setns == 0 {
				runtime.UnlockOSThread() // still at home
				done <- result{nil, fmt.Errorf("network namespace %s: setns's number on %s is not known here", path, runtime.GOARCH)}
				return
			}
			if _, _, errno := syscall.RawSyscall(setns, f.Fd(), syscall.CLONE_NEWNET, 0); errno != 0 {
				runtime.UnlockOSThread() // still at home
				done <- result{nil, fmt.Errorf("setns %s: %w", path, errno)}
				return
			}
			conn, err := dial(network, addr)
			if _, _, errno := syscall.RawSyscall(setns, home.Fd(), syscall.CLONE_NEWNET, 0); errno == 0 {
				runtime.UnlockOSThread()
			}
			done <- result{conn, err}
		}()
		r := <-done
		return r.conn, r.err
	}
}
