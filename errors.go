package idemhttp

import (
	"errors"
	"fmt"
)

// Sentinel errors. The Transport's errors wrap them; test with [errors.Is].
var (
	// ErrAttemptsExhausted: every allowed attempt failed.
	ErrAttemptsExhausted = errors.New("idemhttp: attempts exhausted")
	// ErrWaitPastDeadline: the wait before the next attempt would outlast
	// the context's deadline, so the Transport gave up without waiting.
	ErrWaitPastDeadline = errors.New("idemhttp: retry wait would pass the context deadline")
	// ErrBodyNotReplayable: the request failed and its body cannot be sent
	// again.
	ErrBodyNotReplayable = errors.New("idemhttp: request body cannot be replayed")
	// ErrBudgetExhausted: the retry budget refused a retry.
	ErrBudgetExhausted = errors.New("idemhttp: retry budget exhausted")
	// ErrCircuitOpen: the host's circuit breaker is open; nothing was sent.
	ErrCircuitOpen = errors.New("idemhttp: circuit breaker is open")
	// ErrKeyStore: no idempotency key could be made or recorded for the
	// request; nothing was sent.
	ErrKeyStore = errors.New("idemhttp: no idempotency key")
	// ErrOperationInFlight: another call of the same operation
	// ([WithOperation]) is in flight through a Transport over the same
	// [KeyStore]; nothing was sent, and the operation's key stays pending.
	// The error names the operation.
	ErrOperationInFlight = errors.New("idemhttp: operation already in flight")
	// ErrNotFinal: [Settle] was given a response whose outcome the
	// Transport would not have released the key for, not yet or not at
	// all; nothing was released, and the operation's key stays pending.
	ErrNotFinal = errors.New("idemhttp: outcome not final, key kept")
	// ErrNotHeld: [Settle] was given a response that holds no key for it,
	// one not returned by a [Transport] for an operation made with
	// [HoldKey]; nothing was released.
	ErrNotHeld = errors.New("idemhttp: response holds no operation key")
)

// RetryError is the error a Transport returns when a request ends without a
// response. It records how many attempts were made and why the Transport
// stopped. It unwraps to the last attempt's error (so errors.Is finds, say,
// context.Canceled or a *net.OpError) and to the sentinel of its Reason, if
// any (so errors.Is finds ErrAttemptsExhausted, ErrCircuitOpen, ...).
type RetryError struct {
	// Attempts is how many attempts were sent; 0 if none was.
	Attempts int
	// Reason says why the Transport stopped.
	Reason Reason
	// Err is the last attempt's error, or the refusal that stopped the
	// request before an attempt.
	Err error
}

// Error implements the error interface.
func (e *RetryError) Error() string {
	noun := "attempts"
	if e.Attempts == 1 {
		noun = "attempt"
	}
	if e.Err == nil {
		return fmt.Sprintf("idemhttp: %d %s, %s", e.Attempts, noun, e.Reason)
	}
	return fmt.Sprintf("idemhttp: %d %s, %s: %v", e.Attempts, noun, e.Reason, e.Err)
}

// Unwrap returns the last error and the sentinel of the Reason.
func (e *RetryError) Unwrap() []error {
	errs := make([]error, 0, 2)
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	if s := e.Reason.sentinel(); s != nil && !errors.Is(e.Err, s) {
		errs = append(errs, s)
	}
	return errs
}
