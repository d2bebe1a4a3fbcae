package idemtest

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// ErrInvalidFaults is matched, with errors.Is, by the error [NewProxy]
// returns, and by the panic of [NewServer], for a [Faults] that is out of
// range.
var ErrInvalidFaults = errors.New("idemtest: invalid faults")

// Faults says how often the fault injector of a [Server] or [Proxy] harms
// a request, and how.
//
// Each request first meets a delay, with probability Latency, and then at
// most one of the faults ResetBefore, LoseResponse, Unavailable,
// TooManyRequests, Stall and CutBody, each with its probability; those six
// probabilities must add up to at most 1, and whatever is left is the
// probability that the request goes through untouched. The zero Faults
// harms nothing.
type Faults struct {
	// ResetBefore is the probability that the connection is reset before
	// the request goes further: the handler does not run and the client
	// sees the connection break before the response's header has ended (a
	// status line, then a TCP reset). The response has begun, so that
	// net/http's Transport does not send the request again by itself, as it
	// does for a keyed request whose reused connection fails before the
	// first byte of a response: every reset reaches the code under test.
	ResetBefore float64
	// LoseResponse is the probability that the request goes through, the
	// handler runs (behind the middleware) and its response is dropped:
	// the connection is reset instead. The client cannot tell this from
	// ResetBefore; only a retry with the same key gets the outcome.
	LoseResponse float64
	// Unavailable is the probability of a 503 answered by the injector,
	// without Retry-After, the handler not running.
	Unavailable float64
	// TooManyRequests is the probability of a 429 with a Retry-After of
	// RetryAfter answered by the injector, the handler not running.
	TooManyRequests float64
	// Stall is the probability that the request is held, unanswered and
	// without the handler running, until the client gives up (its context
	// or attempt timeout ends) or the server closes; then the connection is
	// reset. A client without an attempt timeout waits for as long as its
	// request's context lets it.
	Stall float64
	// CutBody is the probability that the request goes through, the
	// handler runs (behind the middleware) and its response reaches the
	// client cut short: its status and header fields, then the first half
	// of its body, sent chunked, and then a reset instead of the body's
	// end. The client has a response, 2xx perhaps, whose body it cannot
	// read to the end (io.ErrUnexpectedEOF or a connection reset): a
	// client that takes the operation for unfinished must retry it with
	// its key, since the handler acted. A response that cannot have a
	// body (to a HEAD, or a 1xx, 204 or 304) is lost whole instead, as
	// with LoseResponse, and counted as a lost response in [Stats].
	CutBody float64
	// RetryAfter is the wait the 429 asks for, rounded up to whole seconds.
	// Zero sends "Retry-After: 0".
	RetryAfter time.Duration

	// Latency is the probability that a request is delayed, before
	// anything else happens to it, by a duration drawn uniformly from
	// [MinLatency, MaxLatency]; a Latency above zero needs a MaxLatency
	// above zero. A client that gives up during the delay
	// finds its connection reset.
	Latency                float64
	MinLatency, MaxLatency time.Duration
}

// validate reports whether f is usable, with an error wrapping
// ErrInvalidFaults that says what is wrong.
func (f *Faults) validate() error {
	probs := []struct {
		name string
		p    float64
	}{
		{"ResetBefore", f.ResetBefore}, {"LoseResponse", f.LoseResponse},
		{"Unavailable", f.Unavailable}, {"TooManyRequests", f.TooManyRequests},
		{"Stall", f.Stall}, {"CutBody", f.CutBody}, {"Latency", f.Latency},
	}
	for _, p := range probs {
		if math.IsNaN(p.p) || p.p < 0 || p.p > 1 {
			return fmt.Errorf("%w: %s = %v is not a probability in [0, 1]", ErrInvalidFaults, p.name, p.p)
		}
	}
	if sum := f.ResetBefore + f.LoseResponse + f.Unavailable + f.TooManyRequests + f.Stall + f.CutBody; sum > 1+1e-9 {
		return fmt.Errorf("%w: ResetBefore, LoseResponse, Unavailable, TooManyRequests, Stall and CutBody add up to %v, more than 1",
			ErrInvalidFaults, sum)
	}
	switch {
	case f.RetryAfter < 0:
		return fmt.Errorf("%w: RetryAfter = %v is negative", ErrInvalidFaults, f.RetryAfter)
	case f.MinLatency < 0 || f.MaxLatency < f.MinLatency:
		return fmt.Errorf("%w: latency range [%v, %v] is not a range of durations from zero up",
			ErrInvalidFaults, f.MinLatency, f.MaxLatency)
	case f.Latency > 0 && f.MaxLatency == 0:
		// A fault asked for that would never fire: the test would pass
		// without the latency it believes it injects.
		return fmt.Errorf("%w: Latency = %v with MaxLatency = 0 delays nothing; set MaxLatency",
			ErrInvalidFaults, f.Latency)
	}
	return nil
}

// fault is the one fault, if any, that a request meets after its delay.
type fault int

const (
	faultNone fault = iota
	faultResetBefore
	faultLoseResponse
	faultUnavailable
	faultTooManyRequests
	faultStall
	faultCutBody
)

// decision is what the injector does to one request.
type decision struct {
	fault fault
	delay time.Duration
}

// decide returns the decision for the attempt-th request (counting from 1)
// with the given identity. It is a pure function of its arguments, so that
// the same seed gives the same faults however requests are scheduled.
func decide(f *Faults, seed int64, identity string, attempt uint64) decision {
	// FNV-1a over the identity, started from the mixed seed, then mixed
	// with the attempt: every (seed, identity, attempt) gets its own
	// well-spread 64 bits, from which independent uniform draws follow.
	const fnvPrime = 1099511628211
	h := mix(uint64(seed))
	for i := 0; i < len(identity); i++ {
		h = (h ^ uint64(identity[i])) * fnvPrime
	}
	h = mix(h ^ mix(attempt))
	which, delayed, amount := unit(mix(h^1)), unit(mix(h^2)), unit(mix(h^3))

	var d decision
	if delayed < f.Latency {
		span := float64(f.MaxLatency - f.MinLatency)
		d.delay = f.MinLatency + time.Duration(amount*span)
	}
	for _, c := range []struct {
		p     float64
		fault fault
	}{
		{f.ResetBefore, faultResetBefore}, {f.LoseResponse, faultLoseResponse},
		{f.Unavailable, faultUnavailable}, {f.TooManyRequests, faultTooManyRequests},
		{f.Stall, faultStall}, {f.CutBody, faultCutBody},
	} {
		if which < c.p {
			d.fault = c.fault
			break
		}
		which -= c.p
	}
	return d
}

// mix is the finalizer of SplitMix64: a bijection of 64-bit values whose
// outputs look independent for neighbouring inputs.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// unit maps 64 random bits to a float64 uniform in [0, 1).
func unit(x uint64) float64 { return float64(x>>11) / (1 << 53) }
