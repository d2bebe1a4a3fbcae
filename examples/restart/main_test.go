package main

import (
	"bytes"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMain lets the test binary play the program's child runs.
func TestMain(m *testing.M) {
	if run := os.Getenv(childEnv); run != "" {
		if err := child(os.Stdout, run, os.Args[1], os.Args[2]); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestRestartChargesEachOrderOnce(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, demo(&out, exe))
	got := out.String()
	t.Log("\n" + got)
	assert.Contains(t, got, "order-1002: 503 after 3 attempts; its key stays pending")
	assert.Contains(t, got, "run 1 was killed before the reply arrived")
	assert.Contains(t, got, "2 operations pending")
	assert.Regexp(t, `order-1001 key \S+: 201, the server replayed the first charge`, got)
	assert.Regexp(t, `order-1002 key \S+: 201, charged now`, got)
	assert.Contains(t, got, "0 operations pending")
	assert.Contains(t, got, "order-1001 charged 1 time(s)")
	assert.Contains(t, got, "order-1002 charged 1 time(s)")
}
