package idemtest

import "github.com/idemhttp/idemhttp/idemserver"

// An Option configures a [Server].
type Option func(*config)

type config struct {
	store      idemserver.Store
	middleware []idemserver.Option
	faults     Faults
	seed       int64
	seeded     bool
	header     string
}

// WithStore sets the store of the server's middleware. By default the server
// makes an [idemserver.MemoryStore] of its own, which Close closes; a store
// given here is the caller's to close. The store reaches the middleware
// through a wrapper that passes every call on, its idemserver.PackedStore
// methods too, says whether it holds responses (idemserver.ResponseHolder)
// as the store does, returns each claim's result whole, and tells the ledger which scoped key each request
// claimed and, for a store that holds responses, of the runs whose work
// the store discarded (see the package documentation).
func WithStore(s idemserver.Store) Option {
	return func(c *config) { c.store = s }
}

// WithFaults sets the faults the server injects. The default is none.
func WithFaults(f Faults) Option {
	return func(c *config) { c.faults = f }
}

// WithSeed sets the seed the faults are drawn from; the same seed gives the
// same faults (see the package documentation). By default the seed is
// random; [Server.Seed] reports it either way.
func WithSeed(seed int64) Option {
	return func(c *config) { c.seed, c.seeded = seed, true }
}

// WithMiddleware sets options of the server's idemserver.Middleware, such
// as idemserver.RequireKey or idemserver.WithLease. Set the key's header
// field with [WithKeyHeader] instead of idemserver.WithKeyHeader, which
// would be overridden, so that the ledger and the client use it too.
func WithMiddleware(opts ...idemserver.Option) Option {
	return func(c *config) { c.middleware = append(c.middleware, opts...) }
}

// WithKeyHeader sets the header field that carries the idempotency key, for
// the middleware, the ledger, the fault injector and [Server.Client]. An
// empty name means idemserver.DefaultKeyHeader.
func WithKeyHeader(name string) Option {
	return func(c *config) { c.header = name }
}
