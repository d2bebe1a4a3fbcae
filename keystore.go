package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"
)

// MaxOperationIDLen is the longest operation id a KeyStore must accept.
// Longer ids are refused with [ErrInvalidOperation].
const MaxOperationIDLen = 1024

// A KeyStore remembers the pending idempotency key of each logical operation,
// so that every attempt of an operation, including attempts made after the
// process restarts, sends the same key.
//
// A key is pending from the Acquire that records it until the Release that
// forgets it. The Transport releases a key only when the operation's outcome
// is final and the caller has read it (see [Transport]); a key whose
// retries ran out, or whose response body was lost in transit, stays
// pending for the next call. The Transport calls Release from the caller's
// Read or Close of the response body, so a store that makes releases
// durable delays that call by its write. For an operation made with
// [HoldKey], the Transport never calls Release: [Settle] does, once the
// caller has kept the outcome, and only for an outcome the Transport would
// have released the key for.
//
// The Transport lets one call of an operation at a time send its key (see
// [WithOperation]). The KeyStores of this package hold the marks of the
// calls in flight, so the Transports that share one of them share the
// marks; a Transport over a KeyStore of another kind keeps marks of its
// own.
//
// Implementations must be safe for concurrent use by multiple goroutines.
type KeyStore interface {
	// Acquire returns the pending key of operation. If operation has no
	// pending key, Acquire records candidate as its key and returns it; a
	// durable store must have made the record durable before it returns nil.
	// Concurrent Acquires of one operation return the same key.
	Acquire(ctx context.Context, operation, candidate string) (key string, err error)

	// Release forgets the pending key of operation, but only if it is still
	// key: a key acquired after the one being released is left alone.
	// Releasing an operation that is not pending is not an error.
	Release(ctx context.Context, operation, key string) error

	// Pending lists the operations whose keys are recorded and not yet
	// released, oldest first, so a restarted program can finish them.
	Pending(ctx context.Context) ([]PendingOperation, error)
}

// PendingOperation is an operation whose key has been recorded and not yet
// released.
type PendingOperation struct {
	// Operation is the id given to [WithOperation].
	Operation string
	// Key is the idempotency key every attempt of the operation sends.
	Key string
	// Created is when the key was first recorded.
	Created time.Time
	// Stale reports that the key is older than the store's configured
	// maximum age, so the server may already have forgotten it.
	Stale bool
}

// ErrInvalidOperation is returned for an operation id that is empty or
// longer than [MaxOperationIDLen].
var ErrInvalidOperation = errors.New("idemhttp: invalid operation id")

// ValidateOperation reports whether id can name an operation in a KeyStore.
// The error wraps [ErrInvalidOperation].
func ValidateOperation(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: empty", ErrInvalidOperation)
	case len(id) > MaxOperationIDLen:
		return fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidOperation, len(id), MaxOperationIDLen)
	}
	return nil
}

// MemoryKeyStore is a KeyStore held in memory. Keys survive retries within
// the process but not a restart; use a file store where they must. The zero
// value is ready to use.
type MemoryKeyStore struct {
	// StaleAfter, if positive, makes Pending mark operations whose key is
	// older than StaleAfter as Stale. Set it before the store is used.
	StaleAfter time.Duration

	mu      sync.Mutex
	pending map[string]PendingOperation
	now     func() time.Time // nil means time.Now
	flights flights          // the operations calls are sending
}

// NewMemoryKeyStore returns an empty MemoryKeyStore.
func NewMemoryKeyStore() *MemoryKeyStore {
	return &MemoryKeyStore{}
}

func (s *MemoryKeyStore) operationFlights() *flights { return &s.flights }

// Acquire implements [KeyStore].
func (s *MemoryKeyStore) Acquire(ctx context.Context, operation, candidate string) (string, error) {
	if err := ValidateOperation(operation); err != nil {
		return "", err
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pending[operation]; ok {
		return p.Key, nil
	}
	if s.pending == nil {
		s.pending = make(map[string]PendingOperation)
	}
	now := time.Now
	if s.now != nil {
		now = s.now
	}
	s.pending[operation] = PendingOperation{Operation: operation, Key: candidate, Created: now()}
	return candidate, nil
}

// Release implements [KeyStore].
func (s *MemoryKeyStore) Release(ctx context.Context, operation, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pending[operation]; ok && p.Key == key {
		delete(s.pending, operation)
		s.flights.dropHanded(operation)
	}
	return nil
}

// Pending implements [KeyStore]. Operations older than StaleAfter are marked
// Stale.
func (s *MemoryKeyStore) Pending(ctx context.Context) ([]PendingOperation, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	out := make([]PendingOperation, 0, len(s.pending))
	for _, p := range s.pending {
		out = append(out, p)
	}
	s.mu.Unlock()
	now := time.Now
	if s.now != nil {
		now = s.now
	}
	markStale(out, s.StaleAfter, now())
	sortPending(out)
	return out, nil
}

// sortPending orders operations oldest first, breaking ties by operation id,
// the order [KeyStore.Pending] promises.
func sortPending(ops []PendingOperation) {
	sort.Slice(ops, func(i, j int) bool {
		if !ops[i].Created.Equal(ops[j].Created) {
			return ops[i].Created.Before(ops[j].Created)
		}
		return ops[i].Operation < ops[j].Operation
	})
}
