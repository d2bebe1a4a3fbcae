package idemhttp

import "time"

// Attempt describes one attempt of a request, and what the Transport decided
// after it. The hook set with [WithAttemptHook] receives one per attempt.
type Attempt struct {
	// Method and Host are the request's method and URL host (host[:port]).
	Method, Host string
	// Key is the idempotency key the attempt carried, or "" if it had none.
	Key string
	// Operation is the id given to [WithOperation], or "" if there was none.
	Operation string
	// Number counts the attempts of this request, starting at 1.
	Number int
	// Sent reports whether the attempt was sent. An attempt refused before
	// sending (an open circuit breaker, a rate-limit wait that could not
	// end in time, a body that could not be replayed, another call of its
	// operation in flight) is reported too, with Sent false and Err saying
	// why.
	Sent bool
	// StatusCode is the response status, or 0 if the attempt failed with Err.
	StatusCode int
	// Err is the error the attempt failed with, or nil if it got a response.
	// An attempt the host's circuit breaker refused was not sent; its Err
	// wraps ErrCircuitOpen and its Reason is ReasonCircuitOpen.
	Err error
	// Elapsed is how long the attempt took, up to the response headers.
	Elapsed time.Duration
	// Wait is how long the Transport waits before the next attempt; it is
	// zero when no attempt follows.
	Wait time.Duration
	// Reason says why another attempt follows (ReasonBackoff,
	// ReasonRetryAfter) or why none does (every other Reason).
	Reason Reason
	// BreakerChanges lists the changes of the host's circuit breaker state
	// seen while making this attempt, oldest first, such as the breaker
	// opening after it failed. Each change is reported once, to the attempt
	// of whichever request caused or first saw it.
	BreakerChanges []BreakerChange
}

// Retrying reports whether another attempt follows this one.
func (a Attempt) Retrying() bool {
	return a.Reason == ReasonBackoff || a.Reason == ReasonRetryAfter
}

// Reason names why the Transport retried or stopped after an attempt.
type Reason string

// Reasons reported in [Attempt.Reason] and [RetryError.Reason].
const (
	// ReasonBackoff: the attempt is retried after the backoff delay.
	ReasonBackoff Reason = "backoff"
	// ReasonRetryAfter: the attempt is retried after the wait the server
	// asked for with Retry-After, which exceeded the backoff delay.
	ReasonRetryAfter Reason = "retry-after"

	// ReasonSuccess: a 2xx or 3xx response, returned to the caller. The
	// outcome is final except for a redirect that http.Client would follow,
	// whether or not it does: a 307 or 308 asks for the request to be sent
	// to another URL, with the same key, and a 301, 302 or 303 with a
	// Location is followed by a GET, whose outcome the caller gets instead.
	ReasonSuccess Reason = "success"
	// ReasonNotRetryable: the status or error is not one that is retried,
	// or the request is not safe to send again.
	ReasonNotRetryable Reason = "not retryable"
	// ReasonAttemptsExhausted: the maximum number of attempts was made.
	ReasonAttemptsExhausted Reason = "attempts exhausted"
	// ReasonWaitPastDeadline: the wait before the next attempt would end
	// after the context's deadline, so no attempt could follow in time.
	ReasonWaitPastDeadline Reason = "wait past deadline"
	// ReasonBodyNotReplayable: the request body cannot be sent again (it was
	// larger than the buffer limit, or GetBody failed).
	ReasonBodyNotReplayable Reason = "body not replayable"
	// ReasonCanceled: the caller's context ended.
	ReasonCanceled Reason = "canceled"
	// ReasonBudgetExhausted: the retry budget refused the retry.
	ReasonBudgetExhausted Reason = "budget exhausted"
	// ReasonCircuitOpen: the host's circuit breaker refused the attempt.
	ReasonCircuitOpen Reason = "circuit open"
	// ReasonKeyStore: no key could be made or recorded for the request (the
	// key generator or the KeyStore failed), so nothing was sent.
	ReasonKeyStore Reason = "key store failed"
	// ReasonOperationInFlight: another call of the request's operation is
	// in flight (see [WithOperation]); nothing was sent. The refused first
	// attempt is reported, with no key: none was taken.
	ReasonOperationInFlight Reason = "operation in flight"
)

// sentinel returns the exported error matching r, or nil when r is not a
// reason to give up that has one.
func (r Reason) sentinel() error {
	switch r {
	case ReasonAttemptsExhausted:
		return ErrAttemptsExhausted
	case ReasonWaitPastDeadline:
		return ErrWaitPastDeadline
	case ReasonBodyNotReplayable:
		return ErrBodyNotReplayable
	case ReasonBudgetExhausted:
		return ErrBudgetExhausted
	case ReasonCircuitOpen:
		return ErrCircuitOpen
	case ReasonKeyStore:
		return ErrKeyStore
	case ReasonOperationInFlight:
		return ErrOperationInFlight
	}
	return nil
}
