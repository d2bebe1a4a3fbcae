package idemhttp

import (
	"fmt"
	"slices"
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
// A call that returns a redirect [http.Client] may follow hands its
// flight on to the request that follows it (see follow). That request
// comes only after RoundTrip has returned, so the operation is not in
// flight meanwhile, and another call of it may run whole in the gap and
// leave the key pending for its caller. Each flight has a number, and the
// mark of a handed flight stays until another call starts: the request
// that follows learns whether one did, and if so must not release the key.
//
// The marks live in process memory: nothing is in flight after a restart.
// The zero value is ready to use.
type flights struct {
	mu   sync.Mutex
	ops  map[string]flight
	last uint64 // the number of the latest flight started
	// held lists, by operation, the final outcomes of calls made with
	// HoldKey whose keys await Settle and that no call of the operation
	// started since. A call that starts supersedes them (see heldKey).
	held map[string][]*heldKey
}

// flight is the mark of an operation's flight.
type flight struct {
	n    uint64 // the flight's number
	held bool   // false once handed to the request that follows a redirect
}

// flightsHolder is implemented by the KeyStores of this package, which
// keep the marks of their operations, so that every Transport over one
// store sees them. A Transport over a KeyStore of another kind keeps
// marks of its own.
type flightsHolder interface {
	operationFlights() *flights
}

// start marks operation as in flight, and returns the flight's number.
// It fails, wrapping [ErrOperationInFlight], if it already is.
func (f *flights) start(operation string) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.startLocked(operation)
}

// settle marks operation as in flight for a Settle of h, as start does,
// and reports whether a call of operation started since h's call, which
// then supersedes it: that call sent the key again, and its caller, whose
// outcome may not be final, may need it still.
func (f *flights) settle(operation string, h *heldKey) (superseded bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.take(operation); err != nil {
		return false, err
	}
	held := f.held[operation]
	i := slices.Index(held, h)
	if i < 0 {
		return true, nil
	}
	if held = slices.Delete(held, i, i+1); len(held) == 0 {
		delete(f.held, operation)
	} else {
		f.held[operation] = held
	}
	return false, nil
}

// hold notes h, the final outcome of a call of operation made with
// HoldKey, whose flight the caller holds, until a Settle of it or the
// operation's next call.
func (f *flights) hold(operation string, h *heldKey) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.held == nil {
		f.held = make(map[string][]*heldKey)
	}
	f.held[operation] = append(f.held[operation], h)
}

// follow starts operation's flight for the request that follows a
// redirect, which flight number n handed on. It fails as start does, and
// reports whether another flight of operation started after n was handed
// on: another call sent the key since, and its caller may still need it.
// superseded lists the outcomes of such calls that awaited Settle: the
// request that follows supersedes them while its own outcome may not be
// final, and gives them back once it is (see restore).
func (f *flights) follow(operation string, n uint64) (m uint64, superseded []*heldKey, another bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	prev, ok := f.ops[operation]
	another = !ok || prev.n != n
	held := f.held[operation]
	if m, err = f.startLocked(operation); err == nil && another {
		superseded = held
	}
	return m, superseded, another, err
}

// restore notes again, until a Settle of them or the operation's next
// call, the outcomes that the request following a redirect superseded
// (see follow), once that request's own outcome, which releases nothing,
// has reached its caller, who needs the key no more. Its caller holds
// the operation's flight, so no call of it started since. Without this,
// each caller would leave the key to the other, and no one would release
// it.
func (f *flights) restore(operation string, held []*heldKey) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.held == nil {
		f.held = make(map[string][]*heldKey)
	}
	f.held[operation] = append(f.held[operation], held...)
}

// startLocked starts a call's flight of operation, which supersedes the
// outcomes awaiting Settle (see settle).
func (f *flights) startLocked(operation string) (uint64, error) {
	n, err := f.take(operation)
	if err == nil {
		delete(f.held, operation)
	}
	return n, err
}

// take marks operation as in flight, unless it already is.
func (f *flights) take(operation string) (uint64, error) {
	if f.ops[operation].held {
		// Says what holds it: most often a response body not yet read
		// or closed, which nothing else would point to.
		return 0, fmt.Errorf("%w: %q: another call is sending it, or holds its final response with the body not yet read or closed",
			ErrOperationInFlight, operation)
	}
	if f.ops == nil {
		f.ops = make(map[string]flight)
	}
	f.last++
	f.ops[operation] = flight{n: f.last, held: true}
	return f.last, nil
}

// end marks operation as no longer in flight. The call that started the
// flight ends it, once.
func (f *flights) end(operation string) {
	f.mu.Lock()
	delete(f.ops, operation)
	f.mu.Unlock()
}

// hand ends operation's flight, whose holder returned a redirect that
// http.Client may follow, and keeps its mark for the request that follows
// (see follow). A mark whose redirect is never followed stays until the
// operation's next call ends or, in a KeyStore of this package, until its
// key is released (see dropHanded).
func (f *flights) hand(operation string) {
	f.mu.Lock()
	if fl, ok := f.ops[operation]; ok {
		fl.held = false
		f.ops[operation] = fl
	}
	f.mu.Unlock()
}

// dropHanded drops operation's mark if it was handed on to a redirect's
// follow-up and no call holds it. A KeyStore of this package calls it
// when it releases operation's pending key: a caller that acts on a
// redirect itself releases the key so, and the request that would have
// followed never comes. Were it to come, it would find no mark and
// release nothing.
func (f *flights) dropHanded(operation string) {
	f.mu.Lock()
	if fl, ok := f.ops[operation]; ok && !fl.held {
		delete(f.ops, operation)
	}
	f.mu.Unlock()
}

// inFlight reports whether operation is in flight.
func (f *flights) inFlight(operation string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ops[operation].held
}

// flightsOf returns the marks of store's operations: the store's own if
// it keeps them, else a set for one Transport alone.
func flightsOf(store KeyStore) *flights {
	if h, ok := store.(flightsHolder); ok {
		return h.operationFlights()
	}
	return new(flights)
}
