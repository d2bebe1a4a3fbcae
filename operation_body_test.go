package idemhttp

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// cutBody answers with code and a Content-Length of len(body), sends only
// the first send bytes of body, and closes the connection: the response
// body is lost in transit.
func cutBody(code int, body string, send int) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		defer conn.Close()
		writeCutResponse(buf, code, nil, []byte(body), send)
	}
}

// writeCutResponse writes a response whose header announces all of body
// but which carries only its first send bytes.
func writeCutResponse(buf *bufio.ReadWriter, code int, header http.Header, body []byte, send int) {
	fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\n", code, http.StatusText(code))
	_ = header.Write(buf)
	fmt.Fprintf(buf, "Content-Length: %d\r\n\r\n", len(body))
	buf.Write(body[:send])
	buf.Flush()
}

// pendingKeys lists the pending keys of store by operation.
func pendingKeys(t *testing.T, store KeyStore) map[string]string {
	t.Helper()
	pending, err := store.Pending(context.Background())
	require.NoError(t, err)
	m := map[string]string{}
	for _, p := range pending {
		m[p.Operation] = p.Key
	}
	return m
}

// An operation's key is released only once its final response has been
// delivered: its body read to the end, or closed by a caller that did not
// see a read fail. A body lost in transit leaves the key pending.
func TestOperationKeyReleasedWithTheBody(t *testing.T) {
	const payload = "payment pay_123 created"
	tests := []struct {
		name   string
		method string
		reply  func(http.ResponseWriter, *http.Request)
		// use reads the body the way a caller would, and reports whether
		// the key should be pending at each step: after RoundTrip, after
		// use's reads, after Close.
		use                        func(t *testing.T, body io.Reader)
		atReturn, afterUse, closed bool
	}{
		{
			name: "read to EOF releases before Close", method: http.MethodPost, reply: status(201),
			use:      func(t *testing.T, body io.Reader) { _, err := io.ReadAll(body); require.NoError(t, err) },
			atReturn: true, afterUse: false, closed: false,
		},
		{
			name: "close without reading releases", method: http.MethodPost, reply: status(201),
			use:      func(*testing.T, io.Reader) {},
			atReturn: true, afterUse: true, closed: false,
		},
		{
			name: "close after a partial read releases", method: http.MethodPost,
			reply: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, payload) },
			use: func(t *testing.T, body io.Reader) {
				_, err := body.Read(make([]byte, 2))
				require.NoError(t, err)
			},
			atReturn: true, afterUse: true, closed: false,
		},
		{
			name: "body cut in transit stays pending", method: http.MethodPost, reply: cutBody(201, payload, 7),
			use: func(t *testing.T, body io.Reader) {
				_, err := io.ReadAll(body)
				require.ErrorIs(t, err, io.ErrUnexpectedEOF)
			},
			atReturn: true, afterUse: true, closed: true,
		},
		{
			name: "final 4xx released with its body", method: http.MethodPost, reply: status(422),
			use:      func(t *testing.T, body io.Reader) { _, err := io.ReadAll(body); require.NoError(t, err) },
			atReturn: true, afterUse: false, closed: false,
		},
		{
			name: "final 4xx cut in transit stays pending", method: http.MethodPost, reply: cutBody(422, payload, 3),
			use: func(t *testing.T, body io.Reader) {
				_, err := io.ReadAll(body)
				require.Error(t, err)
			},
			atReturn: true, afterUse: true, closed: true,
		},
		{
			name: "204 has no body: released at once", method: http.MethodPost, reply: status(204),
			use:      func(*testing.T, io.Reader) {},
			atReturn: false, afterUse: false, closed: false,
		},
		{
			name: "empty body: released at once", method: http.MethodPost,
			reply:    func(w http.ResponseWriter, r *http.Request) { w.Header().Set("Content-Length", "0") },
			use:      func(*testing.T, io.Reader) {},
			atReturn: false, afterUse: false, closed: false,
		},
		{
			name: "HEAD: released at once", method: http.MethodHead, reply: status(200),
			use:      func(*testing.T, io.Reader) {},
			atReturn: false, afterUse: false, closed: false,
		},
		{
			name: "exhausted 503 stays pending", method: http.MethodPost, reply: status(503),
			use:      func(t *testing.T, body io.Reader) { _, err := io.ReadAll(body); require.NoError(t, err) },
			atReturn: true, afterUse: true, closed: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply)
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(1),
				WithKeyedMethods(http.MethodPost, http.MethodHead))
			req, err := http.NewRequestWithContext(WithOperation(context.Background(), "op"), tt.method, srv.URL, nil)
			require.NoError(t, err)

			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			key := srv.keys()[0]
			require.NotEmpty(t, key)
			want := func(pending bool) map[string]string {
				if pending {
					return map[string]string{"op": key}
				}
				return map[string]string{}
			}
			assert.Equal(t, want(tt.atReturn), pendingKeys(t, store), "when RoundTrip returns")
			tt.use(t, resp.Body)
			assert.Equal(t, want(tt.afterUse), pendingKeys(t, store), "after reading")
			require.NoError(t, resp.Body.Close())
			assert.Equal(t, want(tt.closed), pendingKeys(t, store), "after Close")
		})
	}
}

// A key store that counts releases.
type countingStore struct {
	*MemoryKeyStore
	releases atomic.Int32
}

func (s *countingStore) Release(ctx context.Context, op, key string) error {
	s.releases.Add(1)
	return s.MemoryKeyStore.Release(ctx, op, key)
}

