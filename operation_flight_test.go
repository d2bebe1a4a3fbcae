package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// faultHeader names the fault the test's base transport injects into a
// request's response.
const faultHeader = "X-Test-Fault"

// lostBody is a response body whose connection was cut before any of it
// arrived.
type lostBody struct{ io.ReadCloser }

func (lostBody) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

// losingMarked returns a base transport that sends each request through
// real, and loses the response of one marked with faultHeader: the
// request reached the server, and its caller gets an error.
func losingMarked(real http.RoundTripper) roundTripFunc {
	return func(r *http.Request) (*http.Response, error) {
		resp, err := real.RoundTrip(r)
		if err == nil && r.Header.Get(faultHeader) != "" {
			discard(resp)
			return nil, io.ErrUnexpectedEOF
		}
		return resp, err
	}
}

// chargeServer is an httptest server that runs a charge behind
// idemserver's middleware, and counts how often the charge ran and which
// keys reached the middleware.
type chargeServer struct {
	*httptest.Server
	executions atomic.Int32
	keys       recorder[string]
}

func newChargeServer(t *testing.T) *chargeServer {
	t.Helper()
	s := &chargeServer{}
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.executions.Add(1)
		io.WriteString(w, "paid")
	})
	mw := idemserver.Middleware(idemserver.NewMemoryStore())(charge)
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.keys.add(r.Header.Get(DefaultKeyHeader))
		mw.ServeHTTP(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// Two calls of one operation overlap: the first sent the operation's key
// and its outcome is not final yet (its response body is being read, or
// its attempts are still running). A second call with the operation's id,
// through the same Transport or another over the same KeyStore, must not
// send the key meanwhile: its final outcome would release the key, and
// the first call's caller, whose outcome turns out not final (the body
// cut, the response lost), would call again under a new key and be
// charged twice. The second call fails fast, and the first call's retry
// sends the pending key and gets the server's replay.
func TestOverlappingCallsOfOneOperationChargeOnce(t *testing.T) {
	faults := []struct {
		name string
		// first makes the first call, which must leave the operation's key
		// pending; during calls the second call while the first is in
		// flight.
		first func(t *testing.T, tr http.RoundTripper, req *http.Request, during func()) error
		fault string
	}{
		{"body cut", func(t *testing.T, tr http.RoundTripper, req *http.Request, during func()) error {
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			during()
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			return err
		}, "cut"},
		{"response lost, attempts exhausted", func(t *testing.T, tr http.RoundTripper, req *http.Request, during func()) error {
			var err error
			done := make(chan struct{})
			go func() {
				defer close(done)
				var resp *http.Response
				resp, err = tr.RoundTrip(req)
				if err == nil {
					resp.Body.Close()
				}
			}()
			during()
			<-done
			return err
		}, "lose"},
	}
	for _, shared := range []bool{false, true} {
		for _, f := range faults {
			name := f.name + "/one Transport"
			if shared {
				name = f.name + "/two Transports, one KeyStore"
			}
			t.Run(name, func(t *testing.T) {
				srv := newChargeServer(t)
				store := NewMemoryKeyStore()
				sent := make(chan struct{}, 1) // a "lose" request reached the server
				proceed := make(chan struct{}) // the second call has ended
				real := newBaseTransport(t)
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
					resp, err := real.RoundTrip(r)
					switch {
					case err != nil:
						return nil, err
					case r.Header.Get(faultHeader) == "cut":
						resp.Body = lostBody{resp.Body}
					case r.Header.Get(faultHeader) == "lose":
						// The charge ran and its outcome is stored; the
						// response is lost on the way back.
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						sent <- struct{}{}
						<-proceed
						return nil, io.ErrUnexpectedEOF
					}
					return resp, nil
				})
				opts := []Option{WithKeyStore(store), WithMaxAttempts(1), WithBudget(nil), WithoutBreaker()}
				first := NewTransport(base, opts...)
				second := first
				if shared {
					second = NewTransport(base, opts...)
				}
				ctx := WithOperation(context.Background(), "payment-1")

				var secondErr error
				secondCall := func() {
					if f.fault == "lose" {
						<-sent
					}
					defer close(proceed)
					var resp *http.Response
					resp, secondErr = second.RoundTrip(post(t, ctx, srv.URL, "charge"))
					if secondErr == nil {
						_, _ = io.ReadAll(resp.Body)
						resp.Body.Close()
					}
				}
				req := post(t, ctx, srv.URL, "charge")
				req.Header.Set(faultHeader, f.fault)
				require.Error(t, f.first(t, first, req, secondCall), "the first call's outcome is not final")

				// The first call's caller calls again with the same id.
				resp, err := first.RoundTrip(post(t, ctx, srv.URL, "charge"))
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				resp.Body.Close()

				assert.Equal(t, int32(1), srv.executions.Load(), "the operation was charged once")
				assert.Equal(t, "paid", string(body))
				assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"), "the retry gets the replay")
				require.ErrorIs(t, secondErr, ErrOperationInFlight, "the overlapping call is refused")
				assert.Contains(t, secondErr.Error(), `"payment-1"`, "the error names the operation")
				keys := srv.keys.all()
				require.Len(t, keys, 2, "the refused call sent nothing")
				assert.Equal(t, keys[0], keys[1], "the retry sends the pending key")
				assert.Empty(t, pendingKeys(t, store), "released with the retry's final outcome")
			})
		}
	}
}

