// Package idemserver is the server half of idemhttp: net/http middleware
// that deduplicates requests by their Idempotency-Key header, so that a
// client may retry an unsafe request (a charge, an order) without the server
// acting twice.
//
// # The model
//
// A client names each logical operation with one idempotency key and sends
// it on every attempt. The server remembers keys. The first request with a
// key claims it in a [Store], with a lease, and runs the handler; its
// outcome is stored and every later request with the key gets that outcome
// replayed, marked Idempotent-Replayed: true, without the handler running
// again. A request that arrives while the first is still running is told to
// retry later (409 with Retry-After), or waits for the outcome. A key used
// again for a different request (another method, path, query or body) is
// refused with 422, since replaying someone else's answer would be wrong.
//
// Only outcomes that are final are kept. A status of 500 or more, or a
// panic, releases the claim, so the retry that the client will make runs the
// handler again; so do 408, 425 and 429, which ask the client to send the
// request again. A handler that dies without either (the process crashed)
// leaves its claim in progress until the lease expires; then the next
// request with the key takes it over. When the store itself cannot be
// reached the middleware fails closed: 503 with Retry-After, and the handler
// does not run, because running it without a claim could run it twice.
//
// Keys live in a scope: with [WithScope], the same key from two tenants is
// two keys, and one tenant can neither replay nor block another's request.
//
// # Use
//
//	store := idemserver.NewMemoryStore()
//	defer store.Close()
//	dedup := idemserver.Middleware(store,
//		idemserver.RequireKey(),
//		idemserver.WithScope(func(r *http.Request) string { return tenantOf(r) }),
//	)
//	http.Handle("POST /payments", dedup(http.HandlerFunc(createPayment)))
//
// [MemoryStore] serves a single process. Several instances behind a load
// balancer must share a store, such as a SQL database; [Store] describes
// what one must do and how it maps onto one round trip per call.
//
// Responses the middleware writes itself are problem+json documents (RFC
// 9457) with a stable type per case, such as [ProblemInProgress] and
// [ProblemFingerprintMismatch].
package idemserver
