package idemhttp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func post(t *testing.T, ctx context.Context, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	return req
}

func do(t *testing.T, rt http.RoundTripper, req *http.Request) *http.Response {
	t.Helper()
	resp, err := rt.RoundTrip(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())
	return resp
}

func TestEveryAttemptOfOneRequestCarriesTheSameKey(t *testing.T) {
	srv := newServer(t, status(503), status(502), status(200))
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait))

	resp := do(t, tr, post(t, context.Background(), srv.URL, "charge"))

	assert.Equal(t, 200, resp.StatusCode)
	keys := srv.keys()
	require.Len(t, keys, 3)
	assert.NotEmpty(t, keys[0])
	assert.Equal(t, []string{keys[0], keys[0], keys[0]}, keys)
}

func TestKeyAssignment(t *testing.T) {
	tests := []struct {
		name     string
		method   string
		opts     []Option
		header   [2]string // a header the caller sets
		wantName string    // header the key travels in
		check    func(t *testing.T, got string)
	}{
		{name: "POST gets a UUIDv7", method: "POST", wantName: "Idempotency-Key", check: isUUIDv7},
		{name: "PATCH gets a key", method: "PATCH", wantName: "Idempotency-Key", check: isUUIDv7},
		{name: "GET gets none", method: "GET", wantName: "Idempotency-Key", check: isEmpty},
		{name: "PUT gets none", method: "PUT", wantName: "Idempotency-Key", check: isEmpty},
		{name: "caller's key kept", method: "POST", header: [2]string{"Idempotency-Key", "order-77"},
			wantName: "Idempotency-Key", check: equals("order-77")},
		{name: "caller's key on GET kept", method: "GET", header: [2]string{"Idempotency-Key", "g-1"},
			wantName: "Idempotency-Key", check: equals("g-1")},
		{name: "header name option", method: "POST", opts: []Option{WithKeyHeader("x-request-key")},
			wantName: "X-Request-Key", check: isUUIDv7},
		{name: "header name option leaves default unset", method: "POST", opts: []Option{WithKeyHeader("X-Request-Key")},
			wantName: "Idempotency-Key", check: isEmpty},
		{name: "caller's key under custom name kept", method: "POST", opts: []Option{WithKeyHeader("X-Request-Key")},
			header: [2]string{"X-Request-Key", "mine"}, wantName: "X-Request-Key", check: equals("mine")},
		{name: "structured key", method: "POST", opts: []Option{WithStructuredKey()},
			wantName: "Idempotency-Key", check: isQuotedUUIDv7},
		{name: "structured key leaves caller's alone", method: "POST", opts: []Option{WithStructuredKey()},
			header: [2]string{"Idempotency-Key", "plain"}, wantName: "Idempotency-Key", check: equals("plain")},
		{name: "keyed methods option", method: "PUT", opts: []Option{WithKeyedMethods("PUT")},
			wantName: "Idempotency-Key", check: isUUIDv7},
		{name: "keyed methods option drops POST", method: "POST", opts: []Option{WithKeyedMethods("PUT")},
			wantName: "Idempotency-Key", check: isEmpty},
		{name: "key generator option", method: "POST",
			opts:     []Option{WithKeyGenerator(func() (string, error) { return "generated", nil })},
			wantName: "Idempotency-Key", check: equals("generated")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, status(200))
			req, err := http.NewRequest(tt.method, srv.URL, strings.NewReader("x"))
			require.NoError(t, err)
			if tt.header[0] != "" {
				req.Header.Set(tt.header[0], tt.header[1])
			}
			do(t, NewTransport(newBaseTransport(t), tt.opts...), req)
			got := srv.received()
			require.Len(t, got, 1)
			tt.check(t, got[0].Header.Get(tt.wantName))
		})
	}
}

func isUUIDv7(t *testing.T, got string) {
	t.Helper()
	require.Len(t, got, 36, "key %q", got)
	assert.Equal(t, byte('7'), got[14], "version nibble of %q", got)
}

func isQuotedUUIDv7(t *testing.T, got string) {
	t.Helper()
	require.True(t, len(got) == 38 && got[0] == '"' && got[37] == '"', "key %q", got)
	isUUIDv7(t, got[1:37])
}

