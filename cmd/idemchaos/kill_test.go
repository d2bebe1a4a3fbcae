package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestKillOfExitedProcess checks that a kill is counted only if it ended
// the process: one that had exited by itself before the signal came, but
// had not yet been waited for (so that its exit was not yet seen), was not
// killed, and its own exit status must stand.
func TestKillOfExitedProcess(t *testing.T) {
	cmd := exec.Command("true")
	require.NoError(t, cmd.Start())
	// Wait until it is a zombie: exited, not yet reaped.
	stat := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/stat"
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(stat)
		if err != nil {
			return false
		}
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		return len(f) > 0 && f[0] == "Z"
	}, 5*time.Second, time.Millisecond)

	c := &child{cmd: cmd, exited: make(chan struct{})}
	killed := make(chan bool)
	go func() { killed <- c.kill() }()
	time.Sleep(20 * time.Millisecond) // let kill signal the zombie first
	c.err = cmd.Wait()
	close(c.exited)
	assert.False(t, <-killed, "the process had exited by itself")
	assert.NoError(t, c.err)
}

// TestKillOfRunningProcess checks that a kill of a running process counts.
func TestKillOfRunningProcess(t *testing.T) {
	sc := &scenario{self: "sleep", stderr: os.Stderr}
	c, err := sc.start(roleClient, []string{"10"}, nil, nil)
	require.NoError(t, err)
	assert.True(t, c.kill())
	assert.False(t, c.kill(), "already gone")
}
