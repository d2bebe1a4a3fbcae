package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemhttp/idemhttp/idemserver"
)

// errStoreUnavailable: the -store named is known but not built into this
// binary.
var errStoreUnavailable = errors.New("not available in this build")

// storeNames lists the values of -store, for messages.
const storeNames = "memory, postgres, postgres-tx or redis"

// openStore returns the server's store for the value of -store, and a
// function that closes it. It is the one place a store is chosen; a new
// store is a case here (and in persistent, if it keeps keys across server
// restarts).
func openStore(ctx context.Context, name string) (idemserver.Store, func() error, error) {
	switch name {
	case "memory":
		s := idemserver.NewMemoryStore()
		return s, s.Close, nil
	case "postgres", "postgres-tx", "redis":
		return nil, nil, fmt.Errorf("-store %s: %w", name, errStoreUnavailable)
	}
	return nil, nil, fmt.Errorf("unknown -store %q: want %s", name, storeNames)
}

// persistent reports whether the store named keeps its keys when the server
// process dies, so that the server may be killed and restarted.
func persistent(name string) bool {
	switch name {
	case "postgres", "postgres-tx", "redis":
		return true
	}
	return false
}
