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
// request again, 499, and a 409 with Retry-After, the "in progress" of a
// deduplicating service behind the handler. So does a request whose
// context ended (the client went away) before the handler wrote any
// response: a handler that gave up on its cancelled context did not act,
// and storing an empty 200 would turn a lost charge into a success. When the store itself cannot be reached the
// middleware fails closed: 503 with Retry-After, and the handler does not
// run, because running it without a claim could run it twice. A Complete or
// Release that fails transiently is tried again a few times; if the store
// still cannot keep the outcome, the client gets the response anyway and
// the record stays in progress until its lease lapses (or, if the store
// kept it after all, every retry replays that same response). Every store
// call is bounded ([WithStoreTimeout], 5s by default): one that a store
// whose connection went silent does not answer in time counts as failed,
// rather than holding the request until the connection times out.
//
// # Leases
//
// A claim holds its key under a lease ([WithLease], a minute by default),
// which the middleware renews while the handler runs, so a live handler is
// never taken over however long it runs. A handler that stops without
// ending its claim, because its process died, leaves the record in progress;
// once its lease has lapsed the next request with the key takes it over and
// runs the handler again. If a running handler's lease is lost all the same
// (the store cannot be reached for a whole lease, or reports the lease
// lost), its context is cancelled with a cause wrapping [ErrLeaseLost], and
// its response, if another request took the key over, is replaced by 503
// (unless the handler streamed it already) so that its client retries and
// gets the outcome that was stored.
//
// No handler holds its key forever: after [WithMaxHold] (ten minutes by
// default) its context is cancelled with a cause wrapping
// [ErrMaxHoldExceeded] and its lease is no longer renewed, so the key can be
// taken over at most one lease later, whether or not the handler returned.
// A handler that may legitimately run longer needs a larger bound; one that
// ignores its context past the bound may run at the same time as the
// request that took its key over.
//
// # Calling other services
//
// A handler that asks another service to act, such as a payment provider,
// should name that request with a key derived from its own: [KeyFrom]
// returns the claimed key and [Key.Derive] derives a key from it for each
// downstream request. A retry that runs the handler again after a crash
// between the provider's charge and the stored response then sends the
// provider the same key, and the provider replays its charge instead of
// making a second one.
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