// blockingBody is a response body whose Read waits for ctx to end and
// fails with its error, as a body stalled until the attempt timeout does.
type blockingBody struct{ ctx context.Context }

func (b blockingBody) Read([]byte) (int, error) { <-b.ctx.Done(); return 0, b.ctx.Err() }
func (blockingBody) Close() error               { return nil }

// An operation's flight ends on every path out of a call, so that a
// later call of the operation is never refused for one that has ended;
// and it lasts while the call may still release the key: until the
// body of a final response has been read to its end, failed or closed.
func TestOperationFlightEndsOnEveryPath(t *testing.T) {
	body := func(s string) io.ReadCloser { return io.NopCloser(strings.NewReader(s)) }
	respond := func(code int, b io.ReadCloser) roundTripFunc {
		return func(r *http.Request) (*http.Response, error) {
			resp := okResponse(r, code)
			resp.Body = b
			return resp, nil
		}
	}
	tests := []struct {
		name string
		base roundTripFunc
		opts []Option
		// call makes the call; inFlight reports, while the outcome is not
		// settled, whether the operation is in flight.
		call        func(t *testing.T, tr *Transport, inFlight func() bool)
		wantPending bool
	}{
		{"final response, body read to its end", respond(200, body("paid")), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.True(t, inFlight(), "in flight until the body is read")
				_, err = io.ReadAll(resp.Body)
				require.NoError(t, err)
				assert.False(t, inFlight(), "ended by the read that reached the end, before Close")
				resp.Body.Close()
			}, false},
		{"final response, body closed unread", respond(200, body("paid")), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.True(t, inFlight())
				resp.Body.Close()
			}, false},
		{"final response, body cut", respond(200, lostBody{body("")}), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.True(t, inFlight())
				_, err = io.ReadAll(resp.Body)
				require.ErrorIs(t, err, io.ErrUnexpectedEOF)
				assert.False(t, inFlight(), "ended by the failed read, before Close")
				resp.Body.Close()
			}, true},
		{"final response, body never closed after a failed read", respond(200, lostBody{body("")}), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				_, err = resp.Body.Read(make([]byte, 1))
				require.Error(t, err)
			}, true},
		{"final response without a body", respond(204, http.NoBody), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.False(t, inFlight(), "a response without a body is whole when returned")
				resp.Body.Close()
			}, false},
		{"response that is not final", respond(503, body("down")), []Option{WithMaxAttempts(1)},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.False(t, inFlight(), "a call that cannot release the key ends its flight when it returns")
				resp.Body.Close()
			}, true},
		{"attempts exhausted", func(*http.Request) (*http.Response, error) { return nil, io.ErrUnexpectedEOF },
			[]Option{WithMaxAttempts(2)},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				_, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.ErrorIs(t, err, ErrAttemptsExhausted)
			}, true},
		{"context canceled before the key is recorded", respond(200, body("paid")), nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				ctx, cancel := context.WithCancel(opCtx())
				cancel()
				_, err := tr.RoundTrip(post(t, ctx, "http://x.test", "charge"))
				require.ErrorIs(t, err, context.Canceled)
			}, false},
		{"context canceled while sending", func(r *http.Request) (*http.Response, error) {
			r.Context().Value(cancelKey{}).(context.CancelFunc)()
			return nil, r.Context().Err()
		}, nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				ctx, cancel := context.WithCancel(opCtx())
				ctx = context.WithValue(ctx, cancelKey{}, cancel)
				_, err := tr.RoundTrip(post(t, ctx, "http://x.test", "charge"))
				require.ErrorIs(t, err, context.Canceled)
			}, true},
		{"KeyStore fails", respond(200, body("paid")), []Option{WithKeyStore(&failingStore{err: errors.New("disk full")})},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				_, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.ErrorIs(t, err, ErrKeyStore)
			}, false},
		{"KeyStore panics", respond(200, body("paid")), []Option{WithKeyStore(&panickingStore{})},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				assert.Panics(t, func() { _, _ = tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge")) })
			}, false},
		{"KeyStore's Release panics in the read that reaches the end", respond(200, body("paid")),
			[]Option{WithKeyStore(releasePanicStore{NewMemoryKeyStore()})},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.True(t, inFlight())
				assert.Panics(t, func() { _, _ = io.ReadAll(resp.Body) })
			}, true},
		{"KeyStore's Release panics in Close", respond(200, body("paid")),
			[]Option{WithKeyStore(releasePanicStore{NewMemoryKeyStore()})},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.Panics(t, func() { resp.Body.Close() })
			}, true},
		{"base transport panics", func(*http.Request) (*http.Response, error) { panic("boom") }, nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				assert.Panics(t, func() { _, _ = tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge")) })
			}, true},
		{"attempt timeout ends the body's read", func(r *http.Request) (*http.Response, error) {
			resp := okResponse(r, 200)
			resp.Body = blockingBody{r.Context()}
			return resp, nil
		}, []Option{WithAttemptTimeout(time.Second)},
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				assert.True(t, inFlight())
				_, err = io.ReadAll(resp.Body)
				require.ErrorIs(t, err, context.DeadlineExceeded)
				assert.False(t, inFlight())
				resp.Body.Close()
			}, true},
		{"http.Client's Timeout ends the body's read", func(r *http.Request) (*http.Response, error) {
			resp := okResponse(r, 200)
			resp.Body = blockingBody{r.Context()}
			return resp, nil
		}, nil,
			func(t *testing.T, tr *Transport, inFlight func() bool) {
				client := &http.Client{Transport: tr, Timeout: time.Second}
				resp, err := client.Do(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				time.Sleep(2 * time.Second)
				synctest.Wait()
				assert.True(t, inFlight(), "a body neither read nor closed holds the flight, timed out or not")
				_, err = io.ReadAll(resp.Body)
				require.Error(t, err)
				assert.False(t, inFlight(), "ended by the read the timeout failed")
				resp.Body.Close()
			}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := NewMemoryKeyStore()
				opts := append([]Option{WithKeyStore(store), WithBackoff(noWait)}, tt.opts...)
				tr := NewTransport(tt.base, opts...)
				inFlight := func() bool { return tr.flights.inFlight("op") }

				tt.call(t, tr, inFlight)

				assert.False(t, inFlight(), "the flight ended")
				if tr.cfg.keyStore != store {
					return
				}
				pending := pendingKeys(t, store)
				assert.Equal(t, tt.wantPending, len(pending) == 1, "key pending: %v", pending)
				// The next call of the operation, through another Transport
				// over the store, is sent, with the pending key if any.
				var sent string
				again := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
					sent = r.Header.Get(DefaultKeyHeader)
					return okResponse(r, 200), nil
				}), WithKeyStore(store))
				resp, err := again.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				require.NoError(t, err)
				resp.Body.Close()
				if tt.wantPending {
					assert.Equal(t, pending["op"], sent)
				}
				assert.Empty(t, pendingKeys(t, store))
			})
		})
	}
}

