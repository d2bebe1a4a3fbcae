package pgstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"
)

// DefaultPoolWait is how long a claim in transactional mode waits for a
// free pool connection unless [WithPoolWait] says otherwise: as long as
// the middleware's default Retry-After asks a refused client to wait.
const DefaultPoolWait = time.Second

// ErrPoolTimeout is returned, wrapped with [context.DeadlineExceeded], by a
// claim in transactional mode that found no free pool connection within
// the wait [WithPoolWait] bounds. The middleware answers it as any store
// failure: 503 with Retry-After, without running the handler.
var ErrPoolTimeout = errors.New("pgstore: no pool connection came free in time; see pgstore.WithPoolWait")

// WithPoolWait bounds how long a claim in transactional mode waits for a
// free connection of the pool (see [sql.DB.SetMaxOpenConns]), each time it
// needs one: for its first read and for its transaction (the wait
// includes opening a new connection, when the pool may). A claim whose
// wait passes d fails with an error wrapping [ErrPoolTimeout], so that the
// client gets 503 with Retry-After, and the handler does not run. The wait
// also ends with the request's context. Zero or less means
// [DefaultPoolWait].
//
// In transactional mode every claimed request holds a pool connection
// while its handler runs, so when handlers fill the pool, a duplicate's
// read and a new key's claim wait for one of them to return; under a
// server without timeouts the request's context never ends, and without
// this bound they would wait as long as the slowest handler. Lease mode
// holds a connection for one statement at a time, so its claims are not
// bounded by the store: they wait as database/sql does, until a
// connection is free or the request's context ends.
func WithPoolWait(d time.Duration) Option {
	return func(c *config) { c.poolWait = d }
}

// maxConnTries bounds how many connections one step of a claim tries, when
// the driver reports them bad (driver.ErrBadConn), as database/sql's own
// methods on a DB do.
const maxConnTries = 3

// conn takes a connection from the pool, waiting for one no longer than
// the store's bound and only while ctx lasts.
func (s *Store) conn(ctx context.Context) (*sql.Conn, error) {
	wait, cancel := context.WithTimeoutCause(ctx, s.poolWait, ErrPoolTimeout)
	defer cancel() // database/sql keeps no hold on the context once Conn returns
	conn, err := s.db.Conn(wait)
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(wait), ErrPoolTimeout) {
		return nil, fmt.Errorf("%w (%v): %w", ErrPoolTimeout, s.poolWait, err)
	}
	return conn, err
}

// onConn runs f on a pool connection taken by conn, and on another while f
// reports the one it had bad, up to maxConnTries in all. f closes the
// connection, or keeps it.
func (s *Store) onConn(ctx context.Context, f func(*sql.Conn) error) error {
	for try := 1; ; try++ {
		conn, err := s.conn(ctx)
		if err != nil {
			return err
		}
		err = f(conn)
		if !errors.Is(err, driver.ErrBadConn) || try == maxConnTries {
			return err
		}
	}
}
