package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"time"
)

// CPU per retry: on a two-core machine that runs the broker beside the benchmark, a
// rate moves by 10% or more from one round to the next, while the CPU time a run
// costs moves far less. The prefetch step of the 4.3 suite reports, per kind, the CPU
// time this process (client) and the broker's VM (broker, -broker43pid) used per 1,000
// messages handled, read from /proc (Linux; elsewhere 0) at the start and the end of
// the run's consuming.

// brokerPID is the broker VM's process (beam.smp), 0 for none (-broker43pid).
var brokerPID int

// cpuUse is CPU time used, user and system.
type cpuUse struct{ client, broker time.Duration }

// cpuNow reads the CPU time used so far by this process and by the broker.
func cpuNow() cpuUse {
	u := cpuUse{client: procCPU("self")}
	if brokerPID > 0 {
		u.broker = procCPU(strconv.Itoa(brokerPID))
	}
	return u
}

func (u cpuUse) since(before cpuUse) cpuUse {
	return cpuUse{client: u.client - before.client, broker: u.broker - before.broker}
}

// per1000 is u per 1,000 of n messages, in milliseconds.
func (u cpuUse) per1000(n int) (client, broker float64) {
	if n <= 0 {
		return 0, 0
	}
	f := 1000 / float64(n) / float64(time.Millisecond)
	return float64(u.client) * f, float64(u.broker) * f
}

// clockTick is the unit of /proc/<pid>/stat's times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// procCPU returns utime + stime of /proc/<pid>/stat, 0 when it cannot be read.
func procCPU(pid string) time.Duration {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0
	}
	// The command (field 2) is in parentheses and may contain spaces: count after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := bytes.Fields(b[i+1:]) // from field 3 (state): utime is field 14, stime 15
	if len(f) < 13 {
		return 0
	}
	ut, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	st, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0
	}
	return time.Duration(ut+st) * clockTick
}

// checkBrokerPID refuses a -broker43pid that is not a running process's.
func checkBrokerPID(pid int) error {
	if pid == 0 {
		return nil
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/stat", pid)); err != nil {
		return fmt.Errorf("-broker43pid %d: no such process; give the broker's beam.smp (pgrep -f 'beam.smp.*rabbit')", pid)
	}
	return nil
}