// releasePanicStore is a MemoryKeyStore whose Release panics.
type releasePanicStore struct{ *MemoryKeyStore }

func (releasePanicStore) Release(context.Context, string, string) error { panic("boom") }

// cancelKey is the context key of a CancelFunc a fake base transport calls.
type cancelKey struct{}

// opCtx is a context naming the operation "op".
func opCtx() context.Context { return WithOperation(context.Background(), "op") }

// A request that http.Client sends to follow a redirect of an operation is
// the same call: it is sent although it names the operation, and once its
// outcome is final the key is released and the flight has ended.
func TestFollowedRedirectOfAnOperationIsNotRefused(t *testing.T) {
	for _, code := range []int{http.StatusTemporaryRedirect, http.StatusSeeOther} {
		t.Run(http.StatusText(code), func(t *testing.T) {
			var keys recorder[string]
			var inFlightDuringFollow atomic.Bool
			store := NewMemoryKeyStore()
			tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
				keys.add(r.Header.Get(DefaultKeyHeader))
				if r.URL.Path == "/charge" {
					return okResponse(r, code, "Location", "/charged"), nil
				}
				inFlightDuringFollow.Store(store.flights.inFlight("op"))
				resp := okResponse(r, 200)
				resp.Body = io.NopCloser(strings.NewReader("paid"))
				return resp, nil
			}), WithKeyStore(store))
			client := &http.Client{Transport: tr}

			resp, err := client.Do(post(t, opCtx(), "http://x.test/charge", "charge"))
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()

			assert.Equal(t, "paid", string(body))
			assert.True(t, inFlightDuringFollow.Load(), "the request that follows holds the flight")
			assert.False(t, store.flights.inFlight("op"))
			assert.Empty(t, pendingKeys(t, store))
			sent := keys.all()
			require.Len(t, sent, 2)
			if code == http.StatusTemporaryRedirect {
				assert.Equal(t, sent[0], sent[1], "a 307 is followed with the same key")
			}
		})
	}
}