func isEmpty(t *testing.T, got string) { t.Helper(); assert.Empty(t, got) }

func equals(want string) func(*testing.T, string) {
	return func(t *testing.T, got string) { t.Helper(); assert.Equal(t, want, got) }
}

func TestTwoRequestsGetDifferentKeys(t *testing.T) {
	srv := newServer(t, status(200))
	tr := NewTransport(newBaseTransport(t))
	do(t, tr, post(t, context.Background(), srv.URL, "a"))
	do(t, tr, post(t, context.Background(), srv.URL, "b"))
	keys := srv.keys()
	require.Len(t, keys, 2)
	assert.NotEqual(t, keys[0], keys[1])
}

func TestStructuredStringEscapes(t *testing.T) {
	assert.Equal(t, `"a\"b\\c"`, structuredString(`a"b\c`))
	assert.Equal(t, `""`, structuredString(""))
}

func TestKeyGeneratorErrorSendsNothing(t *testing.T) {
	srv := newServer(t, status(200))
	boom := errors.New("no entropy")
	tr := NewTransport(newBaseTransport(t), WithKeyGenerator(func() (string, error) { return "", boom }))
	body := newTrackedBody("x")
	req, err := http.NewRequest("POST", srv.URL, body)
	require.NoError(t, err)

	resp, err := tr.RoundTrip(req)

	assert.Nil(t, resp)
	assert.ErrorIs(t, err, boom)
	assert.ErrorIs(t, err, ErrKeyStore)
	assert.Zero(t, srv.hits.Load())
	assert.Equal(t, int32(1), body.closes.Load())
}

// A key generator or a KeyStore that hands out an empty key, or one a
// header cannot carry, stops the request as a failing one does: a keyed
// request sent without its key would be run again by every retry, and a
// bad key recorded for an operation would be sent again on every call.
func TestBadKeySendsNothing(t *testing.T) {
	tests := []struct {
		name  string
		opts  []Option
		store KeyStore // the KeyStore, if not a MemoryKeyStore the test reads
	}{
		{name: "empty generated key",
			opts: []Option{WithKeyGenerator(func() (string, error) { return "", nil })}},
		{name: "generated key with a line break",
			opts: []Option{WithKeyGenerator(func() (string, error) { return "k\r\nX-Evil: 1", nil })}},
		{name: "generated key beyond ASCII",
			opts: []Option{WithKeyGenerator(func() (string, error) { return "clé", nil })}},
		{name: "empty key from the KeyStore", store: &failingStore{}},
		{name: "generated key ending in a space",
			opts: []Option{WithKeyGenerator(func() (string, error) { return "k ", nil })}},
		{name: "generated key starting with a space",
			opts: []Option{WithKeyGenerator(func() (string, error) { return " k", nil })}},
		{name: "generated bare key in double quotes",
			opts: []Option{WithKeyGenerator(func() (string, error) { return `"k"`, nil })}},
	}
	for _, tt := range tests {
		for _, operation := range []bool{false, true} {
			if tt.store != nil && !operation {
				continue // a KeyStore is asked only for an operation's key
			}
			t.Run(fmt.Sprintf("%s/operation=%t", tt.name, operation), func(t *testing.T) {
				srv := newServer(t, status(503), status(200))
				memory := NewMemoryKeyStore()
				store := tt.store
				if store == nil {
					store = memory
				}
				opts := append([]Option{WithKeyStore(store), WithBackoff(noWait)}, tt.opts...)
				tr := NewTransport(newBaseTransport(t), opts...)
				ctx := context.Background()
				if operation {
					ctx = WithOperation(ctx, "order-1")
				}
				body := newTrackedBody("charge")
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, body)
				require.NoError(t, err)

				resp, err := tr.RoundTrip(req)

				assert.Nil(t, resp)
				assert.ErrorIs(t, err, ErrKeyStore)
				assert.Zero(t, srv.hits.Load(), "nothing is sent without a good key")
				assert.Equal(t, int32(1), body.closes.Load())
				if tt.store == nil {
					pending, err := memory.Pending(ctx)
					require.NoError(t, err)
					assert.Empty(t, pending, "no bad key is recorded")
				}
			})
		}
	}
}

