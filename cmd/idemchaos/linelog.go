package main

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"sync"
)

// lineLog is an append-only file of text lines, written by one process at a
// time and read by the parent once that process is gone. Each line goes to
// the file in one write, so a process killed with SIGKILL leaves whole lines
// behind (the kernel keeps what was written); durable lines are also
// fsynced, so they survive the machine too.
type lineLog struct {
	mu sync.Mutex
	f  *os.File
}

// openLineLog opens the log at path for appending, creating it if need be.
// A last line without its newline was torn (a write cut short, or a crash
// between the write and the fsync on power loss): readers count it absent,
// and it is cut off here, so that the lines appended next do not glue onto
// it and make a line that no writer wrote.
func openLineLog(path string) (*lineLog, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := cutTornLine(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: cutting its torn last line: %w", path, err)
	}
	return &lineLog{f: f}, nil
}

// cutTornLine truncates f after its last newline, if anything follows it,
// and makes the truncation durable before anything is appended.
func cutTornLine(f *os.File) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	// Read backwards, a block at a time, until a newline or the start.
	var buf [4096]byte
	end := size
	for end > 0 {
		n := min(end, int64(len(buf)))
		if _, err := f.ReadAt(buf[:n], end-n); err != nil {
			return err
		}
		if i := bytes.LastIndexByte(buf[:n], '\n'); i >= 0 {
			end = end - n + int64(i) + 1
			break
		}
		end -= n
	}
	if end == size {
		return nil
	}
	if err := f.Truncate(end); err != nil {
		return err
	}
	return f.Sync()
}

// append writes the fields as one line, and fsyncs it if durable.
func (l *lineLog) append(durable bool, fields ...string) error {
	line := strings.Join(fields, " ") + "\n"
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.f.WriteString(line); err != nil {
		return err
	}
	if durable {
		return l.f.Sync()
	}
	return nil
}

func (l *lineLog) Close() error { return l.f.Close() }

// readLines returns the complete lines of the file at path, split into
// fields; a final line without its newline was cut by a crash and is left
// out. A missing file has no lines.
func readLines(path string) ([][]string, error) {
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if i := bytes.LastIndexByte(data, '\n'); i >= 0 {
		data = data[:i+1]
	} else {
		data = nil
	}
	var lines [][]string
	for line := range strings.Lines(string(data)) {
		if fields := strings.Fields(line); len(fields) > 0 {
			lines = append(lines, fields)
		}
	}
	return lines, nil
}
