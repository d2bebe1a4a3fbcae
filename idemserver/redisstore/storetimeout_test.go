package redisstore_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// TestStoreTimeoutBoundsCompleteOnSilentRedis has Redis stop answering
// (CLIENT PAUSE) while a handler runs, with a client configured as the
// package documentation says for idemserver.WithStoreTimeout to bound its
// calls: ContextTimeoutEnabled, and no read timeout of its own. The
// Complete must fail at the middleware's deadline, with the pause still
// on, rather than wait for Redis to answer; the handler runs once.
func TestStoreTimeoutBoundsCompleteOnSilentRedis(t *testing.T) {
	addr := redisAddr(t)
	client := redis.NewClient(&redis.Options{
		Addr: addr, ContextTimeoutEnabled: true, ReadTimeout: -1, WriteTimeout: -1, MaxRetries: -1,
	})
	t.Cleanup(func() { _ = client.Close() })
	admin := clientOf(t, addr)
	store := redisstore.New(client, redisstore.WithPrefix(newPrefix(t, admin)), redisstore.WithEvictionAllowed())

	const pause = 3 * time.Second
	var runs atomic.Int64
	var events []idemserver.Event
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created(runs.Add(1), w)
		if runs.Load() == 1 {
			require.NoError(t, admin.Do(r.Context(), "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err())
		}
	})
	mw := idemserver.Middleware(store, idemserver.WithStoreTimeout(50*time.Millisecond),
		idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(h)

	req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("b"))
	req.Header.Set(idemserver.DefaultKeyHeader, "k")
	w := httptest.NewRecorder()
	mw.ServeHTTP(w, req)
	// A command sent now waits for the pause to end.
	paused := client.Ping(t.Context()).Err()
	require.Len(t, events, 1)
	e := events[0]
	assert.Equal(t, idemserver.OutcomeExecuted, e.Outcome, "the response reached the client, not stored")
	assert.True(t, errors.Is(e.Err, os.ErrDeadlineExceeded) || errors.Is(e.Err, context.DeadlineExceeded),
		"the Complete timed out: %v", e.Err)
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.NoError(t, paused, "Redis answers once the pause ends")

	// The retry either replays the response or finds the key in progress
	// (the Complete never landed); it never runs the handler again.
	retry := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("b"))
	retry.Header.Set(idemserver.DefaultKeyHeader, "k")
	w = httptest.NewRecorder()
	mw.ServeHTTP(w, retry)
	if w.Code == http.StatusCreated {
		assert.Equal(t, "run 1", w.Body.String())
	} else {
		assert.Equal(t, http.StatusConflict, w.Code)
	}
	assert.EqualValues(t, 1, runs.Load())
}

// TestStoreTimeoutFiresMidCall runs concurrent duplicates with store
// timeouts short enough to end claims and completions while they are out,
// over a client that honours them, and whose every other script's reply
// is lost to the deadline after Redis ran it: no key's handler runs twice, and a
// retry under a healthy timeout gets the answer the first client got, or
// finds the key in progress (a claim or completion that landed after its
// call timed out), never a second run.
func TestStoreTimeoutFiresMidCall(t *testing.T) {
	addr := redisAddr(t)
	for _, timeout := range []time.Duration{time.Millisecond, 20 * time.Millisecond, 100 * time.Millisecond} {
		t.Run(timeout.String(), func(t *testing.T) {
			client := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, PoolSize: 8})
			lost := &lostReplies{}
			lost.on.Store(true)
			client.AddHook(lost)
			t.Cleanup(func() { _ = client.Close() })
			store := redisstore.New(client, redisstore.WithPrefix(newPrefix(t, client)), redisstore.WithEvictionAllowed())
			var runs sync.Map
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n, _ := runs.LoadOrStore(r.Header.Get(idemserver.DefaultKeyHeader), new(atomic.Int64))
				created(n.(*atomic.Int64).Add(1), w)
			})
			send := func(h http.Handler, key string) (int, string) {
				req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("b"))
				req.Header.Set(idemserver.DefaultKeyHeader, key)
				w := httptest.NewRecorder()
				h.ServeHTTP(w, req)
				return w.Code, w.Body.String()
			}
			var failed, executed atomic.Int64
			short := idemserver.Middleware(store, idemserver.WithStoreTimeout(timeout),
				idemserver.WithObserver(func(e idemserver.Event) {
					if e.Outcome == idemserver.OutcomeExecuted {
						executed.Add(1)
					}
					if e.Err != nil {
						failed.Add(1)
					}
				}))(h)
			const keys = 40
			var mu sync.Mutex
			first := map[string][]string{}
			var wg sync.WaitGroup
			for i := range keys {
				key := "k" + strconv.Itoa(i)
				for range 3 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if status, body := send(short, key); status == http.StatusCreated {
							mu.Lock()
							first[key] = append(first[key], body)
							mu.Unlock()
						}
					}()
				}
			}
			wg.Wait()
			t.Logf("executed %d, store calls failed %d", executed.Load(), failed.Load())
			lost.on.Store(false)
			healthy := idemserver.Middleware(store)(h)
			for i := range keys {
				key := "k" + strconv.Itoa(i)
				status, body := send(healthy, key)
				if status == http.StatusConflict {
					continue // in progress until its lease ends
				}
				require.Equal(t, http.StatusCreated, status, "%s: %s", key, body)
				for _, b := range first[key] {
					assert.Equal(t, b, body, "%s: the retry gets the first answer", key)
				}
			}
			runs.Range(func(k, n any) bool {
				assert.EqualValues(t, 1, n.(*atomic.Int64).Load(), "%v: the handler ran once", k)
				return true
			})
		})
	}
}

// lostReplies, while on, loses every other script's reply after Redis ran
// it: the call returns only when its context ends, as one whose reply the
// connection delayed past the deadline.
type lostReplies struct {
	on atomic.Bool
	n  atomic.Int64
}

func (l *lostReplies) DialHook(next redis.DialHook) redis.DialHook { return next }

func (l *lostReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if l.on.Load() && (cmd.Name() == "evalsha" || cmd.Name() == "eval") && l.n.Add(1)%2 == 0 {
			<-ctx.Done()
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		}
		return err
	}
}

func (l *lostReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