// A panic in code of the caller's that runs before the first attempt (a
// key generator, a KeyStore) goes on to the caller, and the caller's
// request body, not yet handed to the base transport, is still closed, as
// on every other path.
func TestPanicBeforeSendingStillClosesTheBody(t *testing.T) {
	tests := []struct {
		name      string
		opts      []Option
		operation bool
	}{
		{name: "key generator",
			opts: []Option{WithKeyGenerator(func() (string, error) { panic("boom") })}},
		{name: "KeyStore", operation: true,
			opts: []Option{WithKeyStore(&panickingStore{})}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sent := false
			tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
				sent = true
				r.Body.Close()
				return okResponse(r, 200), nil
			}), tt.opts...)
			ctx := context.Background()
			if tt.operation {
				ctx = WithOperation(ctx, "order-1")
			}
			body := newTrackedBody("charge")
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://payments.example/charges", body)
			require.NoError(t, err)
			req.GetBody = func() (io.ReadCloser, error) { return newTrackedBody("charge"), nil }

			assert.PanicsWithValue(t, "boom", func() { _, _ = tr.RoundTrip(req) })
			assert.False(t, sent)
			assert.Equal(t, int32(1), body.closes.Load())
		})
	}
}

// panickingStore is a KeyStore whose Acquire panics.
type panickingStore struct{ failingStore }

func (*panickingStore) Acquire(context.Context, string, string) (string, error) { panic("boom") }

// The request body must reach the server byte-identical on every attempt,
// whether the Transport rewinds it with GetBody or buffers it.
func TestBodyIsIdenticalOnEveryAttempt(t *testing.T) {
	payload := strings.Repeat("0123456789abcdef", 4096) // 64 KiB
	tests := []struct {
		name string
		req  func(url string) *http.Request
	}{
		{"GetBody", func(url string) *http.Request {
			r, _ := http.NewRequest("POST", url, bytes.NewReader([]byte(payload)))
			require.NotNil(t, r.GetBody)
			return r
		}},
		{"buffered", func(url string) *http.Request {
			r, _ := http.NewRequest("POST", url, io.NopCloser(strings.NewReader(payload)))
			require.Nil(t, r.GetBody)
			return r
		}},
		{"buffered, unknown length", func(url string) *http.Request {
			r, _ := http.NewRequest("POST", url, io.MultiReader(strings.NewReader(payload)))
			r.ContentLength = -1
			return r
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, status(503), hangUp, status(500), status(201))
			resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), tt.req(srv.URL))
			assert.Equal(t, 201, resp.StatusCode)
			got := srv.received()
			require.Len(t, got, 4)
			for i, r := range got {
				assert.True(t, string(r.Body) == payload, "attempt %d body differs (%d bytes)", i+1, len(r.Body))
			}
		})
	}
}

func TestBodyOverBufferLimitIsSentOnceAndNotRetried(t *testing.T) {
	srv := newServer(t, status(503))
	var attempts []Attempt
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithBodyBufferLimit(1024),
		WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }))
	payload := strings.Repeat("z", 4096)
	body := newTrackedBody(payload)
	req, err := http.NewRequest("POST", srv.URL, body)
	require.NoError(t, err)

	resp := do(t, tr, req)

	assert.Equal(t, 503, resp.StatusCode, "the last outcome is returned")
	got := srv.received()
	require.Len(t, got, 1)
	assert.Equal(t, payload, string(got[0].Body), "the whole body was streamed")
	require.Len(t, attempts, 1)
	assert.Equal(t, ReasonBodyNotReplayable, attempts[0].Reason)
	assert.Equal(t, int32(1), body.closes.Load())
}

