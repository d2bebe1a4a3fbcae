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
func WithOperation(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, operationKey{}, id)
}

// OperationFrom returns the operation id that [WithOperation] stored in ctx.
func OperationFrom(ctx context.Context) (id string, ok bool) {
	id, ok = ctx.Value(operationKey{}).(string)
	return id, ok
}
