package idemserver

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Defaults of the middleware.
const (
	// DefaultKeyHeader is the header field that carries the key.
	DefaultKeyHeader = "Idempotency-Key"
	// DefaultTTL is how long a completed response is kept for replay.
	DefaultTTL = 24 * time.Hour
	// DefaultLease is how long the claim of a handler that stopped without
	// ending it (its process died) holds its key before another request
	// may take it over. A running handler's lease is renewed.
	DefaultLease = time.Minute
	// MinLease is the shortest lease the middleware takes (see
	// [WithLease]): the lease is renewed every third of it, and at most
	// once a millisecond, so a shorter one could end before its renewal
	// and be taken over while its handler runs.
	MinLease = 10 * time.Millisecond
	// DefaultMaxHold is how long one handler may hold its key, renewing
	// its lease, before the middleware stops renewing it and cancels the
	// handler's context.
	DefaultMaxHold = 10 * time.Minute
	// DefaultMaxBodyBytes is the largest request body the middleware
	// reads to fingerprint a request.
	DefaultMaxBodyBytes = 1 << 20
	// DefaultMaxResponseBytes is the largest response body the middleware
	// stores for replay.
	DefaultMaxResponseBytes = 1 << 20
	// DefaultStoreTimeout is how long the middleware waits for the store to
	// answer one call; see [WithStoreTimeout].
	DefaultStoreTimeout = 5 * time.Second
	// DefaultRetryAfter is the wait the middleware asks for in the
	// Retry-After field of its 409 and 503 responses.
	DefaultRetryAfter = time.Second
)

// An Option configures the middleware.
type Option func(*config)

type config struct {
	header        string
	methods       map[string]bool
	requireKey    bool
	scope         func(*http.Request) string
	wait          time.Duration
	ttl           time.Duration
	lease         time.Duration
	maxHold       time.Duration
	storeTimeout  time.Duration
	maxBody       int64
	maxResponse   int64
	retryAfter    string
	replayHeaders map[string]bool
	now           func() time.Time
	ownClock      bool // now is not time.Now
	observe       func(Event)
}

func newConfig(opts []Option) *config {
	c := &config{
		header:       DefaultKeyHeader,
		methods:      map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		ttl:          DefaultTTL,
		lease:        DefaultLease,
		maxHold:      DefaultMaxHold,
		storeTimeout: DefaultStoreTimeout,
		maxBody:      DefaultMaxBodyBytes,
		maxResponse:  DefaultMaxResponseBytes,
		now:          time.Now,
	}
	WithRetryAfter(DefaultRetryAfter)(c)
	for _, o := range opts {
		o(c)
	}
	return c
}

// RequireKey makes the key mandatory: a request with a keyed method and no
// key is refused with 400 and a problem of type [ProblemMissingKey]. Without
// this option such a request goes straight to the handler.
func RequireKey() Option {
	return func(c *config) { c.requireKey = true }
}

// WithScope sets the function that names the scope of a request's key,
// such as the authenticated tenant or principal. Keys of different scopes
// are different keys: one scope can neither replay nor block another's. The
// function runs after the middlewares in front of this one, so it can read
// what an authentication middleware put in the request's context. A nil
// function, the default, puts every key in the empty scope.
func WithScope(scope func(*http.Request) string) Option {
	return func(c *config) { c.scope = scope }
}

// WithWaitInFlight makes a request whose key is in progress wait, up to max,
// for the first request to complete and then replay its response, instead
// of being refused at once with 409. A request still waiting after max, or
// whose context ends, gets the 409. The wait polls the store, first after
// 5ms and then at growing intervals up to 250ms. Zero, the default, means
// no wait.
func WithWaitInFlight(max time.Duration) Option {
	return func(c *config) { c.wait = max }
}

// WithTTL sets how long a completed response is kept for replay; after it
// the key may be used again. Values of zero or less mean [DefaultTTL].
func WithTTL(d time.Duration) Option {
	return func(c *config) {
		if d <= 0 {
			d = DefaultTTL
		}
		c.ttl = d
	}
}