func TestBodyReadErrorIsReturnedAndBodyClosed(t *testing.T) {
	srv := newServer(t, status(200))
	boom := errors.New("disk gone")
	body := &trackedBody{r: io.MultiReader(strings.NewReader("abc"), errReader{boom})}
	req, err := http.NewRequest("POST", srv.URL, body)
	require.NoError(t, err)

	resp, err := NewTransport(newBaseTransport(t)).RoundTrip(req)

	assert.Nil(t, resp)
	assert.ErrorIs(t, err, boom)
	assert.Zero(t, srv.hits.Load())
	assert.Equal(t, int32(1), body.closes.Load())
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// When the body cannot be rewound for a retry, the request ends with the
// last attempt's outcome, and the refused attempt is reported as not sent.
func TestGetBodyFailureStopsRetrying(t *testing.T) {
	boom := errors.New("cannot rewind")
	tests := []struct {
		name  string
		reply func(http.ResponseWriter, *http.Request)
	}{
		{"after a response", status(503)},
		{"after an error", hangUp},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply)
			var attempts []Attempt
			req := post(t, context.Background(), srv.URL, "x")
			req.GetBody = func() (io.ReadCloser, error) { return nil, boom }
			tr := NewTransport(newBaseTransport(t), WithBackoff(noWait),
				WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }))

			resp, err := tr.RoundTrip(req)

			if resp != nil {
				require.NoError(t, err)
				assert.Equal(t, 503, resp.StatusCode, "the last outcome is returned")
				body, _ := io.ReadAll(resp.Body)
				assert.Equal(t, "Service Unavailable", string(body), "with its body")
				resp.Body.Close()
			} else {
				assert.ErrorIs(t, err, ErrBodyNotReplayable)
				var re *RetryError
				require.ErrorAs(t, err, &re)
				assert.Equal(t, 1, re.Attempts, "only attempts sent are counted")
			}
			assert.Equal(t, int32(1), srv.hits.Load())
			require.Len(t, attempts, 2)
			assert.True(t, attempts[0].Sent)
			assert.False(t, attempts[1].Sent)
			assert.ErrorIs(t, attempts[1].Err, boom)
			assert.Equal(t, ReasonBodyNotReplayable, attempts[1].Reason)
		})
	}
}

// stopCountingContext counts the contexts derived from it that are still
// waiting on it: context.WithTimeout registers each through AfterFunc and
// calls the stop it returns once the derived context is cancelled.
type stopCountingContext struct {
	context.Context
	done    chan struct{}
	waiting atomic.Int32
}

func (c *stopCountingContext) Done() <-chan struct{} { return c.done }

func (c *stopCountingContext) AfterFunc(func()) (stop func() bool) {
	c.waiting.Add(1)
	var once sync.Once
	return func() bool {
		once.Do(func() { c.waiting.Add(-1) })
		return true
	}
}

// An attempt refused because GetBody failed releases the context it made
// for its timeout, as every other attempt does, rather than leaving it
// (with a goroutine, for a parent of an unfamiliar type) until the timeout.
func TestGetBodyFailureReleasesAttemptContext(t *testing.T) {
	srv := newServer(t, status(503))
	ctx := &stopCountingContext{Context: context.Background(), done: make(chan struct{})}
	req := post(t, ctx, srv.URL, "x")
	req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("cannot rewind") }
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithAttemptTimeout(time.Hour))

	resp := do(t, tr, req)

	assert.Equal(t, 503, resp.StatusCode)
	assert.Equal(t, int32(1), srv.hits.Load())
	assert.Zero(t, ctx.waiting.Load(), "attempt contexts still waiting on the caller's")
}

// snapshot captures everything of a request that RoundTrip must not change.
type snapshot struct {
	method, url string
	header      http.Header
	body        io.ReadCloser
	getBody     bool
	ctx         context.Context
	length      int64
}

func snap(r *http.Request) snapshot {
	return snapshot{r.Method, r.URL.String(), r.Header.Clone(), r.Body, r.GetBody != nil, r.Context(), r.ContentLength}
}

