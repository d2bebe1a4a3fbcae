package idemhttp

import (
	"log/slog"
	"net/http"
	"time"

	"golang.org/x/time/rate"
)

// Defaults used when the matching option is not given.
const (
	DefaultMaxAttempts   = 4
	DefaultKeyHeader     = "Idempotency-Key"
	DefaultMaxRetryAfter = 30 * time.Second
)

// An Option configures a [Transport].
type Option func(*config)

type config struct {
	maxAttempts    int
	backoff        Backoff
	keyStore       KeyStore
	keyHeader      string // in canonical form
	keyedMethods   []string
	structuredKey  bool
	newKey         func() (string, error) // nil: the Transport's keySource
	logger         *slog.Logger
	hook           func(Attempt)
	attemptTimeout time.Duration
	maxRetryAfter  time.Duration
	bodyLimit      int64

	budget    *Budget          // consulted before retries; nil: none
	budgetSet bool             // WithBudget was given
	breaker   *BreakerSettings // nil: no circuit breakers
	rateLimit rate.Limit       // zero or less: no rate limit
	rateBurst int
	maxHosts  int           // hosts with breakers and limiters
	idleHost  time.Duration // after which a host is forgotten
}

// observed reports whether a hook or a logger is told about attempts.
func (c *config) observed() bool { return c.hook != nil || c.logger != nil }

func newConfig(opts []Option) config {
	c := config{
		maxAttempts:   DefaultMaxAttempts,
		backoff:       FullJitter(DefaultBackoffBase, DefaultBackoffMax),
		keyHeader:     DefaultKeyHeader,
		keyedMethods:  []string{http.MethodPost, http.MethodPatch},
		maxRetryAfter: DefaultMaxRetryAfter,
		bodyLimit:     DefaultBodyBufferLimit,
		breaker:       &BreakerSettings{},
		maxHosts:      DefaultMaxHosts,
		idleHost:      DefaultIdleHostTimeout,
	}
	for _, opt := range opts {
		if opt != nil {
			opt(&c)
		}
	}
	if c.keyStore == nil {
		c.keyStore = NewMemoryKeyStore()
	}
	if !c.budgetSet {
		c.budget = NewBudget()
	}
	return c
}

// WithMaxAttempts sets how many attempts a request may make in all, the
// first included (default 4). A value below 1 means 1: no retries.
func WithMaxAttempts(n int) Option {
	return func(c *config) { c.maxAttempts = max(n, 1) }
}

// WithBackoff sets how long to wait before each retry (default
// FullJitter(100ms, 10s)). A nil Backoff restores the default.
func WithBackoff(b Backoff) Option {
	return func(c *config) {
		if b == nil {
			b = FullJitter(DefaultBackoffBase, DefaultBackoffMax)
		}
		c.backoff = b
	}
}

// WithKeyStore sets where the keys of operations named with [WithOperation]
// are kept (default: a new [MemoryKeyStore] per Transport). Use a durable
// store for keys that must survive a restart. A nil store restores the
// default.
func WithKeyStore(s KeyStore) Option {
	return func(c *config) { c.keyStore = s }
}

// WithKeyHeader sets the name of the idempotency key header field (default
// "Idempotency-Key"). An empty name restores the default.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		if name == "" {
			name = DefaultKeyHeader
		}
		c.keyHeader = http.CanonicalHeaderKey(name)
	}
}

// WithKeyedMethods sets the methods whose requests carry an idempotency key
// (default POST and PATCH). Method names are case-sensitive, as in HTTP.
// Requests of other methods are sent without a key unless the caller set
// one.
func WithKeyedMethods(methods ...string) Option {
	return func(c *config) { c.keyedMethods = append([]string(nil), methods...) }
}

// WithStructuredKey sends generated keys as Structured Fields strings
// (RFC 9651), quoted as in `Idempotency-Key: "8e03978e-..."`, the form the
// IETF Idempotency-Key draft specifies. By default keys are sent as bare
// tokens, the form most deployed APIs expect. Keys the caller sets are sent
// as the caller wrote them either way.
func WithStructuredKey() Option {
	return func(c *config) { c.structuredKey = true }
}

// WithKeyGenerator sets the function that makes new idempotency keys
// (default: a UUIDv7 string). Keys must be unique per operation; an error
// stops the request before anything is sent, and so does a key that is
// empty, holds a byte outside printable ASCII, or, unless
// [WithStructuredKey], begins or ends with a space or begins with a double
// quote (the server would read another key). The same holds for the keys
// a [KeyStore] returns. A nil function restores the default.
//
// The default reads the random bits of 64 keys from crypto/rand at a time,
// so those of up to 63 keys to come are in the Transport's memory. A
// process that may be snapshotted and restored more than once (a cloned VM
// or CRIU image) would hand out the same keys in each copy: there, use a
// generator that reads crypto/rand for each key, such as
// uuid.NewV7's via func() (string, error) { u, err := uuid.NewV7(); return u.String(), err }.
func WithKeyGenerator(newKey func() (string, error)) Option {
	return func(c *config) { c.newKey = newKey }
}

// WithLogger sets a logger for the Transport's decisions: retries, and
// requests refused by an open circuit breaker, at Debug level; give-ups at
// Warn; a host's breaker opening at Warn and its other state changes at Info;
// and, at Warn, a key that the KeyStore could not record (nothing is sent) or
// forget. Nil (the default) logs nothing.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithAttemptHook sets a function called once after every attempt with what
// happened and what the Transport decided. It is called on the goroutine
// running the request, so it must be quick and safe for concurrent use.
func WithAttemptHook(hook func(Attempt)) Option {
	return func(c *config) { c.hook = hook }
}

// WithAttemptTimeout bounds each attempt, up to its response headers and
// then through reading its body, by d. An attempt that times out is retried
// like a lost connection. Zero (the default) leaves attempts bounded only by
// the request's context.
func WithAttemptTimeout(d time.Duration) Option {
	return func(c *config) { c.attemptTimeout = max(d, 0) }
}

// WithMaxRetryAfter caps the wait a server can ask for with Retry-After
// (default 30s). A longer Retry-After is treated as this cap.
func WithMaxRetryAfter(d time.Duration) Option {
	return func(c *config) { c.maxRetryAfter = max(d, 0) }
}

// WithBodyBufferLimit sets how many bytes of a request body without GetBody
// are buffered so it can be resent (default 1 MiB). A larger body is sent
// once and not retried. Bodies with GetBody, such as those
// http.NewRequest makes from a bytes.Reader or strings.Reader, are never
// buffered.
func WithBodyBufferLimit(n int64) Option {
	return func(c *config) { c.bodyLimit = max(n, 0) }
}