// WithLease sets the lease of a claim: how long a record in progress
// holds its key without being renewed. While the handler runs, the
// middleware extends the lease ([Store.Extend]) every third of a lease, so a
// live handler is never taken over however long it runs (up to
// [WithMaxHold]); a failed extension is tried again while the lease lasts.
// If the lease is lost anyway (the store reports [ErrLeaseLost], or it
// could not be extended before it ended), the handler's context is
// cancelled with a cause wrapping [ErrLeaseLost].
//
// A record still in progress when its lease has ended belonged to a handler
// that stopped without ending its claim, because its process died; the next
// request with its key takes it over and runs the handler again. So the
// lease is how long a key waits after a crash, and it should be long enough
// that a renewal can get through a short store outage. Values of zero or
// less mean [DefaultLease], and other values below [MinLease] mean
// MinLease: a lease the keeper could not renew before it ended would let
// a live handler be taken over.
func WithLease(d time.Duration) Option {
	return func(c *config) {
		if d <= 0 {
			d = DefaultLease
		}
		c.lease = max(d, MinLease)
	}
}

// WithMaxHold bounds how long one handler may hold its key, so that a
// handler that never returns does not keep its key, and every retry of it
// waiting with 409, forever. When the handler has run for d, the
// middleware stops renewing its lease and cancels its context with a cause
// wrapping [ErrMaxHoldExceeded]. The lease then lapses within one lease
// (see [WithLease]), after which the next request with the key takes it
// over and runs the handler again, even if the first is still running. A
// handler therefore holds its key for at most d plus one lease. A handler
// that returns after d without writing a response has its claim released;
// one whose claim was taken over meanwhile cannot store its response, and
// its client is told to retry (see [ProblemLeaseLost]). Values of zero or
// less mean [DefaultMaxHold].
func WithMaxHold(d time.Duration) Option {
	return func(c *config) {
		if d <= 0 {
			d = DefaultMaxHold
		}
		c.maxHold = d
	}
}

// WithStoreTimeout bounds each call the middleware makes to the store: the
// context of a claim, a Complete, a Release or an Extend ends d after the
// call starts (an Extend's ends with the lease, if that is sooner), so
// that a store whose connection went silent, as one does when a database
// fails over or a NAT entry dies, fails the call instead of holding the
// request until the operating system gives up on the connection. A call
// that timed out counts as any other store failure: a claim is answered
// with 503 and the handler does not run; a Complete or Release is tried
// again while the lease lasts, and then, if still failing, a Release
// leaves the key in progress until its lease lapses, and a Complete's
// response reaches the client, as stored or not (it may have been
// stored: a retry then replays the same response); an Extend is tried
// again while the lease lasts, and if none succeeds the handler's context
// is cancelled with [ErrLeaseLost] before the lease ends. A store that
// runs the handler in a transaction reports a commit it cannot vouch for
// with [ErrOutcomeUnknown], and the claim is not released.
//
// The bound is a store's to honour: it ends the context, and a store
// that does not watch its context is not bounded. Values of zero or less
// mean [DefaultStoreTimeout], 5s: far above a healthy store's answer, even
// a database committing under load, and well within a client's patience
// and the default lease, so that a Complete can be tried again before the
// lease ends. A commit that waits for a synchronous standby can take
// longer while the standby lags: the request then gets 503, and its key
// stays in progress until the commit is reported (see pgstore).
func WithStoreTimeout(d time.Duration) Option {
	return func(c *config) {
		if d <= 0 {
			d = DefaultStoreTimeout
		}
		c.storeTimeout = d
	}
}

// WithKeyHeader sets the name of the header field that carries the key,
// matched in any case. An empty name means [DefaultKeyHeader]. A name that
// is not a field name (RFC 9110 token), which no request could carry and
// which would let every keyed request through as one without a key, makes
// [Middleware] panic.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		if name == "" {
			name = DefaultKeyHeader
		}
		if !validFieldName(name) {
			panic("idemserver: WithKeyHeader: " + strconv.Quote(name) + " is not a header field name")
		}
		c.header = http.CanonicalHeaderKey(name)
	}
}

