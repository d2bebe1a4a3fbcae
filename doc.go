// Package idemhttp makes HTTP retries safe for operations that must happen
// exactly once, such as charging a card or placing an order.
//
// # The model
//
// A client that times out cannot know whether the server acted. idemhttp
// names every logical operation with one idempotency key, sends that key on
// every attempt (and, with a durable [KeyStore], after the process restarts),
// and lets a server that remembers keys replay the first outcome instead of
// acting twice. Around that contract, a [Transport] retries only what is safe
// to retry, waits with full-jitter exponential backoff, obeys Retry-After,
// and never sleeps past the caller's context.
//
// A [Transport] is an [http.RoundTripper]. Wrap any base transport with
// [NewTransport], or take a ready [http.Client] from [NewClient]:
//
//	client := idemhttp.NewClient()
//	ctx := idemhttp.WithOperation(ctx, "charge-order-1234")
//	req, _ := http.NewRequestWithContext(ctx, "POST", url, body)
//	resp, err := client.Do(req)
//
// # What is retried
//
// Idempotent methods (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) and any request
// carrying an idempotency key are retried on connection failures, attempt
// timeouts and the statuses 408, 425, 429, 500, 502, 503 and 504; a 409 only
// when it carries Retry-After, which is how an idempotent server says the
// first request with this key is still in progress. Other requests are retried
// only when the error proves nothing was sent, such as a failed dial. The
// caller's own context ending, TLS verification failures and other 4xx
// statuses are never retried.
//
// # Operations and keys
//
// Requests whose method is keyed (POST and PATCH by default) get an
// Idempotency-Key header unless the caller already set one (a blank value,
// which reaches the server empty, is none, and is not sent: net/http would
// resend a request carrying the field whatever its value). Without an operation in the
// context the key is a fresh UUIDv7 shared by the attempts of one
// RoundTrip, and by the request that repeats it after a 307 or 308 that
// http.Client follows. With [WithOperation] the key comes from the
// configured [KeyStore] and stays pending until the outcome is final (a
// 2xx; a 3xx other than 307 and 308 that [http.Client] would not follow,
// such as a 304, or a 301, 302 or 303 without a Location; or a 4xx that is
// not retryable, answering the key's first send or replayed by the server)
// and has reached the caller, so a later call for the same operation, in
// this process or the next, sends the same key. Through a
// redirect that http.Client follows, it stays pending until the outcome of
// the request that follows reaches the caller (a 4xx answering the GET
// that follows a 301, 302 or 303 is never final: the redirect was the
// key's outcome); a redirect returned unfollowed leaves it pending (see
// [Transport]). With [HoldKey] the Transport leaves the key pending even
// then, and the caller releases it with [Settle] once it has saved the
// outcome, so that a crash between reading the outcome and saving it
// leaves the key to be sent again.
//
// The default [MemoryKeyStore] forgets everything when the process exits. A
// [FileKeyStore], from [OpenFileKeyStore], keeps pending keys in a file that
// survives crashes and power loss; after a restart, [FileKeyStore.Pending]
// lists the operations left unfinished, oldest first, to be sent again.
//
// # Retry budgets, circuit breakers and rate limits
//
// Retries multiply load exactly when a server can least take it. Each host
// (scheme, host and port) gets three guards, all optional:
//
//   - A retry budget, on by default: retries may add at most 20% to the
//     first attempts of the last 10 seconds, plus a floor of 3 per second.
//     A refused retry ends the request with its last outcome; see [Budget].
//   - A circuit breaker, on by default: after repeated network errors or
//     5xx responses the host's breaker opens, and for a while requests fail
//     at once with [ErrCircuitOpen] without being sent; see
//     [BreakerSettings].
//   - An adaptive rate limit, off by default: attempts wait for the host's
//     limiter, whose rate halves on a 429 and creeps back on successes; see
//     [WithRateLimit].
//
// A request refused by the budget or the breaker leaves its operation's key
// pending, like any outcome that is not final.
package idemhttp
