package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain lets the test binary play the scenario's children: runScenario
// starts its own executable, the test binary, with roleEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) != "" {
		main()
		return
	}
	goleak.VerifyTestMain(m)
}

// chaos runs a scenario with args and returns its exit status and report.
func chaos(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	status := runScenario(context.Background(), args, &stdout, &stderr)
	t.Logf("idemchaos %q: exit %d\n%s%s", args, status, &stdout, &stderr)
	return status, stdout.String() + stderr.String()
}

// count returns the number on the report's line "name: N".
func count(t *testing.T, report, name string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + `: (\d+)$`).FindStringSubmatch(report)
	require.NotNil(t, m, "no line %q in the report", name+": N")
	n, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	return n
}

// TestShortScenario runs a short scenario through faults and client kills:
// every operation executes exactly once.
func TestShortScenario(t *testing.T) {
	dir := t.TempDir()
	status, report := chaos(t, "-ops", "80", "-workers", "4", "-client-kills", "2", "-faults", "0.3",
		"-seed", "7", "-dir", dir)
	assert.Equal(t, 0, status)
	assert.Equal(t, 0, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Equal(t, 80, count(t, report, "operations"))
	assert.Equal(t, 2, count(t, report, "client kills"))
	assert.Equal(t, 0, count(t, report, "server restarts"))
	assert.Equal(t, 7, count(t, report, "seed"))
	assert.GreaterOrEqual(t, count(t, report, "attempts"), 80)
	assert.Contains(t, report, "PASS: every operation executed exactly once")

	// The ledger, kept by the server children, holds each operation once.
	ledger, err := readLines(filepath.Join(dir, "ledger"))
	require.NoError(t, err)
	assert.Len(t, ledger, 80)
}

// TestBrokenServerCaught runs the scenario against a server without the
// middleware: its retries execute again, and idemchaos must say so.
func TestBrokenServerCaught(t *testing.T) {
	status, report := chaos(t, "-"+unsafeFlag, "-ops", "50", "-workers", "4", "-client-kills", "0",
		"-faults", "0.5", "-seed", "3")
	assert.Equal(t, exitFailed, status)
	assert.Positive(t, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Regexp(t, `(?m)^duplicated operations: op-\d\d \(\d executions\)`, report)
	assert.Contains(t, report, "FAIL")
}

func TestBadFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"-server-restarts", "1"}, "-server-restarts 1 needs a persistent store: the memory store"},
		{[]string{"-store", "postgres"}, "-store postgres: not available in this build"},
		{[]string{"-store", "postgres-tx"}, "-store postgres-tx: not available in this build"},
		{[]string{"-store", "redis"}, "-store redis: not available in this build"},
		{[]string{"-store", "sqlite"}, `unknown -store "sqlite": want memory, postgres, postgres-tx or redis`},
		{[]string{"-ops", "0"}, "-ops 0: need at least one operation"},
		{[]string{"-workers", "0"}, "-workers 0: need at least one"},
		{[]string{"-client-kills", "-1"}, "cannot be negative"},
		{[]string{"-faults", "1.5"}, "-faults 1.5: want a share in [0, 1]"},
		{[]string{"-timeout", "0s"}, "-timeout 0s: want a positive duration"},
		{[]string{"extra"}, `unexpected arguments: ["extra"]`},
		{[]string{"-nope"}, "flag provided but not defined: -nope"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.args), func(t *testing.T) {
			status, out := chaos(t, tt.args...)
			assert.Equal(t, exitError, status)
			assert.Contains(t, out, tt.want)
			assert.NotContains(t, out, "duplicates:", "nothing ran")
		})
	}
}

func TestUsageHidesUnsafeFlag(t *testing.T) {
	status, out := chaos(t, "-h")
	assert.Equal(t, 0, status)
	assert.Contains(t, out, "-client-kills")
	assert.NotContains(t, out, unsafeFlag)
}

// TestReportReadsLedger checks the verdict on ledgers and client logs
// written by hand, a line torn by a crash included.
func TestReportReadsLedger(t *testing.T) {
	dir := t.TempDir()
	f := files{ledger: filepath.Join(dir, "ledger"), clientLog: filepath.Join(dir, "log")}
	require.NoError(t, os.WriteFile(f.ledger, []byte(
		"executed op-1 k1\nexecuted op-2 k2\nexecuted op-2 k3\nexecuted op-9 k9\nexecuted op-3 k4"), 0o644))
	require.NoError(t, os.WriteFile(f.clientLog, []byte(
		"done op-1 201 false\ndone op-2 201 true\ndone op-3 201 false\ndone op-4 409 false\ndone op-5 201"), 0o644))
	r := &report{scenario: &scenario{ops: 5}}
	require.NoError(t, r.read(f))
	assert.Equal(t, map[string]int{"op-1": 1, "op-2": 2, "op-3": 0, "op-4": 0, "op-5": 0}, r.executions)
	assert.Equal(t, []string{"op-2 (2 executions)"}, r.duplicated)
	assert.Equal(t, []string{"op-3", "op-4", "op-5"}, r.lost) // op-3's line was torn
	assert.Equal(t, []string{"op-5"}, r.unfinished)           // so was op-5's
	assert.Equal(t, []string{"op-4 (409)"}, r.refused)
	assert.Equal(t, []string{"op-9"}, r.strangers)
	assert.Equal(t, 1, r.replaysReceived)
	assert.True(t, r.failed())

	var out bytes.Buffer
	r.print(&out)
	assert.Contains(t, out.String(), "\nduplicates: 1\n")
	assert.Contains(t, out.String(), "\nlost: 3\n")
	assert.Contains(t, out.String(), "\nduplicated operations: op-2 (2 executions)\n")
	assert.Contains(t, out.String(), "\nlost operations (never executed): op-3, op-4, op-5\n")
}