// sharedKeyStore is a MemoryKeyStore that notes, on each release of a
// key, how many calls have sent the key and not yet settled their
// outcome: a call settles when its body's read fails or reaches the end,
// just before the Transport may release the key.
type sharedKeyStore struct {
	*MemoryKeyStore
	mu      sync.Mutex
	holders map[string]int // key -> calls that sent it and have not settled
	worst   int
}

// settlingBody calls settle once, when a read fails or reaches the end.
type settlingBody struct {
	io.ReadCloser
	settle func()
	once   sync.Once
}

func (b *settlingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.once.Do(b.settle)
	}
	return n, err
}

func (s *sharedKeyStore) hold(key string, d int) {
	s.mu.Lock()
	s.holders[key] += d
	s.mu.Unlock()
}

func (s *sharedKeyStore) Release(ctx context.Context, op, key string) error {
	s.mu.Lock()
	s.worst = max(s.worst, s.holders[key])
	s.mu.Unlock()
	return s.MemoryKeyStore.Release(ctx, op, key)
}

// Many calls of one operation through two Transports over one KeyStore,
// some of whose response bodies are cut: whenever a key is released, the
// releasing call is the only one that sent it and has not yet settled its
// outcome, so no caller left with a cut body finds its key released by
// another call; calls refused as in flight send nothing.
func TestConcurrentCallsOfOneOperationNeverShareAKeyInFlight(t *testing.T) {
	store := &sharedKeyStore{MemoryKeyStore: NewMemoryKeyStore(), holders: map[string]int{}}
	var sends atomic.Int32
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		key := r.Header.Get(DefaultKeyHeader)
		store.hold(key, 1)
		resp := okResponse(r, 200)
		resp.Body = io.NopCloser(strings.NewReader("paid"))
		if sends.Add(1)%3 == 0 {
			resp.Body = lostBody{resp.Body}
		}
		resp.Body = &settlingBody{ReadCloser: resp.Body, settle: func() { store.hold(key, -1) }}
		return resp, nil
	})
	trs := []*Transport{
		NewTransport(base, WithKeyStore(store), WithBudget(nil), WithoutBreaker()),
		NewTransport(base, WithKeyStore(store), WithBudget(nil), WithoutBreaker()),
	}
	var refused atomic.Int32
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for range 20 {
				resp, err := trs[g%2].RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
				if errors.Is(err, ErrOperationInFlight) {
					refused.Add(1)
					continue
				}
				if !assert.NoError(t, err) {
					return
				}
				_, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	assert.Zero(t, store.worst, "a key was released while another call that sent it was unsettled")
	assert.Equal(t, int32(8*20), sends.Load()+refused.Load(), "a refused call sent nothing")
	assert.False(t, store.flights.inFlight("op"))
}

