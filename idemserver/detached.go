package idemserver

import (
	"context"
	"sync/atomic"
	"time"
)

// detachedContext is context.WithoutCancel(parent): the context of the
// store calls that must go through though the client has gone (ending a
// claim, extending its lease), with the parent's values and without its
// cancellation. It costs no allocation of its own, where WithoutCancel
// costs one: it lives in the run's one allocation, and it makes
// WithoutCancel's context, which answers for its values, only when a value
// is first asked for, which the MemoryStore never does.
type detachedContext struct {
	parent context.Context
	values atomic.Pointer[context.Context] // WithoutCancel(parent), once made
}

func (*detachedContext) Deadline() (time.Time, bool) { return time.Time{}, false }

func (*detachedContext) Done() <-chan struct{} { return nil }

func (*detachedContext) Err() error { return nil }

// Value returns what context.WithoutCancel(parent) does, which hides the
// parent's cancellation from its values too: context.Cause reads a
// context's cause from them.
func (c *detachedContext) Value(k any) any {
	v := c.values.Load()
	if v == nil {
		ctx := context.WithoutCancel(c.parent)
		c.values.CompareAndSwap(nil, &ctx)
		v = c.values.Load()
	}
	return (*v).Value(k)
}
