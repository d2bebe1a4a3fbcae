package idemtest_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestSoakFailsOverBrokenStore runs the soak, over each store, through a
// wrapper that releases each claim instead of completing it: a store that
// forgets every outcome. Retries then run the handler again (or, in
// transactional mode, the client is told of a charge the rollback undid),
// and the soak must say so.
func TestSoakFailsOverBrokenStore(t *testing.T) {
	cfg := soakConfig{"concurrent/mixed reads", 8, readModes, 0, nil}
	for _, b := range soakBackends() {
		t.Run(b.name, func(t *testing.T) {
			b.skipUnset(t)
			b.wrap = func(s idemserver.Store) idemserver.Store { return forgetfulStore{s} }
			rec := &failureRecorder{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				soak(rec, 1, cfg, b)
			}()
			<-done
			assert.True(t, rec.Failed(), "the soak passed over a store that forgets every outcome")
			t.Logf("the soak's complaints: %s", rec.summary())
		})
	}
}

// forgetfulStore releases the claims it is asked to complete, and
// reports them completed. It holds responses as the store it wraps does.
type forgetfulStore struct{ idemserver.Store }

func (s forgetfulStore) HoldResponses() bool {
	h, ok := s.Store.(idemserver.ResponseHolder)
	return ok && h.HoldResponses()
}

func (s forgetfulStore) Complete(ctx context.Context, key idemserver.Key, token string, _ *idemserver.Response, _ time.Time) error {
	return s.Release(ctx, key, token)
}

// failureRecorder is a testing.TB that records failures instead of
// failing its test; FailNow ends the goroutine, as it does in a test.
type failureRecorder struct {
	testing.TB
	mu     sync.Mutex
	failed bool
	msgs   []string
}

func (r *failureRecorder) Helper() {}

func (r *failureRecorder) Fail() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = true
}

func (r *failureRecorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

func (r *failureRecorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = true
	r.msgs = append(r.msgs, fmt.Sprintf(format, args...))
}

func (r *failureRecorder) Error(args ...any) { r.Errorf("%s", fmt.Sprint(args...)) }

func (r *failureRecorder) FailNow() {
	r.Fail()
	runtime.Goexit()
}

func (r *failureRecorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}

func (r *failureRecorder) Fatal(args ...any) {
	r.Error(args...)
	runtime.Goexit()
}

func (r *failureRecorder) Logf(string, ...any) {}

// summary returns the first line of the first failures recorded.
func (r *failureRecorder) summary() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var lines []string
	for _, m := range r.msgs[:min(3, len(r.msgs))] {
		line, _, _ := strings.Cut(strings.TrimSpace(m), "\n")
		lines = append(lines, line)
	}
	return fmt.Sprintf("%d, first %q", len(r.msgs), lines)
}