// A call refused because its operation is in flight is reported like any
// attempt refused before it was sent: once to the hook, with Sent false,
// and to the logger at Warn, as a give-up.
func TestOperationInFlightRefusalIsReported(t *testing.T) {
	var attempts recorder[Attempt]
	h := &recordHandler{}
	store := NewMemoryKeyStore()
	tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp := okResponse(r, 200)
		resp.Body = io.NopCloser(strings.NewReader("paid"))
		return resp, nil
	}), WithKeyStore(store), WithAttemptHook(func(a Attempt) { attempts.add(a) }), WithLogger(slog.New(h)))

	first, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.NoError(t, err)
	defer first.Body.Close()
	_, err = tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.ErrorIs(t, err, ErrOperationInFlight)
	assert.Contains(t, err.Error(), `"op": another call is sending it, or holds its final response with the body not yet read or closed`,
		"the error says what may hold the operation")

	all := attempts.all()
	require.Len(t, all, 2, "the first call's attempt and the refusal")
	a := all[1]
	assert.Equal(t, ReasonOperationInFlight, a.Reason)
	assert.False(t, a.Sent)
	assert.Equal(t, 1, a.Number)
	assert.Equal(t, "op", a.Operation)
	assert.Empty(t, a.Key, "no key was taken")
	assert.ErrorIs(t, a.Err, ErrOperationInFlight)

	h.mu.Lock()
	defer h.mu.Unlock()
	require.Len(t, h.records, 1, "the first call's success is not logged")
	r := h.records[0]
	assert.Equal(t, slog.LevelWarn, r.Level)
	assert.Equal(t, "idemhttp: giving up", r.Message)
	assert.Equal(t, string(ReasonOperationInFlight), attrs(r)["reason"])
	assert.Equal(t, "op", attrs(r)["operation"])
}

// Between the redirect RoundTrip returns and the request http.Client
// sends to follow it, the operation is not in flight, so another call of
// it may run whole in that gap. Its outcome need not be final (here its
// response is lost, so it leaves the key pending for its caller to call
// again). The redirected call's outcome then must not release the key:
// the other caller would call again under a new key, and the server would
// charge twice.
func TestCallInARedirectsGapKeepsItsKeyPending(t *testing.T) {
	for _, code := range []int{http.StatusSeeOther, http.StatusTemporaryRedirect} {
		t.Run(http.StatusText(code), func(t *testing.T) {
			var executions atomic.Int32
			charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				w.Header().Set("Location", "/receipt")
				w.WriteHeader(code)
			})
			mw := idemserver.Middleware(idemserver.NewMemoryStore())(charge)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/receipt" {
					io.WriteString(w, "paid")
					return
				}
				mw.ServeHTTP(w, r)
			}))
			defer srv.Close()
			// A request marked with faultHeader reaches the server, and its
			// response is lost.
			base := losingMarked(srv.Client().Transport)
			store := NewMemoryKeyStore()
			tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))
			defer tr.CloseIdleConnections()

			var otherErr error
			first := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
				if otherErr != nil {
					return nil
				}
				// Another part of the program calls the operation now.
				req := post(t, opCtx(), srv.URL+"/charge", "charge")
				req.Header.Set(faultHeader, "lost")
				_, otherErr = (&http.Client{Transport: tr}).Do(req)
				return nil
			}}
			resp, err := first.Do(post(t, opCtx(), srv.URL+"/charge", "charge"))
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, "paid", string(body))

			require.ErrorIs(t, otherErr, io.ErrUnexpectedEOF, "the other call's response was lost")
			assert.NotEmpty(t, pendingKeys(t, store), "the other call's caller has no final outcome: the key stays pending")

			// So that caller calls again, and gets the first outcome.
			resp, err = (&http.Client{Transport: tr}).Do(post(t, opCtx(), srv.URL+"/charge", "charge"))
			require.NoError(t, err)
			body, err = io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, "paid", string(body))
			assert.EqualValues(t, 1, executions.Load(), "the charge ran once")
			assert.Empty(t, pendingKeys(t, store))
		})
	}
}

// A redirect that http.Client does not follow leaves its operation free:
// the next call is sent with the pending key, and the request that
// follows its redirect releases the key.
func TestUnfollowedRedirectLeavesTheOperationFree(t *testing.T) {
	var keys recorder[string]
	store := NewMemoryKeyStore()
	tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
		keys.add(r.Header.Get(DefaultKeyHeader))
		if r.URL.Path == "/charge" {
			return okResponse(r, http.StatusSeeOther, "Location", "/receipt"), nil
		}
		return okResponse(r, 200), nil
	}), WithKeyStore(store))

	stop := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	resp, err := stop.Do(post(t, opCtx(), "http://x.test/charge", "charge"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusSeeOther, resp.StatusCode)
	assert.False(t, store.flights.inFlight("op"))
	require.Len(t, pendingKeys(t, store), 1, "a redirect not followed leaves the key pending")

	resp, err = (&http.Client{Transport: tr}).Do(post(t, opCtx(), "http://x.test/charge", "charge"))
	require.NoError(t, err, "the next call is not refused")
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	sent := keys.all()
	require.Len(t, sent, 3)
	assert.Equal(t, sent[0], sent[1], "the next call sends the pending key")
	assert.Empty(t, pendingKeys(t, store), "the request that follows releases it")
	assert.False(t, store.flights.inFlight("op"))
}