// WithMethods sets the methods whose requests are deduplicated; requests
// with other methods go straight to the handler. The default is POST and
// PATCH. Calling it with no methods restores the default. Methods match in
// any case: net/http hands a handler the method as the client spelled it
// ("patch", as a browser's fetch sends it), and a handler that acts on it
// must not run once for each retry.
func WithMethods(methods ...string) Option {
	return func(c *config) {
		if len(methods) == 0 {
			methods = []string{http.MethodPost, http.MethodPatch}
		}
		c.methods = make(map[string]bool, len(methods))
		for _, m := range methods {
			c.methods[strings.ToUpper(m)] = true
		}
	}
}

// WithMaxBodyBytes sets the largest request body the middleware reads to
// fingerprint a keyed request. A larger body is refused with 413 and a
// problem of type [ProblemBodyTooLarge], and the handler does not run.
// Values below 1 mean [DefaultMaxBodyBytes].
func WithMaxBodyBytes(n int64) Option {
	return func(c *config) {
		if n < 1 {
			n = DefaultMaxBodyBytes
		}
		c.maxBody = n
	}
}

// WithMaxResponseBytes sets the largest response body the middleware keeps
// for replay. A larger response still reaches the client in full, and the
// key is still completed, so a retry cannot run the handler again; but the
// body is not stored, and a replay carries the original status with a
// problem of type [ProblemResponseNotStored] as its body. Values below 1
// mean [DefaultMaxResponseBytes].
func WithMaxResponseBytes(n int64) Option {
	return func(c *config) {
		if n < 1 {
			n = DefaultMaxResponseBytes
		}
		c.maxResponse = n
	}
}

// WithReplayedHeaders names header fields that are withheld from replays by
// default, such as Set-Cookie, that should be stored and replayed. Hop-by-hop
// fields (Connection, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding,
// Upgrade and any named in Connection) are never replayed.
func WithReplayedHeaders(names ...string) Option {
	return func(c *config) {
		if c.replayHeaders == nil {
			c.replayHeaders = make(map[string]bool, len(names))
		}
		for _, n := range names {
			c.replayHeaders[http.CanonicalHeaderKey(n)] = true
		}
	}
}

// WithRetryAfter sets the wait, rounded up to whole seconds, that the
// middleware's 409 (in progress) and 503 (store unavailable) responses ask
// for in their Retry-After field. Values below one second mean one second.
func WithRetryAfter(d time.Duration) Option {
	return func(c *config) {
		// Rounded up by adding a second for a remainder, rather than by
		// adding a second less a nanosecond first, which overflows a wait
		// near the largest Duration into a negative one, and so one second.
		secs := d / time.Second
		if d%time.Second > 0 {
			secs++
		}
		secs = max(secs, 1)
		c.retryAfter = strconv.FormatInt(int64(secs), 10)
	}
}

// WithClock sets the clock the middleware reads to stamp claims, leases and
// expiries. Nil means time.Now, which also follows the fake clock of a
// testing/synctest bubble.
func WithClock(now func() time.Time) Option {
	return func(c *config) {
		c.now, c.ownClock = now, now != nil
		if now == nil {
			c.now = time.Now
		}
	}
}

// WithObserver sets a function called once for every request with a keyed
// method, with what the middleware did, for logs and metrics. It is called
// on the request's goroutine after the response is written (for a handler
// that panicked, before the panic goes on) and must not block. Without an
// observer, no one hears of records a store drops early to make room
// ([Event.Evictions]), so the middleware does not set
// [Claim.ReportEvictions], and the store drops none it does not report
// otherwise.
func WithObserver(observe func(Event)) Option {
	return func(c *config) { c.observe = observe }
}

// keyed reports whether requests with method are deduplicated (see
// [WithMethods], which keeps the methods in upper case). A method spelled
// as usual costs one map lookup, keyed or not: only one with a lower-case
// letter is looked up again in upper case.
func (c *config) keyed(method string) bool {
	if c.methods[method] {
		return true
	}
	for i := range len(method) {
		if 'a' <= method[i] && method[i] <= 'z' {
			return c.methods[strings.ToUpper(method)]
		}
	}
	return false
}
