//go:build darwin || dragonfly || freebsd || linux || netbsd || openbsd

package idemhttp

import (
	"errors"
	"os"
	"syscall"
)

// crossProcessLocking reports whether the store lock excludes other
// processes, not only other FileKeyStores in this one.
const crossProcessLocking = true

// lockStore takes an exclusive flock on the store file. The lock belongs to
// the open file, so closing the file or the process dying releases it, and
// a second open of the same file in this process conflicts like another
// process would.
func lockStore(f *os.File, path string) (unlock func(), err error) {
	if err := flock(f); err != nil {
		return nil, err
	}
	return func() {}, nil
}

// lockTemp locks a compaction file before it is renamed over the store, so
// the store is never visible unlocked.
func lockTemp(f *os.File) error { return flock(f) }

func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, syscall.EINTR):
			continue
		case errors.Is(err, syscall.EWOULDBLOCK):
			return ErrStoreLocked
		default:
			return err
		}
	}
}