// Reading to EOF, reading again and closing twice release the key once.
func TestOperationKeyReleasedOnce(t *testing.T) {
	srv := newServer(t, status(201))
	store := &countingStore{MemoryKeyStore: NewMemoryKeyStore()}
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
	resp, err := tr.RoundTrip(post(t, WithOperation(context.Background(), "op"), srv.URL, "x"))
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	require.NoError(t, err)
	n, err := resp.Body.Read(make([]byte, 1))
	assert.Zero(t, n)
	assert.Equal(t, io.EOF, err)
	resp.Body.Close()
	resp.Body.Close()
	assert.Equal(t, int32(1), store.releases.Load())
}

// Close may be called while another goroutine is reading the body, as the
// http.Response contract allows: a Close that interrupts a blocked read
// keeps the key pending, as a read error does, for neither reader nor
// closer has seen the whole outcome. The Close comes only once the reader
// is inside a read that cannot return, since the server holds the rest of
// the body back.
func TestOperationKeyCloseDuringRead(t *testing.T) {
	for range 20 {
		sent, hold := make(chan struct{}), make(chan struct{})
		srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(201)
			io.WriteString(w, "partial")
			w.(http.Flusher).Flush()
			close(sent)
			<-hold
		})
		store := &countingStore{MemoryKeyStore: NewMemoryKeyStore()}
		entered := make(chan struct{})
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			resp, err := newBaseTransport(t).RoundTrip(r)
			if err == nil {
				resp.Body = &enteringBody{ReadCloser: resp.Body, after: len("partial"), entered: entered}
			}
			return resp, err
		})
		tr := NewTransport(base, WithKeyStore(store))
		resp, err := tr.RoundTrip(post(t, WithOperation(context.Background(), "op"), srv.URL, "x"))
		require.NoError(t, err)
		<-sent

		var wg sync.WaitGroup
		var readErr error
		wg.Go(func() { _, readErr = io.ReadAll(resp.Body) })
		<-entered
		require.NoError(t, resp.Body.Close())
		wg.Wait()
		close(hold)
		srv.Close()

		require.Error(t, readErr, "the read was blocked, and the Close ended it")
		// The caller never saw the outcome: a watchdog that closes a
		// stalled body must not end the operation.
		assert.Zero(t, store.releases.Load())
		assert.Len(t, pendingKeys(t, store), 1)
	}
}

// enteringBody closes entered when a Read starts after the first after
// bytes have been read: the bytes the server sent before holding the rest.
type enteringBody struct {
	io.ReadCloser
	after   int
	read    int
	entered chan struct{}
}

func (b *enteringBody) Read(p []byte) (int, error) {
	if b.read >= b.after && b.entered != nil {
		close(b.entered)
		b.entered = nil
	}
	n, err := b.ReadCloser.Read(p)
	b.read += n
	return n, err
}

// A 201 whose body is cut in transit does not end the operation: the
// caller's next call with the same operation id sends the same key, and the
// server replays the outcome instead of charging again.
func TestOperationRetriedAfterCutBodyIsReplayed(t *testing.T) {
	var executions atomic.Int32
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := executions.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":"pay_%d","note":"a body long enough to be cut in the middle"}`, n)
	})
	mw := idemserver.Middleware(idemserver.NewMemoryStore())(charge)
	var keys recorder[string]
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if keys.add(r.Header.Get("Idempotency-Key")) > 1 {
			mw.ServeHTTP(w, r)
			return
		}
		// The handler runs and its outcome is stored, but the response is
		// cut halfway through its body on the way back.
		rec := httptest.NewRecorder()
		mw.ServeHTTP(rec, r)
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		defer conn.Close()
		writeCutResponse(buf, rec.Code, rec.Header(), rec.Body.Bytes(), rec.Body.Len()/2)
	}))
	t.Cleanup(srv.Close)

	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait))
	ctx := WithOperation(context.Background(), "charge-42")

	resp, err := tr.RoundTrip(post(t, ctx, srv.URL, `{"amount":100}`))
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	_, err = io.ReadAll(resp.Body)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF, "the body was cut")
	resp.Body.Close()

	// The caller does not know the payment id: it calls again.
	resp, err = tr.RoundTrip(post(t, ctx, srv.URL, `{"amount":100}`))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()

	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"))
	assert.Contains(t, string(body), `"pay_1"`)
	assert.Equal(t, int32(1), executions.Load(), "the charge ran once")
	sent := keys.all()
	require.Len(t, sent, 2)
	assert.Equal(t, sent[0], sent[1])
	assert.Empty(t, pendingKeys(t, store), "released once the replay was read")
}

// A response that cannot have a body (a 204, a 304, the answer to a HEAD)
// is delivered whole with its header, over HTTP/2 as over HTTP/1: its key
// is released before RoundTrip returns, whatever the body the base
// transport gives it (HTTP/2's is not http.NoBody).
func TestOperationKeyReleasedAtOnceWithoutBodyOverHTTP2(t *testing.T) {
	tests := []struct {
		name   string
		method string
		code   int
	}{
		{"204", http.MethodPost, http.StatusNoContent},
		{"304", http.MethodPost, http.StatusNotModified},
		{"HEAD", http.MethodHead, http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(tt.code)
			}))
			srv.EnableHTTP2 = true
			srv.StartTLS()
			t.Cleanup(srv.Close)
			base := srv.Client().Transport.(*http.Transport)
			t.Cleanup(base.CloseIdleConnections)
			store := NewMemoryKeyStore()
			tr := NewTransport(base, WithKeyStore(store), WithKeyedMethods(http.MethodPost, http.MethodHead))
			req, err := http.NewRequestWithContext(WithOperation(context.Background(), "op"), tt.method, srv.URL, nil)
			require.NoError(t, err)

			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			require.Equal(t, 2, resp.ProtoMajor)
			require.Equal(t, tt.code, resp.StatusCode)
			assert.Empty(t, pendingKeys(t, store), "released before RoundTrip returns")
			resp.Body.Close()
		})
	}
}
