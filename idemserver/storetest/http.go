package storetest

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// RunHTTP runs the suite that puts each store newStore makes behind
// [idemserver.Middleware], configured with opts and the suite's own
// options, in an httptest server, and checks what clients see: a key's
// handler runs once and every retry gets the first response byte for byte,
// concurrent duplicates are refused with 409 or wait and replay, a different
// request with the key gets 422, a server error or a panic lets a retry run
// the handler again, a large response replays whole, and scopes stay apart.
func RunHTTP(t *testing.T, newStore func(t *testing.T) idemserver.Store, opts ...idemserver.Option) {
	t.Helper()
	for _, tt := range []struct {
		name string
		run  func(*testing.T, func(t *testing.T) idemserver.Store, []idemserver.Option)
	}{
		{"ExecutesOnceAndReplays", testHTTPReplay},
		{"ConcurrentDuplicates", testHTTPConcurrent},
		{"ConcurrentDuplicatesWait", testHTTPConcurrentWait},
		{"Mismatch", testHTTPMismatch},
		{"ServerErrorReleases", testHTTPServerError},
		{"PanicReleases", testHTTPPanic},
		{"LargeResponse", testHTTPLarge},
		{"Scopes", testHTTPScopes},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.run(t, newStore, opts) })
	}
}

// executions counts the handler's runs per key.
type executions struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *executions) add(key string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = make(map[string]int)
	}
	e.n[key]++
	return e.n[key]
}

func (e *executions) get(key string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[key]
}

// server is an httptest server with the middleware in front of a handler.
type server struct {
	*httptest.Server
	runs *executions
}

// serve starts a server whose handler, given the key's run number and the
// request, serves it; the server stops when the test ends.
func serve(t *testing.T, store idemserver.Store, opts []idemserver.Option, h func(n int, w http.ResponseWriter, r *http.Request)) *server {
	runs := &executions{}
	mw := idemserver.Middleware(store, opts...)
	s := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-Tenant") + "/" + r.Header.Get(idemserver.DefaultKeyHeader)
		h(runs.add(key), w, r)
	})))
	t.Cleanup(s.Close)
	return &server{Server: s, runs: runs}
}

// reply is a response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// replayed reports whether r is marked as a replay.
func (r reply) replayed() bool { return r.header.Get(idemserver.ReplayedHeader) == "true" }

// handlerFields returns the header fields of r without those that belong
// to each response rather than to the stored one.
func (r reply) handlerFields() http.Header {
	h := r.header.Clone()
	delete(h, "Date")
	delete(h, idemserver.ReplayedHeader)
	return h
}

// post sends a keyed POST and reads the response; the error is the
// request's, such as a connection the server aborted.
func (s *server) post(key, tenant, body string) (reply, error) {
	req, err := http.NewRequest(http.MethodPost, s.URL+"/payments", strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set(idemserver.DefaultKeyHeader, key)
	if tenant != "" {
		req.Header.Set("X-Tenant", tenant)
	}
	resp, err := s.Client().Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

func (s *server) mustPost(t *testing.T, key, tenant, body string) reply {
	t.Helper()
	r, err := s.post(key, tenant, body)
	require.NoError(t, err)
	return r
}

// assertSameReply checks that replay repeats first byte for byte.
func assertSameReply(t *testing.T, first, replay reply) {
	t.Helper()
	assert.False(t, first.replayed(), "the first response is not a replay")
	assert.True(t, replay.replayed(), "a replay is marked %s: true", idemserver.ReplayedHeader)
	assert.Equal(t, first.status, replay.status, "status")
	assert.Equal(t, first.handlerFields(), replay.handlerFields(), "header fields")
	assert.True(t, bytes.Equal(first.body, replay.body), "body: %d and %d bytes%s", len(first.body), len(replay.body), bodyDiff(first.body, replay.body))
}

// writeCreated answers 201 with fields of several kinds and a body that names
// the run.
func writeCreated(n int, w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h["Link"] = []string{"</a>; rel=first", "</b>; rel=next"}
	h.Set("X-Run", strconv.Itoa(n))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"run":%d,"request":%q}`, n, body)
}

func testHTTPReplay(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	s := serve(t, newStore(t), opts, writeCreated)
	first := s.mustPost(t, "k", "", `{"amount":100}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	for range 3 {
		assertSameReply(t, first, s.mustPost(t, "k", "", `{"amount":100}`))
	}
	assert.Equal(t, 1, s.runs.get("/k"), "handler runs")
	// Another key is another operation.
	other := s.mustPost(t, "k2", "", `{"amount":100}`)
	assert.Equal(t, http.StatusCreated, other.status)
	assert.False(t, other.replayed())
	assert.Equal(t, 1, s.runs.get("/k2"))
}

// blockedFirst starts a server whose handler's first run waits until
// release is called, sends it a request with key k, and returns once that
// run has started. wait returns the first request's reply.
func blockedFirst(t *testing.T, store idemserver.Store, opts []idemserver.Option) (s *server, release func(), wait func() reply) {
	entered, released := make(chan struct{}), make(chan struct{})
	s = serve(t, store, opts, func(run int, w http.ResponseWriter, r *http.Request) {
		if run == 1 {
			close(entered)
			<-released
		}
		writeCreated(run, w, r)
	})
	var first reply
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		first, err = s.post("k", "", "body")
	}()
	<-entered
	return s, func() { close(released) }, func() reply {
		<-done
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, first.status)
		return first
	}
}

