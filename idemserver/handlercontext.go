package idemserver

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// claimedKey is the context key under which the middleware gives a
// handler the key it claimed.
type claimedKey struct{}

// handlerContext is the context of a claimed request's handler. It carries
// the claimed key as the value of claimedKey (see [KeyFrom]), and it ends
// when its parent does, when the lease keeper cancels it with a cause, and
// when the handler returns, as a context.WithCancelCause child of the
// parent would.
//
// It becomes such a child only when it must. Making one costs two
// allocations, and following a parent that is a net/http request's context
// costs that context three more (its Done channel and its set of
// children); yet most handlers never ask for Done, and a lease is almost
// never lost. So the context answers for its parent until Done is first
// called, the keeper cancels it, or it is used after the handler returned;
// then it makes the child (see cancellable) and is that child, with the key,
// from then on. Until then it has not been cancelled itself, so it is done
// exactly when its parent is, with its parent's cause: Err and Value (and
// so context.Cause, which reads a value) are the parent's.
//
// It lives in the run's one allocation, which is never reused: a handler
// may keep its context after it returns.
type handlerContext struct {
	parent context.Context
	key    *Key

	// made says that child and cancelChild are set; ended, that the
	// handler has returned. Both change only under mu, and can be read
	// without it.
	made, ended atomic.Bool
	mu          sync.Mutex
	child       context.Context
	cancelChild context.CancelCauseFunc
	// endedFirst says that the handler returned before the parent ended:
	// the context ended then, with context.Canceled, whatever the parent
	// does later.
	endedFirst bool
}

func (c *handlerContext) Deadline() (time.Time, bool) { return c.parent.Deadline() }

func (c *handlerContext) Done() <-chan struct{} { return c.cancellable().Done() }

func (c *handlerContext) Err() error {
	if c.made.Load() || c.ended.Load() {
		return c.cancellable().Err()
	}
	return c.parent.Err()
}

func (c *handlerContext) Value(k any) any {
	if _, ok := k.(claimedKey); ok {
		return c.key
	}
	if c.made.Load() || c.ended.Load() {
		return c.cancellable().Value(k)
	}
	return c.parent.Value(k)
}

// cancellable returns the context.WithCancelCause child of the parent,
// made on first use; after the handler returned, it is made cancelled.
func (c *handlerContext) cancellable() context.Context {
	if c.made.Load() {
		return c.child
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.makeLocked()
	return c.child
}

func (c *handlerContext) makeLocked() {
	if c.made.Load() {
		return
	}
	parent := c.parent
	if c.endedFirst {
		parent = context.WithoutCancel(parent) // so as not to take its cause
	}
	c.child, c.cancelChild = context.WithCancelCause(parent)
	if c.ended.Load() {
		c.cancelChild(nil)
	}
	c.made.Store(true)
}

// cancel cancels the context with cause, unless it has ended already.
func (c *handlerContext) cancel(cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.makeLocked()
	c.cancelChild(cause)
}

// end ends the context when the handler returns. A context that is not
// cancellable yet stays so: it is made cancelled when it is next used, if
// it ever is.
func (c *handlerContext) end() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ended.Store(true)
	if c.made.Load() {
		c.cancelChild(nil)
		return
	}
	c.endedFirst = c.parent.Err() == nil
}