// A FileKeyStore closed while a call of an operation holds its final
// response, and opened again in the process: the new store has no marks,
// so the next call is sent, with the pending key; the old call's body,
// read or closed later, cannot release the key through the closed store,
// so the key stays pending until a call through the new store settles it.
func TestFileKeyStoreReopenedWhileAnOperationIsInFlight(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys")
	var keys recorder[string]
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		keys.add(r.Header.Get(DefaultKeyHeader))
		resp := okResponse(r, 200)
		resp.Body = io.NopCloser(strings.NewReader("paid"))
		return resp, nil
	})
	old, err := OpenFileKeyStore(path)
	require.NoError(t, err)
	held, err := NewTransport(base, WithKeyStore(old)).RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.NoError(t, err)
	require.True(t, old.flights.inFlight("op"))
	require.NoError(t, old.Close())

	reopened := openTestStore(t, path)
	assert.False(t, reopened.flights.inFlight("op"), "the marks are the store object's")
	_, err = io.ReadAll(held.Body)
	require.NoError(t, err)
	held.Body.Close()
	assert.False(t, old.flights.inFlight("op"), "the old body ended its flight")
	assert.Len(t, pendingKeys(t, reopened), 1, "the closed store released nothing")

	resp, err := NewTransport(base, WithKeyStore(reopened)).RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	sent := keys.all()
	require.Len(t, sent, 2)
	assert.Equal(t, sent[0], sent[1], "the next call sends the pending key")
	assert.Empty(t, pendingKeys(t, reopened))
}

// A final response abandoned when its call's context ends (a caller that
// gave up waiting and calls again from elsewhere) holds the operation
// until its body is closed: the next call is refused with an error that
// says so, and is sent once the body is closed.
func TestAbandonedResponseHoldsItsOperationUntilClosed(t *testing.T) {
	store := NewMemoryKeyStore()
	tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp := okResponse(r, 200)
		resp.Body = io.NopCloser(strings.NewReader("paid"))
		return resp, nil
	}), WithKeyStore(store))

	ctx, cancel := context.WithCancel(opCtx())
	abandoned, err := tr.RoundTrip(post(t, ctx, "http://x.test", "charge"))
	require.NoError(t, err)
	cancel()

	_, err = tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.ErrorIs(t, err, ErrOperationInFlight)
	assert.Contains(t, err.Error(), "not yet read or closed")
	assert.Len(t, pendingKeys(t, store), 1, "the key stays pending")

	abandoned.Body.Close()
	resp, err := tr.RoundTrip(post(t, opCtx(), "http://x.test", "charge"))
	require.NoError(t, err, "sent once the abandoned body is closed")
	resp.Body.Close()
}

// marks counts the operations f keeps a mark of, in flight or handed on
// to a redirect's follow-up.
func (f *flights) marks() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.ops)
}

// A redirect of an operation that is not followed leaves its mark for the
// request that would follow it; a caller that acts on the redirect itself
// and releases the key with the KeyStore's Release drops the mark too, so
// that such operations leave nothing behind.
func TestReleasingAnUnfollowedRedirectsKeyDropsItsMark(t *testing.T) {
	for _, newStore := range []func(t *testing.T) KeyStore{
		func(*testing.T) KeyStore { return NewMemoryKeyStore() },
		func(t *testing.T) KeyStore { return openTestStore(t, filepath.Join(t.TempDir(), "keys")) },
	} {
		store := newStore(t)
		flights := store.(flightsHolder).operationFlights()
		tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
			return okResponse(r, http.StatusSeeOther, "Location", "/receipt"), nil
		}), WithKeyStore(store))
		client := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		}}
		for i := range 3 {
			op := fmt.Sprintf("op-%d", i)
			resp, err := client.Do(post(t, WithOperation(context.Background(), op), "http://x.test/charge", "charge"))
			require.NoError(t, err)
			resp.Body.Close()
			pending := pendingKeys(t, store)
			require.Contains(t, pending, op)
			require.NoError(t, store.Release(context.Background(), op, pending[op]))
		}
		assert.Zero(t, flights.marks(), "%T: no mark outlives its released key", store)
	}
}
