package idemserver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// ledger is the payment handler's own record of the charges it executed.
type ledger struct {
	mu      sync.Mutex
	charges map[string]int
}

func (l *ledger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var p struct{ Order string }
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	l.mu.Lock()
	l.charges[p.Order]++
	n := l.charges[p.Order]
	l.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%q,"charge":%d}`, p.Order, n)
}

// A fault does something bad to a request instead of serving it plainly.
type fault func(w http.ResponseWriter, r *http.Request, next http.Handler)

// loseResponse lets the request be served, so the handler acts, and then
// destroys the response: the client sees its connection close.
func loseResponse(w http.ResponseWriter, r *http.Request, next http.Handler) {
	next.ServeHTTP(httptest.NewRecorder(), r)
	hangUp(w, false)
}

// resetConnection resets the connection before the request is served.
func resetConnection(w http.ResponseWriter, r *http.Request, next http.Handler) {
	hangUp(w, true)
}

// unavailable answers 503 before the request is served.
func unavailable(w http.ResponseWriter, r *http.Request, next http.Handler) {
	http.Error(w, "overloaded", http.StatusServiceUnavailable)
}

func hangUp(w http.ResponseWriter, reset bool) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	if tcp, ok := conn.(*net.TCPConn); ok && reset {
		_ = tcp.SetLinger(0) // close with RST
	}
	_ = conn.Close()
}

// injector applies a fault, drawn by pick, to the first faulty requests of
// every key, and serves the rest plainly.
type injector struct {
	next   http.Handler
	faulty int
	pick   func() fault

	mu       sync.Mutex
	attempts map[string]int
}

func (in *injector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemserver.DefaultKeyHeader)
	in.mu.Lock()
	in.attempts[key]++
	n := in.attempts[key]
	f := in.pick()
	in.mu.Unlock()
	if n <= in.faulty {
		f(w, r, in.next)
		return
	}
	in.next.ServeHTTP(w, r)
}

func TestEndToEndEffectsHappenOnce(t *testing.T) {
	always := func(f fault) func() fault { return func() fault { return f } }
	rng := rand.New(rand.NewPCG(1, 2))
	mixed := func() fault { return []fault{loseResponse, resetConnection, unavailable}[rng.IntN(3)] }
	for _, tt := range []struct {
		name   string
		faulty int
		pick   func() fault
	}{
		{"response destroyed after the handler ran", 1, always(loseResponse)},
		{"response destroyed twice", 2, always(loseResponse)},
		{"connection reset before the handler", 2, always(resetConnection)},
		{"503 before the handler", 2, always(unavailable)},
		{"all of them, mixed", 3, mixed},
	} {
		t.Run(tt.name, func(t *testing.T) {
			const operations = 20
			charges := &ledger{charges: map[string]int{}}
			in := &injector{
				next:     idemserver.Middleware(idemserver.NewMemoryStore(), idemserver.RequireKey())(charges),
				faulty:   tt.faulty,
				pick:     tt.pick,
				attempts: map[string]int{},
			}
			srv := httptest.NewServer(in)
			defer srv.Close()
			// Every first attempt fails, a rate at which the retry budget
			// and the breaker would rightly stop retrying; they are off so
			// that every operation runs to its end.
			client := idemhttp.NewClient(
				idemhttp.WithMaxAttempts(tt.faulty+2),
				idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 5*time.Millisecond)),
				idemhttp.WithBudget(nil),
				idemhttp.WithoutBreaker(),
			)
			defer client.CloseIdleConnections()

			type reply struct {
				status int
				body   string
				err    error
			}
			replies := make([]reply, operations)
			var wg sync.WaitGroup
			for i := range operations {
				wg.Go(func() {
					order := fmt.Sprintf("order-%02d", i)
					ctx := idemhttp.WithOperation(t.Context(), order)
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/charges",
						strings.NewReader(fmt.Sprintf(`{"order":%q,"amount":100}`, order)))
					if err != nil {
						replies[i].err = err
						return
					}
					resp, err := client.Do(req)
					if err != nil {
						replies[i].err = err
						return
					}
					defer resp.Body.Close()
					b, err := io.ReadAll(resp.Body)
					replies[i] = reply{status: resp.StatusCode, body: string(b), err: err}
				})
			}
			wg.Wait()

			for i, r := range replies {
				order := fmt.Sprintf("order-%02d", i)
				require.NoError(t, r.err, order)
				assert.Equal(t, http.StatusCreated, r.status, order)
				assert.JSONEq(t, fmt.Sprintf(`{"order":%q,"charge":1}`, order), r.body, "the first charge's response")
			}
			charges.mu.Lock()
			defer charges.mu.Unlock()
			assert.Len(t, charges.charges, operations)
			for order, n := range charges.charges {
				assert.Equal(t, 1, n, "%s charged %d times", order, n)
			}
			in.mu.Lock()
			defer in.mu.Unlock()
			for key, n := range in.attempts {
				assert.Greater(t, n, tt.faulty, "key %s met every fault", key)
			}
		})
	}
}

// TestEndToEndConcurrentRetries sends each operation's retries while its
// first request is still running: a slow handler and a short attempt
// timeout make the client retry into the in-progress key, which answers
// 409 with Retry-After until the first request completes.
func TestEndToEndConcurrentRetries(t *testing.T) {
	release := make(chan struct{})
	charges := &ledger{charges: map[string]int{}}
	var calls sync.WaitGroup
	calls.Add(1)
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer calls.Done()
		<-release
		charges.ServeHTTP(w, r)
	})
	var conflicts int
	var mu sync.Mutex
	mw := idemserver.Middleware(nil, idemserver.WithObserver(func(e idemserver.Event) {
		if e.Outcome == idemserver.OutcomeInProgress {
			mu.Lock()
			conflicts++
			if conflicts == 1 {
				close(release) // the retry met the first request in flight
			}
			mu.Unlock()
		}
	}))(slow)
	srv := httptest.NewServer(mw)
	defer srv.Close()
	client := idemhttp.NewClient(
		idemhttp.WithMaxAttempts(4),
		idemhttp.WithAttemptTimeout(50*time.Millisecond),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 5*time.Millisecond)),
		idemhttp.WithMaxRetryAfter(time.Second),
	)
	defer client.CloseIdleConnections()

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(idemhttp.WithOperation(ctx, "order-1"), http.MethodPost,
		srv.URL+"/charges", strings.NewReader(`{"order":"order-1"}`))
	require.NoError(t, err)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	calls.Wait()

	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get(idemserver.ReplayedHeader), "the retry got the first outcome")
	assert.JSONEq(t, `{"order":"order-1","charge":1}`, string(body))
	assert.Equal(t, map[string]int{"order-1": 1}, charges.charges)
	assert.GreaterOrEqual(t, conflicts, 1)
}
