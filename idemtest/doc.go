// Package idemtest checks, in ordinary Go tests, that an HTTP client and a
// handler stay exactly-once when the network and the server misbehave, as
// net/http/httptest checks plain HTTP code.
//
// # The model
//
// A [Server] is an httptest server that puts three layers in front of the
// handler under test, outermost first:
//
//	fault injector → idemserver.Middleware → ledger → handler
//
// The fault injector plays an unreliable network and an overloaded server.
// For each request it decides, from a seed, whether to delay it, and then
// whether to
//
//   - reset the connection before the request goes any further, so the
//     handler does not run;
//   - let the request through and reset the connection instead of
//     answering, so the handler acts but its response is lost: the case that
//     makes blind retries dangerous;
//   - answer 503, or 429 with Retry-After, itself, without running the
//     handler;
//   - let the request through and cut its response short: the status and
//     header fields arrive, and the connection is reset halfway through
//     the body, so that a client has, say, a 201 whose body it cannot
//     read, from a handler that acted;
//   - stall: hold the request, unanswered, until the client gives up;
//   - or let it through untouched.
//
// The middleware deduplicates requests by their idempotency key, as it
// would in production. The ledger, just in front of the handler, counts the
// handler's executions per idempotency key, as the middleware keeps them:
// per scope and key when the middleware has a scope (idemserver.WithScope).
// An execution is a run of the
// handler that ended with an outcome the middleware keeps: the handler
// returned a status below 500 other than 408, 425, 429, 499 and a 409 with
// Retry-After (see [idemserver.ReleasesResponse]). A run that panicked or
// answered one of those statuses told the client to try again, and the
// middleware released its key on that word, so it is not counted;
// a handler that acts and then answers 5xx breaks the contract in a way no
// ledger outside the handler can see. A run that returned without writing
// a status once its context had ended is counted, although the middleware
// releases its key (taking it not to have acted): a handler that acted and
// left its status to the implicit 200 runs again on the retry, and the
// ledger shows it as a duplicate. With a store that holds responses
// (idemserver.ResponseHolder, such as a transactional store, or one whose
// claims say so in idemserver.ClaimResult.Hold), a run whose
// work the store discarded is not counted: one the store rolled back
// (idemserver.ErrRolledBack) or asked to run again
// (idemserver.ErrRetryRequest), whether the middleware then ran the
// request again or answered 503. The Server learns of those from the
// store's Complete, through a wrapper that passes every call on. A run
// whose commit's outcome the store could not learn
// (idemserver.ErrOutcomeUnknown) is counted: if it was not kept, its
// retry shows as a duplicate.
//
// The ledger also keeps the answers of those executions, and the fault
// injector, in front of the middleware, checks every response marked
// Idempotent-Replayed against them: a retry must get the first answer
// given for its key in its scope, its status, body and header fields as
// the middleware keeps them (not Set-Cookie nor hop-by-hop fields; another
// tenant's answer for the same key is a leak), and nothing may be replayed for a
// key whose runs gave no answer to keep (a stored 200 for a run that gave
// up when its client left tells the client of an outcome that never
// happened). The Server learns which scoped key the middleware claimed
// for a request from the store's claims, through the same wrapper.
//
// A client and handler that are exactly-once leave one key per logical
// operation in the ledger, each executed once, whatever the faults: an
// operation sent twice with two keys shows as one key too many, a key
// executed twice (because the middleware was bypassed, misconfigured or
// its store forgot the key) as a duplicate, a retry told something
// else than the first answer as a wrong replay, and a run of a POST or
// PATCH (any method HTTP does not define as idempotent) without a key,
// which nothing deduplicates and no key counts, as a run without a key. [Server.Executions],
// [Server.Duplicates], [Server.WrongReplays] and [Server.AssertExactlyOnce]
// read the ledger.
//
// # Repeatable faults
//
// The faults a request meets depend only on the seed, the request's identity
// and how many requests with that identity the injector saw before it. The
// identity is the request's idempotency key, or for a request without one
// its method and URL. Decisions therefore do not depend on how requests of
// different identities are scheduled: the third attempt with key k meets the
// same faults in every run with the same seed. Requests of one identity
// sent at once (two concurrent attempts with one key, or keyless requests
// to one URL) take their attempt numbers in the order they arrive, which
// scheduling decides. Clients make random keys (UUIDv7), so for
// a run that repeats request for request, give the client a key generator
// that repeats too (idemhttp.WithKeyGenerator); the rate at which each fault
// fires is the same either way. The seed is reported by [Server.Seed] and in
// the failure messages of [Server.AssertExactlyOnce], so a failing run can
// be repeated with [WithSeed].
//
// # Across processes
//
// [NewProxy] applies the same faults in a standalone HTTP proxy with its own
// address, for tests whose client and server are separate processes.
package idemtest
