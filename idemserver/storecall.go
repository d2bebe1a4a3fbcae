package idemserver

import (
	"context"
	"sync"
	"time"
)

// callContext is the context of one store call: its parent, ended at the
// call's deadline too (see [WithStoreTimeout]), as context.WithDeadline
// would make it, until stop is called; from then on it is its parent
// again, so that a context a store derived from it and handed back (see
// [ClaimResult.Context]) does not end at a deadline meant for the claim.
//
// context.WithDeadline costs allocations on every call, for a timer that a
// store that never waits (the MemoryStore, which only asks Err) has no use
// for. So the context makes its Done channel, and the timer that closes it
// at the deadline, only when Done is first called; until then Err compares
// the clock with the deadline. A callContext whose Done was asked for, or
// that a store handed back, may still be watched after the call, and is
// not reused (see buffers.storeCall). One whose Done was not asked for is
// reused, for the request's next call or another request's: a store's
// goroutine that outlived its call may still call its methods then, so
// they and start share its lock.
type callContext struct {
	parent   context.Context
	deadline time.Time

	mu      sync.Mutex
	done    chan struct{} // made by the first Done
	err     error         // set once the context has ended
	timer   *time.Timer   // closes done at the deadline
	stopped bool          // the call has ended: the context is its parent
}

// start readies c for a call under parent that must end by deadline. A
// store's goroutine that outlived an earlier call may still call c's
// methods, so c is changed under its lock, never copied over.
func (c *callContext) start(parent context.Context, deadline time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.parent, c.deadline = parent, deadline
	c.done, c.err, c.timer, c.stopped = nil, nil, nil, false
}

// stop ends the call's deadline: c is its parent from now on. It reports
// whether c may be used for another call, which it may not once a store
// could be watching it.
func (c *callContext) stop() (reusable bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopped = true
	if c.timer != nil {
		c.timer.Stop()
	}
	return c.done == nil
}

func (c *callContext) Deadline() (time.Time, bool) {
	c.mu.Lock()
	parent, deadline, stopped := c.parent, c.deadline, c.stopped
	c.mu.Unlock()
	d, ok := parent.Deadline()
	if !stopped && (!ok || deadline.Before(d)) {
		return deadline, true
	}
	return d, ok
}

func (c *callContext) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done != nil {
		return c.done
	}
	if c.stopped && c.err == nil {
		return c.parent.Done()
	}
	c.done = make(chan struct{})
	if c.err != nil {
		close(c.done)
		return c.done
	}
	c.timer = time.AfterFunc(time.Until(c.deadline), func() { c.end(context.DeadlineExceeded) })
	if parent := c.parent; parent.Done() != nil {
		// Registered until the parent ends, which a request's context
		// does when the request ends.
		context.AfterFunc(parent, func() { c.end(parent.Err()) })
	}
	return c.done
}

func (c *callContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		if err := c.parent.Err(); err != nil {
			c.endLocked(err)
		} else if !c.stopped && time.Until(c.deadline) <= 0 {
			// time.Until reads only the monotonic clock, half of what
			// time.Now reads.
			c.endLocked(context.DeadlineExceeded)
		}
	}
	return c.err
}

func (c *callContext) Value(key any) any {
	c.mu.Lock()
	parent := c.parent
	c.mu.Unlock()
	return parent.Value(key)
}

func (c *callContext) end(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil && (!c.stopped || err != context.DeadlineExceeded) {
		c.endLocked(err)
	}
}

func (c *callContext) endLocked(err error) {
	c.err = err
	if c.done != nil {
		close(c.done)
	}
}
