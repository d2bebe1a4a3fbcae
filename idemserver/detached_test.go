package idemserver

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestDetachedContextIsWithoutCancel compares the store's context with
// context.WithoutCancel of the same parent, which has a deadline and a
// value and has been cancelled with a cause: neither is done, has a
// deadline or a cause, and both have the parent's values, as do contexts
// derived from them.
func TestDetachedContextIsWithoutCancel(t *testing.T) {
	parent, cancel := context.WithDeadline(context.WithValue(context.Background(), testValueKey{}, "v"), time.Now().Add(time.Hour))
	ctx, cancelCause := context.WithCancelCause(parent)
	cancelCause(errGone)
	cancel()
	for name, c := range map[string]context.Context{
		"WithoutCancel":   context.WithoutCancel(ctx),
		"detachedContext": &detachedContext{parent: ctx},
	} {
		t.Run(name, func(t *testing.T) {
			_, ok := c.Deadline()
			assert.False(t, ok)
			assert.Nil(t, c.Done())
			assert.NoError(t, c.Err())
			assert.NoError(t, context.Cause(c))
			assert.Equal(t, "v", c.Value(testValueKey{}))
			derived, cancel := context.WithCancel(c)
			defer cancel()
			assert.NoError(t, derived.Err())
			assert.NoError(t, context.Cause(derived))
			assert.Equal(t, "v", derived.Value(testValueKey{}))
		})
	}
}

// TestDetachedContextConcurrentValues asks for values from several
// goroutines at once, the first of which makes the context that answers.
func TestDetachedContextConcurrentValues(t *testing.T) {
	c := &detachedContext{parent: context.WithValue(context.Background(), testValueKey{}, "v")}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { assert.Equal(t, "v", c.Value(testValueKey{})) })
	}
	wg.Wait()
}
