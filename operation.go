package idemhttp

import "context"

type operationKey struct{}

// WithOperation returns a copy of ctx that names the logical operation id.
// A keyed request made with the returned context takes its idempotency key
// from the Transport's [KeyStore]: the pending key of id if there is one,
// else a new key recorded before the first attempt is sent. Use one id per
// business operation (an order number, a payment intent) and reuse it when
// the operation is retried later or after a restart. A request whose key
// header the caller set is sent with that key, and the KeyStore neither
// records it nor lists the operation as pending: keeping it is the caller's.
//
// The key is released when the operation's final response has been
// received: its body read to the end, or closed with no read of it failed
// or in progress (see [Transport]). Until then, including when the response body
// is lost in transit, a call with the same id sends the same key again.
// With [HoldKey] among opts, the Transport never releases the key itself:
// the caller releases it with [Settle] once it has kept what the response
// told it, so that a crash between reading the outcome and keeping it
// leaves the key pending (see HoldKey). The flight of such a call ends
// all the same, as described below.
//
// One call of an operation is in flight at a time, among all the
// Transports over one KeyStore in a process. A call is in flight from the
// moment it takes the operation's key until its outcome is settled: until
// RoundTrip returns an error or a response that leaves the key pending,
// or, for a response whose outcome may release the key, until its body's
// read reaches the end or fails, or the body is closed (at once for a
// response without a body). A call made meanwhile with the same id sends
// nothing and fails at once with an error that wraps
// [ErrOperationInFlight]; the key stays pending, and the operation's
// outcome is the call in flight's to learn. Were the second call to send
// the key, the first final outcome to reach either caller would release
// it, and the other caller, left with a body cut in transit or with
// retries run out, would call again under a new key, and the server would
// act a second time. The request that [http.Client] sends to follow a
// redirect of the operation is part of the call and takes the flight
// again. Another call of the operation may run in between, after the
// redirect was returned and before it is followed: the request that
// follows is then refused if that call is still in flight, and otherwise
// sent, but its outcome leaves the key pending, for the other call's
// caller may still need it, and the next call gets the server's replay
// (with HoldKey, [Settle] of that outcome returns nil and releases nothing).
// If the other call was made with HoldKey and its caller has not yet
// settled, that request's body keeps the operation in flight too, and
// once it has been delivered the other caller's Settle releases the key. A
// body whose outcome may release the key keeps the operation in flight
// until it is read to its end, fails or is closed, even once the call's
// context has ended (a response abandoned when a timeout fires holds it
// too), so close every response body, as net/http already requires. A refusal is reported to
// the attempt hook and the logger as a first attempt not sent, with
// [ReasonOperationInFlight]. The marks live in memory: after a restart
// nothing is in flight, and a call resumes the pending key. A KeyStore of
// another package is shared safely only through one Transport; Transports
// of their own over it each see only their own calls in flight. The
// KeyStores of this package keep the marks themselves, for every
// Transport over them.
//
// Once an operation's key has been released, a call with its id starts
// the operation anew under a new key. So two parts of a program that run
// one operation must not both call it to completion: the guard keeps
// overlapping calls apart, not calls made one after the other.
func WithOperation(ctx context.Context, id string, opts ...OperationOption) context.Context {
	var o operationConfig
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if o.hold {
		return context.WithValue(ctx, operationKey{}, heldOperation(id))
	}
	return context.WithValue(ctx, operationKey{}, id)
}

// An OperationOption configures an operation named by [WithOperation].
type OperationOption func(*operationConfig)

type operationConfig struct {
	hold bool
}

// heldOperation is the id of an operation made with [HoldKey], as the
// context holds it. A plain id is held as a string, so an operation
// without options costs what it always has.
type heldOperation string

// HoldKey makes the caller, not the Transport, release the operation's key.
//
// By default the key is released when the final response's body has been
// read to its end or closed, before the caller has done anything with what
// it read. A program that dies between reading "paid" and recording the
// payment in its own database restarts with nothing pending, calls again
// under a new key, and the server acts a second time. With HoldKey the
// Transport decides the outcome as it otherwise would, and ends the call's
// flight at the same moment (so the next call of the operation is not
// refused), but leaves the key pending: a call with the same id, in this
// process or after a restart, sends the same key and gets the server's
// replay. Once the program has kept the outcome, it calls [Settle] with
// the response, which releases the key if, and only if, the Transport
// would have released it, and no call of the operation has started since
// (that call's caller may need the key still; see Settle).
//
// HoldKey is an option of the operation, not of the Transport, because the
// code that settles is the code that makes the call: a Transport that held
// every operation's key would leave pending for good the keys of callers
// that never learnt to call Settle, and each of their later calls would
// get a replay of the first outcome instead of a new operation.
//
// A key that is never settled stays pending with no time limit, as any
// pending key does (see [KeyStore.Pending]).
func HoldKey() OperationOption {
	return func(o *operationConfig) { o.hold = true }
}

// OperationFrom returns the operation id that [WithOperation] stored in ctx.
func OperationFrom(ctx context.Context) (id string, ok bool) {
	id, _, ok = operationOf(ctx)
	return id, ok
}

// operationOf returns the operation that [WithOperation] stored in ctx,
// and whether it was made with [HoldKey].
func operationOf(ctx context.Context) (id string, hold, ok bool) {
	switch v := ctx.Value(operationKey{}).(type) {
	case string:
		return v, false, true
	case heldOperation:
		return string(v), true, true
	}
	return "", false, false
}