func TestCallerRequestIsNeverMutated(t *testing.T) {
	// A base transport that scribbles on what it is given, as some do.
	srv := newServer(t, status(503), status(200))
	base := newBaseTransport(t)
	scribbler := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		r.Header.Set("X-Scribble", "1")
		return base.RoundTrip(r)
	})
	for _, opts := range [][]Option{nil, {WithAttemptTimeout(10e9)}, {WithStructuredKey()}, {WithKeyedMethods()}} {
		req := post(t, WithOperation(context.Background(), "op"), srv.URL, "body")
		req.Header.Set("X-Caller", "yes")
		before := snap(req)

		do(t, NewTransport(scribbler, append(opts, WithBackoff(noWait))...), req)

		after := snap(req)
		assert.Equal(t, before.header, after.header)
		assert.Empty(t, req.Header.Get("Idempotency-Key"))
		assert.Equal(t, before.method, after.method)
		assert.Equal(t, before.url, after.url)
		assert.True(t, before.body == after.body, "Body replaced")
		assert.Equal(t, before.getBody, after.getBody)
		assert.True(t, before.ctx == after.ctx, "context replaced")
		assert.Equal(t, before.length, after.length)
		srv.hits.Store(0)
	}
}

// An attempt that adds nothing to the header sends the caller's own map
// only to net/http's Transport, which never writes to it; one that adds a
// key, or goes to any other base transport, gets a copy, which shares the
// caller's values only with net/http's Transport. A nil header is never
// passed on: http.Transport refuses it.
func TestAttemptSharesTheCallersHeaderOnlyWithNetHTTP(t *testing.T) {
	srv := newServer(t, status(503), status(200))
	mapOf := func(h http.Header) uintptr { return reflect.ValueOf(h).Pointer() }
	tests := []struct {
		name         string
		method       string
		netHTTP      bool
		nilHdr       bool
		shared       bool // the caller's map is sent
		sharedValues bool // the caller's values are sent
	}{
		{name: "GET to net/http", method: "GET", netHTTP: true, shared: true, sharedValues: true},
		{name: "GET with a nil header to net/http", method: "GET", netHTTP: true, nilHdr: true},
		{name: "keyed POST to net/http", method: "POST", netHTTP: true, sharedValues: true},
		{name: "GET to another base", method: "GET"},
		{name: "keyed POST to another base", method: "POST"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv.hits.Store(0)
			var sent []http.Header
			base := newBaseTransport(t)
			// Proxy is called with each request net/http is given.
			base.Proxy = func(r *http.Request) (*url.URL, error) {
				sent = append(sent, r.Header)
				return nil, nil
			}
			var rt http.RoundTripper = base
			if !tt.netHTTP {
				rt = roundTripFunc(base.RoundTrip)
			}
			req, err := http.NewRequest(tt.method, srv.URL, nil)
			require.NoError(t, err)
			req.Header.Set("X-Caller", "yes")
			if tt.nilHdr {
				req.Header = nil
			}
			before := req.Header.Clone()

			resp := do(t, NewTransport(rt, WithBackoff(noWait)), req)
			assert.Equal(t, 200, resp.StatusCode)
			require.Len(t, sent, 2, "two attempts")
			var keys []string
			for i, h := range sent {
				require.NotNil(t, h, "attempt %d", i+1)
				assert.Equal(t, tt.shared, mapOf(h) == mapOf(req.Header), "attempt %d shares the caller's map", i+1)
				if !tt.nilHdr {
					assert.Equal(t, tt.sharedValues, &h["X-Caller"][0] == &req.Header["X-Caller"][0],
						"attempt %d shares the caller's values", i+1)
				}
				if tt.method == "POST" {
					keys = append(keys, h.Get("Idempotency-Key"))
				}
			}
			if tt.method == "POST" {
				require.Len(t, keys, 2)
				assert.NotEmpty(t, keys[0])
				assert.Equal(t, keys[0], keys[1], "one key for both attempts")
			}
			assert.Equal(t, before, req.Header, "caller's header unchanged")
		})
	}
}

