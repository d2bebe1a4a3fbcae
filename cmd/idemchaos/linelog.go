package main

import (
	"bytes"
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

func openLineLog(path string) (*lineLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	return &lineLog{f: f}, nil
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
