package idemhttp

import (
	"fmt"
	"sync"
)

// flights marks the operations that a call is sending, so that no two
// calls of one operation send its key at the same time (see
// [WithOperation]). A call starts its operation's flight before it takes
// the key from the KeyStore and ends it once its outcome is settled: when
// RoundTrip returns an error, or when the body of the response it returns
// reaches its end, fails or is closed (at once for a response without a
// body). A key is released only while its flight is held, by the call
// that holds it, before the flight ends: so a call that sent the key
// always learns its outcome before anyone may release it.
//
// The marks live in process memory: nothing is in flight after a restart.
// The zero value is ready to use.
type flights struct {
	mu  sync.Mutex
	ops map[string]struct{}
}

// flightsHolder is implemented by the KeyStores of this package, which
// keep the marks of their operations, so that every Transport over one
// store sees them. A Transport over a KeyStore of another kind keeps
// marks of its own.
type flightsHolder interface {
	operationFlights() *flights
}

// start marks operation as in flight. It fails, wrapping
// [ErrOperationInFlight], if it already is.
func (f *flights) start(operation string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.ops[operation]; ok {
		// Says what holds it: most often a response body not yet read
		// or closed, which nothing else would point to.
		return fmt.Errorf("%w: %q: another call is sending it, or holds its final response with the body not yet read or closed",
			ErrOperationInFlight, operation)
	}
	if f.ops == nil {
		f.ops = make(map[string]struct{})
	}
	f.ops[operation] = struct{}{}
	return nil
}

// end marks operation as no longer in flight. The call that started the
// flight ends it, once.
func (f *flights) end(operation string) {
	f.mu.Lock()
	delete(f.ops, operation)
	f.mu.Unlock()
}

// inFlight reports whether operation is in flight.
func (f *flights) inFlight(operation string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.ops[operation]
	return ok
}

// flightsOf returns the marks of store's operations: the store's own if
// it keeps them, else a set for one Transport alone.
func flightsOf(store KeyStore) *flights {
	if h, ok := store.(flightsHolder); ok {
		return h.operationFlights()
	}
	return new(flights)
}