// A base transport that overwrites the key's value in place reaches
// neither the caller nor the next attempt: each attempt has its own.
func TestScribbledKeyDoesNotReachTheNextAttempt(t *testing.T) {
	srv := newServer(t, status(503), status(200))
	base := newBaseTransport(t)
	var keys []string
	scribbler := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		vv := r.Header["Idempotency-Key"]
		require.Len(t, vv, 1)
		keys = append(keys, vv[0])
		vv[0] = "scribbled"
		return base.RoundTrip(r)
	})
	for _, opts := range [][]Option{nil, {WithAttemptTimeout(10e9)}} {
		keys = nil
		srv.hits.Store(0)
		req := post(t, context.Background(), srv.URL, "body")
		do(t, NewTransport(scribbler, append(opts, WithBackoff(noWait))...), req)
		require.Len(t, keys, 2)
		assert.NotEqual(t, "scribbled", keys[1])
		assert.Equal(t, keys[0], keys[1])
		assert.Empty(t, req.Header)
	}
}

// The caller's body must be closed exactly once on every path.
func TestCallerBodyClosedExactlyOnce(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	failing := &failingStore{err: errors.New("store down")}
	tests := []struct {
		name    string
		ctx     context.Context
		opts    []Option
		getBody bool
		reply   []func(http.ResponseWriter, *http.Request)
	}{
		{name: "success", reply: []func(http.ResponseWriter, *http.Request){status(200)}},
		{name: "success with GetBody", getBody: true, reply: []func(http.ResponseWriter, *http.Request){status(200)}},
		{name: "retried", reply: []func(http.ResponseWriter, *http.Request){status(503), status(200)}},
		{name: "retried with GetBody", getBody: true, reply: []func(http.ResponseWriter, *http.Request){status(503), hangUp, status(200)}},
		{name: "exhausted", reply: []func(http.ResponseWriter, *http.Request){status(503)}},
		{name: "over buffer limit", opts: []Option{WithBodyBufferLimit(1)}, reply: []func(http.ResponseWriter, *http.Request){status(503)}},
		{name: "key store refuses before any attempt", getBody: true, ctx: WithOperation(context.Background(), "op"),
			opts: []Option{WithKeyStore(failing)}, reply: []func(http.ResponseWriter, *http.Request){status(200)}},
		{name: "context canceled before start", getBody: true, ctx: canceled, reply: []func(http.ResponseWriter, *http.Request){status(200)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply...)
			body := newTrackedBody("payload")
			ctx := tt.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			req, err := http.NewRequestWithContext(ctx, "POST", srv.URL, body)
			require.NoError(t, err)
			if tt.getBody {
				req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader("payload")), nil }
			}
			resp, err := NewTransport(newBaseTransport(t), append(tt.opts, WithBackoff(noWait))...).RoundTrip(req)
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			assert.Equal(t, int32(1), body.closes.Load())
		})
	}
}

type failingStore struct{ err error }

func (s *failingStore) Acquire(context.Context, string, string) (string, error) { return "", s.err }
func (s *failingStore) Release(context.Context, string, string) error           { return s.err }
func (s *failingStore) Pending(context.Context) ([]PendingOperation, error)     { return nil, s.err }

func TestNeverReturnsResponseAndError(t *testing.T) {
	boom := errors.New("broken base")
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		return okResponse(r, 200), boom
	})
	resp, err := NewTransport(base, WithBackoff(noWait)).RoundTrip(post(t, context.Background(), "http://x.invalid", "x"))
	assert.Nil(t, resp)
	assert.ErrorIs(t, err, boom)

	nilBoth := roundTripFunc(func(*http.Request) (*http.Response, error) { return nil, nil })
	resp, err = NewTransport(nilBoth).RoundTrip(post(t, context.Background(), "http://x.invalid", "x"))
	assert.Nil(t, resp)
	assert.Error(t, err)
}

// Discarded attempts' bodies are drained and closed, so every retry reuses
// the first attempt's connection.
func TestDiscardedResponsesAreDrainedForConnectionReuse(t *testing.T) {
	big := strings.Repeat("e", 32<<10)
	errorWithBody := func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(503)
		io.WriteString(w, big)
	}
	srv := newServer(t, errorWithBody, errorWithBody, status(200))
	var (
		mu     sync.Mutex
		reused []bool
	)
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		mu.Lock()
		reused = append(reused, info.Reused)
		mu.Unlock()
	}}
	ctx := httptrace.WithClientTrace(context.Background(), trace)
	do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), post(t, ctx, srv.URL, "x"))

	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []bool{false, true, true}, reused)
}