func testHTTPConcurrent(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	const n = 50
	s, release, wait := blockedFirst(t, newStore(t), opts)
	// While the first runs, every duplicate is told it is in progress.
	replies := make([]reply, n)
	errs := make([]error, n)
	concurrently(n, func(i int) { replies[i], errs[i] = s.post("k", "", "body") })
	release()
	first := wait()
	for i, r := range replies {
		require.NoError(t, errs[i])
		assert.Equal(t, http.StatusConflict, r.status, "duplicate %d: %s", i, r.body)
		assert.NotEmpty(t, r.header.Get("Retry-After"), "duplicate %d", i)
		assert.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	}
	assertSameReply(t, first, s.mustPost(t, "k", "", "body"))
	assert.Equal(t, 1, s.runs.get("/k"), "handler runs")
}

func testHTTPConcurrentWait(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	const n = 20
	opts = append(opts[:len(opts):len(opts)], idemserver.WithWaitInFlight(time.Minute))
	s, release, wait := blockedFirst(t, newStore(t), opts)
	replies := make([]reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { replies[i], errs[i] = s.post("k", "", "body") })
	}
	// The duplicates either wait for the first or arrive after it: either
	// way they all replay it.
	release()
	wg.Wait()
	first := wait()
	for i, r := range replies {
		require.NoError(t, errs[i])
		assertSameReply(t, first, r)
	}
	assert.Equal(t, 1, s.runs.get("/k"), "handler runs")
}

func testHTTPMismatch(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	s := serve(t, newStore(t), opts, writeCreated)
	require.Equal(t, http.StatusCreated, s.mustPost(t, "k", "", "one").status)
	r := s.mustPost(t, "k", "", "two")
	assert.Equal(t, http.StatusUnprocessableEntity, r.status)
	assert.Contains(t, string(r.body), idemserver.ProblemFingerprintMismatch)
	assert.Equal(t, 1, s.runs.get("/k"))
}

func testHTTPServerError(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	s := serve(t, newStore(t), opts, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		writeCreated(n, w, r)
	})
	assert.Equal(t, http.StatusServiceUnavailable, s.mustPost(t, "k", "", "b").status)
	second := s.mustPost(t, "k", "", "b")
	assert.Equal(t, http.StatusCreated, second.status, "a server error released the key")
	assertSameReply(t, second, s.mustPost(t, "k", "", "b"))
	assert.Equal(t, 2, s.runs.get("/k"))
}

func testHTTPPanic(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	s := serve(t, newStore(t), opts, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			panic(http.ErrAbortHandler) // net/http aborts the response without a log line
		}
		writeCreated(n, w, r)
	})
	_, err := s.post("k", "", "b")
	require.Error(t, err, "the panic aborts the response")
	second := s.mustPost(t, "k", "", "b")
	assert.Equal(t, http.StatusCreated, second.status, "a panic released the key")
	assertSameReply(t, second, s.mustPost(t, "k", "", "b"))
	assert.Equal(t, 2, s.runs.get("/k"))
}

func testHTTPLarge(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	big := make([]byte, idemserver.DefaultMaxResponseBytes)
	for i := range big {
		big[i] = byte(i * 31 % 253)
	}
	s := serve(t, newStore(t), opts, func(n int, w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(big[:len(big)/2])
		_, _ = w.Write(big[len(big)/2:])
	})
	first := s.mustPost(t, "k", "", "b")
	require.Equal(t, http.StatusOK, first.status)
	require.True(t, bytes.Equal(big, first.body))
	assertSameReply(t, first, s.mustPost(t, "k", "", "b"))
	assert.Equal(t, 1, s.runs.get("/k"))
}

func testHTTPScopes(t *testing.T, newStore func(*testing.T) idemserver.Store, opts []idemserver.Option) {
	opts = append(opts[:len(opts):len(opts)], idemserver.WithScope(func(r *http.Request) string { return r.Header.Get("X-Tenant") }))
	s := serve(t, newStore(t), opts, func(n int, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "tenant %s run %d", r.Header.Get("X-Tenant"), n)
	})
	a := s.mustPost(t, "k", "a", "b")
	b := s.mustPost(t, "k", "b", "b")
	assert.Equal(t, "tenant a run 1", string(a.body))
	assert.Equal(t, "tenant b run 1", string(b.body), "the same key in another scope is another operation")
	assertSameReply(t, a, s.mustPost(t, "k", "a", "b"))
	assertSameReply(t, b, s.mustPost(t, "k", "b", "b"))
	// A different request under the same key in another scope is no
	// mismatch.
	assert.Equal(t, http.StatusCreated, s.mustPost(t, "k", "c", "other body").status)
}
