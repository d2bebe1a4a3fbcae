//go:build !(darwin || dragonfly || freebsd || linux || netbsd || openbsd)

package idemhttp

import (
	"os"
	"path/filepath"
	"sync"
)

const crossProcessLocking = false

// openStores holds the absolute paths of the stores open in this process.
// Without flock the lock covers only this process.
var openStores sync.Map

func lockStore(f *os.File, path string) (unlock func(), err error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	if _, loaded := openStores.LoadOrStore(abs, struct{}{}); loaded {
		return nil, ErrStoreLocked
	}
	return func() { openStores.Delete(abs) }, nil
}

func lockTemp(f *os.File) error { return nil }