// With an attempt timeout, the attempt's context must outlive RoundTrip
// (the caller still reads the body with it) and end when the body closes.
func TestAttemptContextLivesUntilBodyClosed(t *testing.T) {
	payload := strings.Repeat("b", 100<<10)
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, payload) })
	var attemptCtx context.Context
	base := newBaseTransport(t)
	spy := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		attemptCtx = r.Context()
		return base.RoundTrip(r)
	})
	resp, err := NewTransport(spy, WithAttemptTimeout(time.Hour)).RoundTrip(post(t, context.Background(), srv.URL, "x"))
	require.NoError(t, err)
	assert.NoError(t, attemptCtx.Err(), "attempt context ended before the body was read")
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err, "the body could not be read after RoundTrip returned")
	assert.Equal(t, len(payload), len(body))
	require.NoError(t, resp.Body.Close())
	assert.ErrorIs(t, attemptCtx.Err(), context.Canceled, "attempt context not released on Close")
}

func TestCloseIdleConnectionsReachesBase(t *testing.T) {
	base := &idleCloser{}
	NewTransport(base).CloseIdleConnections()
	assert.True(t, base.closed)
	NewTransport(roundTripFunc(nil)).CloseIdleConnections() // no method: no panic
}

type idleCloser struct {
	http.RoundTripper
	closed bool
}

func (c *idleCloser) CloseIdleConnections() { c.closed = true }

func TestNewClientUsesTransport(t *testing.T) {
	srv := newServer(t, status(503), status(200))
	client := NewClient(WithBackoff(noWait))
	defer client.CloseIdleConnections()
	require.IsType(t, &Transport{}, client.Transport)

	resp, err := client.Post(srv.URL, "text/plain", strings.NewReader("x"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 200, resp.StatusCode)
	keys := srv.keys()
	require.Len(t, keys, 2)
	assert.Equal(t, keys[0], keys[1])
}

// A caller may set the key header through the map under any spelling of
// its name (http.Header's documented way to send a name as written). The
// Transport must see that key: a second, generated key beside it would
// reach the server as two key fields, and a server that reads the first
// would act under a key the caller never knew.
func TestCallerKeyKeptWhateverTheSpelling(t *testing.T) {
	tests := []struct {
		name     string
		opts     []Option
		field    string // the map key the caller sets
		wantName string // the name the server reads
	}{
		{name: "lower case", field: "idempotency-key", wantName: "Idempotency-Key"},
		{name: "upper case", field: "IDEMPOTENCY-KEY", wantName: "Idempotency-Key"},
		{name: "custom name, other casing", opts: []Option{WithKeyHeader("x-request-KEY")},
			field: "X-REQUEST-key", wantName: "X-Request-Key"},
		{name: "structured keys", opts: []Option{WithStructuredKey()},
			field: "idempotency-key", wantName: "Idempotency-Key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, status(503), status(200))
			var hooked []string
			opts := append([]Option{WithBackoff(noWait),
				WithAttemptHook(func(a Attempt) { hooked = append(hooked, a.Key) })}, tt.opts...)
			req := post(t, WithOperation(context.Background(), "op"), srv.URL, "charge")
			req.Header[tt.field] = []string{"mine"}

			do(t, NewTransport(newBaseTransport(t), opts...), req)

			got := srv.received()
			require.Len(t, got, 2)
			for i, r := range got {
				assert.Equal(t, []string{"mine"}, r.Header.Values(tt.wantName), "attempt %d", i+1)
			}
			assert.Equal(t, []string{"mine", "mine"}, hooked)
		})
	}
}

