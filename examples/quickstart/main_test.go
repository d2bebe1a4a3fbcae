package main

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestQuickstartReportsEveryOperation(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(&out, 12, 4, 7))

	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.GreaterOrEqual(t, len(lines), 14)
	assert.Contains(t, lines[0], "OPERATION")
	keys := map[string]bool{}
	for _, line := range lines[1:13] {
		fields := strings.Fields(line)
		require.GreaterOrEqual(t, len(fields), 4, line)
		assert.Regexp(t, `^payment-\d\d$`, fields[0])
		assert.Len(t, fields[1], 36, "a UUID key")
		keys[fields[1]] = true
	}
	assert.Len(t, keys, 12, "one key per operation")

	summary := regexp.MustCompile(`operations: (\d+)  attempts: (\d+)  retries: (\d+)`).FindStringSubmatch(out.String())
	require.NotNil(t, summary, out.String())
	ops, _ := strconv.Atoi(summary[1])
	attempts, _ := strconv.Atoi(summary[2])
	retries, _ := strconv.Atoi(summary[3])
	assert.Equal(t, 12, ops)
	assert.Equal(t, attempts-ops, retries)

	// The server's own ledger shows no operation charged twice: at most one
	// charge per operation, and one for every payment that succeeded (a
	// payment whose retries ran out may have been charged all the same).
	ledger := regexp.MustCompile(`succeeded: (\d+)  time: \S+  charges: (\d+)  duplicates: 0$`).FindStringSubmatch(lines[len(lines)-1])
	require.NotNil(t, ledger, "the table ends with duplicates: 0: %s", out.String())
	succeeded, _ := strconv.Atoi(ledger[1])
	charges, _ := strconv.Atoi(ledger[2])
	assert.GreaterOrEqual(t, charges, succeeded)
	assert.LessOrEqual(t, charges, ops)
}
