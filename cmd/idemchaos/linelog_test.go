package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLineLogTornLastLine checks a log whose last line a previous writer
// left torn, without its newline (a write cut short, or a crash between
// the write and the fsync on power loss): the reader counts the torn line
// as absent, and the next writer's lines do not glue onto it, which would
// turn the torn "done op-1" of a "done op-12 ..." into a line about
// another operation, or the torn line and a whole one into one line that
// neither wrote.
func TestLineLogTornLastLine(t *testing.T) {
	for _, tt := range []struct {
		name, before string
		want         [][]string
	}{
		{"empty", "", nil},
		{"whole lines", "done op-10 201 false k10\n", [][]string{{"done", "op-10", "201", "false", "k10"}}},
		{"torn line", "done op-10 201 false k10\ndone op-1", [][]string{{"done", "op-10", "201", "false", "k10"}}},
		{"torn first line", "done op-12 2", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "log")
			require.NoError(t, os.WriteFile(path, []byte(tt.before), 0o644))
			lines, err := readLines(path)
			require.NoError(t, err)
			assert.Equal(t, tt.want, lines, "the torn line is absent")

			log, err := openLineLog(path)
			require.NoError(t, err)
			require.NoError(t, log.append(true, "done", "op-2", "201", "true", "k2"))
			require.NoError(t, log.append(false, "cut", "op-3", "k3"))
			require.NoError(t, log.Close())
			lines, err = readLines(path)
			require.NoError(t, err)
			want := append(tt.want, []string{"done", "op-2", "201", "true", "k2"}, []string{"cut", "op-3", "k3"})
			assert.Equal(t, want, lines)

			// The parent's tail sees the same operations done.
			tail := &doneTail{path: path, done: make(map[string]bool)}
			require.NoError(t, tail.read())
			wantDone := map[string]bool{"op-2": true}
			if len(tt.want) > 0 {
				wantDone["op-10"] = true
			}
			assert.Equal(t, wantDone, tail.done)
		})
	}
}

// TestDoneTailAcrossTornLine checks the parent's tail of the client log
// when a worker started after a torn line cuts it off: the tail, which may
// have read the torn bytes already, does not take them for the start of
// the next worker's line.
func TestDoneTailAcrossTornLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	require.NoError(t, os.WriteFile(path, []byte("done op-10 201 false k10\ndone op-1"), 0o644))
	tail := &doneTail{path: path, done: make(map[string]bool)}
	require.NoError(t, tail.read())
	assert.Equal(t, map[string]bool{"op-10": true}, tail.done)

	log, err := openLineLog(path)
	require.NoError(t, err)
	require.NoError(t, log.append(true, "done", "op-2", "201", "true", "k2"))
	require.NoError(t, log.Close())
	require.NoError(t, tail.read())
	assert.Equal(t, map[string]bool{"op-10": true, "op-2": true}, tail.done)
}