// A key field the caller left blank (empty, or only spaces and tabs) reaches
// the server as an empty value, which a server reads as no key and runs
// unkeyed. It is no key: a keyed method gets one of the Transport's, and a
// request of another method is not resent as if it carried one.
func TestBlankCallerKeyIsNoKey(t *testing.T) {
	for _, blank := range []string{" ", "\t", " \t "} {
		t.Run(fmt.Sprintf("%q on POST", blank), func(t *testing.T) {
			srv := newServer(t, status(503), status(200))
			req := post(t, context.Background(), srv.URL, "charge")
			req.Header.Set("Idempotency-Key", blank)

			resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), req)

			assert.Equal(t, 200, resp.StatusCode)
			got := srv.received()
			require.Len(t, got, 2)
			isUUIDv7(t, got[0].Key)
			assert.Equal(t, got[0].Key, got[1].Key)
			assert.Equal(t, []string{blank}, req.Header.Values("Idempotency-Key"), "caller's header changed")
		})
		t.Run(fmt.Sprintf("%q on an unkeyed method", blank), func(t *testing.T) {
			srv := newServer(t, status(503), status(200))
			req, err := http.NewRequest("CHARGE", srv.URL, strings.NewReader("charge"))
			require.NoError(t, err)
			req.Header.Set("Idempotency-Key", blank)

			resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), req)

			assert.Equal(t, 503, resp.StatusCode)
			assert.Equal(t, int32(1), srv.hits.Load(), "an unkeyed request was sent again")
		})
	}
}

// A 101 Switching Protocols response's body is the connection, which
// net/http hands over as an io.ReadWriteCloser for the caller to speak the
// new protocol on (WebSocket, h2c). Whatever the Transport wraps it in must
// still be one.
func TestUpgradedConnectionStaysWritable(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		_ = brw.Flush()
		line, _ := brw.ReadString('\n')
		_, _ = brw.WriteString(line)
		_ = brw.Flush()
	}))
	t.Cleanup(srv.Close)
	tests := []struct {
		name string
		opts []Option
	}{
		{"no attempt timeout", nil},
		{"attempt timeout", []Option{WithAttemptTimeout(time.Minute)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
			require.NoError(t, err)
			req.Header.Set("Connection", "Upgrade")
			req.Header.Set("Upgrade", "echo")

			resp, err := NewTransport(newBaseTransport(t), tt.opts...).RoundTrip(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, http.StatusSwitchingProtocols, resp.StatusCode)
			conn, ok := resp.Body.(io.ReadWriteCloser)
			require.True(t, ok, "the body of a 101 is %T, not an io.ReadWriteCloser", resp.Body)
			_, err = io.WriteString(conn, "ping\n")
			require.NoError(t, err)
			line, err := bufio.NewReader(conn).ReadString('\n')
			require.NoError(t, err)
			assert.Equal(t, "ping\n", line)
		})
	}
}

// net/http itself resends a request whose header holds an Idempotency-Key
// field, whatever its value, when the connection it reused was closed
// after the request went out. A blank field is no key, so the request that
// carries it must not be resent once it may have reached the server: the
// attempt leaves the blank field out, and net/http with it.
func TestBlankCallerKeyIsNotResentByTheBaseTransport(t *testing.T) {
	for _, blank := range []string{"", " ", "\t"} {
		t.Run(fmt.Sprintf("%q", blank), func(t *testing.T) {
			var charges atomic.Int32
			var fields recorder[[]string]
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method != "CHARGE" {
					return
				}
				fields.add(r.Header.Values("Idempotency-Key"))
				if charges.Add(1) == 1 {
					hangUp(w, r) // charged; the response is lost
				}
			}))
			t.Cleanup(srv.Close)
			tr := NewTransport(newBaseTransport(t), WithBackoff(noWait))
			warm, err := http.NewRequest(http.MethodGet, srv.URL, nil)
			require.NoError(t, err)
			do(t, tr, warm) // a connection for the charge to reuse
			req, err := http.NewRequest("CHARGE", srv.URL, strings.NewReader("charge"))
			require.NoError(t, err)
			req.Header["Idempotency-Key"] = []string{blank}

			_, err = tr.RoundTrip(req)

			require.Error(t, err, "the response was lost")
			assert.Equal(t, int32(1), charges.Load(), "the charge ran again")
			assert.Equal(t, [][]string{nil}, fields.all(), "a blank key field was sent")
			assert.Equal(t, []string{blank}, req.Header["Idempotency-Key"], "caller's header changed")
		})
	}
}
