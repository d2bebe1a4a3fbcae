package pgstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
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

// poolTick is how often a claim that waits for a pool connection looks
// whether its request's context has ended.
const poolTick = 50 * time.Millisecond

// maxConnTries bounds how many connections one step of a claim tries, when
// the driver reports them bad (driver.ErrBadConn), as database/sql's own
// methods on a DB do.
const maxConnTries = 3

// conn takes a connection from the pool, waiting for one no longer than
// the store's bound and only while ctx lasts.
//
// When the pool has a free connection this allocates nothing of its own:
// the wait's context is reused (see poolWait), since database/sql keeps no
// hold on the context given to DB.Conn once it returns.
func (s *Store) conn(ctx context.Context) (*sql.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	w, _ := s.waits.Get().(*poolWait)
	if w == nil {
		w = newPoolWait()
	}
	w.start(ctx, s.poolWait)
	conn, err := s.db.Conn(w)
	timedOut, reusable := w.end()
	if reusable {
		s.waits.Put(w)
	}
	if err != nil && timedOut {
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

// A poolWait is the context under which a claim waits for a pool
// connection: its request's context, and a deadline the store's bound
// sets. Its Done channel is its own, closed by a timer that looks every
// poolTick whether the request's context has ended, and at the bound,
// so that no goroutine or context is made for a wait that ends at once.
// Once a wait has ended without its channel closing, the poolWait is used
// again (see Store.conn).
type poolWait struct {
	timer *time.Timer
	done  chan struct{}

	mu       sync.Mutex
	parent   context.Context // nil between waits
	begun    time.Time
	bound    time.Duration
	err      error // set when done is closed
	timedOut bool  // done was closed at the bound
}

func newPoolWait() *poolWait {
	w := &poolWait{done: make(chan struct{})}
	w.timer = time.AfterFunc(time.Hour, w.tick)
	w.timer.Stop()
	return w
}

// start begins a wait of at most bound under parent.
func (w *poolWait) start(parent context.Context, bound time.Duration) {
	w.mu.Lock()
	w.parent, w.begun, w.bound = parent, time.Now(), bound
	w.mu.Unlock()
	w.timer.Reset(min(bound, poolTick))
}

// tick ends the wait if its request's context has ended or its bound has
// passed, and otherwise looks again later.
func (w *poolWait) tick() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.parent == nil || w.err != nil {
		return // the wait has ended
	}
	if err := w.parent.Err(); err != nil {
		w.err = err
	} else if left := w.bound - time.Since(w.begun); left > 0 {
		w.timer.Reset(min(left, poolTick))
		return
	} else {
		w.err, w.timedOut = context.DeadlineExceeded, true
	}
	close(w.done)
}

// end ends the wait. It reports whether the bound ended it, and whether w
// may serve another wait: not once its channel is closed, nor while its
// timer may still run for this one.
func (w *poolWait) end() (timedOut, reusable bool) {
	stopped := w.timer.Stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	w.parent = nil
	return w.timedOut, stopped && w.err == nil
}

// Deadline returns the end of the bound, or the request's deadline if that
// comes first.
func (w *poolWait) Deadline() (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	d := w.begun.Add(w.bound)
	if w.parent == nil {
		return d, true
	}
	if pd, ok := w.parent.Deadline(); ok && pd.Before(d) {
		return pd, true
	}
	return d, true
}

func (w *poolWait) Done() <-chan struct{} { return w.done }

func (w *poolWait) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *poolWait) Value(key any) any {
	w.mu.Lock()
	parent := w.parent
	w.mu.Unlock()
	if parent == nil {
		return nil
	}
	return parent.Value(key)
}
