package idemhttp

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestStatusRetries(t *testing.T) {
	tests := []struct {
		status     int
		retryAfter string
		retried    bool
	}{
		{408, "", true}, {425, "", true}, {429, "", true}, {500, "", true},
		{502, "", true}, {503, "", true}, {504, "", true},
		{429, "0", true}, {503, "0", true},
		{409, "0", true}, // "still in progress"
		{409, "", false}, // a real conflict
		// A Retry-After that is not valid is ignored, so the 409 carries
		// none: a real conflict too.
		{409, "soon", false}, {409, "-1", false}, {409, "1.5", false}, {409, "0, 1", false},
		{409, "Sun, 06 Nov 1994 08:49:37 GMT", true}, // an HTTP-date, passed
		{400, "", false}, {401, "", false}, {403, "", false}, {404, "", false},
		{410, "", false}, {422, "", false}, {501, "", false}, {505, "", false},
		{400, "0", false}, {200, "", false}, {201, "", false}, {302, "", false},
	}
	for _, tt := range tests {
		for _, method := range []string{"GET", "POST"} {
			t.Run(fmt.Sprintf("%s %d retry-after=%q", method, tt.status, tt.retryAfter), func(t *testing.T) {
				var headers []string
				if tt.retryAfter != "" {
					headers = []string{"Retry-After", tt.retryAfter}
				}
				if tt.status == 302 {
					headers = append(headers, "Location", "/elsewhere")
				}
				srv := newServer(t, status(tt.status, headers...))
				req, err := http.NewRequest(method, srv.URL, nil)
				require.NoError(t, err)

				resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait), WithMaxAttempts(3)), req)

				assert.Equal(t, tt.status, resp.StatusCode, "the last outcome is returned")
				want := int32(1)
				if tt.retried {
					want = 3
				}
				assert.Equal(t, want, srv.hits.Load())
			})
		}
	}
}

// A POST without a key (its method removed from the keyed set) must not be
// sent twice unless the first attempt provably never left.
func TestUnkeyedPostRetriedOnlyWhenNothingWasSent(t *testing.T) {
	t.Run("retryable status is not retried", func(t *testing.T) {
		srv := newServer(t, status(503))
		req := post(t, context.Background(), srv.URL, "x")
		resp := do(t, NewTransport(newBaseTransport(t), WithKeyedMethods(), WithBackoff(noWait)), req)
		assert.Equal(t, 503, resp.StatusCode)
		assert.Equal(t, int32(1), srv.hits.Load())
	})
	t.Run("connection lost after sending is not retried", func(t *testing.T) {
		srv := newServer(t, hangUp, status(200))
		req := post(t, context.Background(), srv.URL, "x")
		_, err := NewTransport(newBaseTransport(t), WithKeyedMethods(), WithBackoff(noWait)).RoundTrip(req)
		require.Error(t, err)
		assert.Equal(t, int32(1), srv.hits.Load())
	})
	t.Run("keyed POST is retried after lost connection", func(t *testing.T) {
		srv := newServer(t, hangUp, status(200))
		resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), post(t, context.Background(), srv.URL, "x"))
		assert.Equal(t, 200, resp.StatusCode)
		assert.Equal(t, int32(2), srv.hits.Load())
	})
	for _, tt := range []struct {
		name string
		base func(t *testing.T) http.RoundTripper
	}{
		{"body", func(t *testing.T) http.RoundTripper { return newBaseTransport(t) }},
		// A base transport may send a fresh copy of the body from GetBody
		// instead of the body it was given, as net/http does when a write
		// on a reused connection fails before any byte left: it closes the
		// first body unread and rewinds.
		{"copy from GetBody", func(t *testing.T) http.RoundTripper {
			inner := newBaseTransport(t)
			return roundTripFunc(func(r *http.Request) (*http.Response, error) {
				require.NoError(t, r.Body.Close())
				fresh, err := r.GetBody()
				if err != nil {
					return nil, err
				}
				r = r.Clone(r.Context())
				r.Body = fresh
				return inner.RoundTrip(r)
			})
		}},
	} {
		t.Run(tt.name+" failing like a refused dial after the header went out is not retried", func(t *testing.T) {
			// The server's handler runs once the header has arrived, before
			// the body: one that takes its arguments from the URL acts then.
			var arrivals atomic.Int32
			arrived := make(chan struct{}, 1)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				arrivals.Add(1)
				arrived <- struct{}{}
				_, _ = io.Copy(io.Discard, r.Body)
			}))
			t.Cleanup(srv.Close)
			// A body streamed from elsewhere fails with that source's error,
			// which net/http returns as the attempt's.
			dialErr := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
			body := func() io.ReadCloser {
				return io.NopCloser(readerFunc(func([]byte) (int, error) {
					<-arrived
					return 0, dialErr
				}))
			}
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/charge?amount=100", body())
			require.NoError(t, err)
			req.GetBody = func() (io.ReadCloser, error) { return body(), nil }

			_, err = NewTransport(tt.base(t), WithKeyedMethods(), WithBackoff(noWait)).RoundTrip(req)
			require.Error(t, err)
			assert.ErrorIs(t, err, syscall.ECONNREFUSED)
			var re *RetryError
			require.ErrorAs(t, err, &re)
			assert.Equal(t, ReasonNotRetryable, re.Reason)
			assert.Equal(t, int32(1), arrivals.Load(), "the handler ran again")
		})
	}
	t.Run("refused dial is retried", func(t *testing.T) {
		addr := closedPort(t)
		var attempts []Attempt
		tr := NewTransport(newBaseTransport(t), WithKeyedMethods(), WithBackoff(noWait),
			WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }))
		_, err := tr.RoundTrip(post(t, context.Background(), "http://"+addr, "x"))
		require.Error(t, err)
		assert.ErrorIs(t, err, syscall.ECONNREFUSED)
		assert.ErrorIs(t, err, ErrAttemptsExhausted)
		assert.Len(t, attempts, DefaultMaxAttempts)
	})
}

// closedPort returns a loopback address on which nothing listens.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

func TestErrorRetries(t *testing.T) {
	dialRefused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	readReset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	tests := []struct {
		name string
		err  error
		// attempts made for an idempotent GET and for an unkeyed POST
		getAttempts, postAttempts int
	}{
		{"dial refused", dialRefused, 3, 3},
		{"DNS timeout", &net.DNSError{Err: "timeout", Name: "x", IsTimeout: true}, 3, 3},
		{"no such host", &net.DNSError{Err: "no such host", Name: "x", IsNotFound: true}, 1, 1},
		{"connection reset", readReset, 3, 1},
		{"broken pipe", syscall.EPIPE, 3, 1},
		{"unexpected EOF", io.ErrUnexpectedEOF, 3, 1},
		{"EOF before response", fmt.Errorf("wrapped: %w", io.EOF), 3, 1},
		{"timeout", timeoutErr{}, 3, 1},
		{"HTTP/2 GOAWAY", errors.New("http2: server sent GOAWAY and closed the connection; LastStreamID=1"), 3, 1},
		{"HTTP/2 stream reset", errors.New("stream error: stream ID 3; INTERNAL_ERROR"), 3, 1},
		{"HTTP/2 graceful GOAWAY net/http could not retry", errors.New("http2: Transport: cannot retry err " +
			"[http2: Transport received Server's graceful shutdown GOAWAY] after Request.Body was written; " +
			"define Request.GetBody to avoid this error"), 3, 1},
		{"unknown authority", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, 1, 1},
		{"bad hostname", x509.HostnameError{Host: "x"}, 1, 1},
		{"expired certificate", x509.CertificateInvalidError{Reason: x509.Expired}, 1, 1},
		{"not TLS", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, 1, 1},
		{"malformed request", errors.New(`unsupported protocol scheme "gopher"`), 1, 1},
	}
	for _, tt := range tests {
		for _, method := range []string{"GET", "POST"} {
			t.Run(method+" "+tt.name, func(t *testing.T) {
				calls := 0
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
					calls++
					return nil, tt.err
				})
				req, err := http.NewRequest(method, "http://x.invalid", nil)
				require.NoError(t, err)
				tr := NewTransport(base, WithKeyedMethods(), WithBackoff(noWait), WithMaxAttempts(3))

				resp, err := tr.RoundTrip(req)

				assert.Nil(t, resp)
				assert.ErrorIs(t, err, tt.err)
				want := tt.getAttempts
				if method == "POST" {
					want = tt.postAttempts
				}
				assert.Equal(t, want, calls)
				var re *RetryError
				require.ErrorAs(t, err, &re)
				assert.Equal(t, want, re.Attempts)
				assert.Contains(t, err.Error(), fmt.Sprintf("%d attempt", want))
			})
		}
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestCallerCancellationIsNotRetried(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	calls := 0
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		calls++
		cancel()
		return nil, r.Context().Err()
	})
	req := post(t, ctx, "http://x.invalid", "x")
	_, err := NewTransport(base, WithBackoff(noWait)).RoundTrip(req)
	assert.ErrorIs(t, err, context.Canceled)
	var re *RetryError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, ReasonCanceled, re.Reason)
	assert.Equal(t, 1, calls)
}

func TestAttemptTimeoutIsRetried(t *testing.T) {
	calls := 0
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		calls++
		if calls == 1 {
			<-r.Context().Done() // the first attempt hangs until its timeout
			return nil, r.Context().Err()
		}
		return okResponse(r, 200), nil
	})
	req := post(t, context.Background(), "http://x.invalid", "x")
	resp, err := NewTransport(base, WithBackoff(noWait), WithAttemptTimeout(1)).RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 2, calls)
}

// WithAttemptTimeout bounds the attempt through the reading of its
// response body too: a body that stalls after the header fails once the
// attempt's time is up, and the operation's key stays pending, since the
// outcome never reached the caller whole.
func TestAttemptTimeoutBoundsTheResponseBody(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			resp := okResponse(r, 200)
			resp.Body = io.NopCloser(readerFunc(func([]byte) (int, error) {
				<-r.Context().Done() // the body stalls until the attempt ends
				return 0, r.Context().Err()
			}))
			return resp, nil
		})
		store := NewMemoryKeyStore()
		tr := NewTransport(base, WithKeyStore(store), WithAttemptTimeout(time.Second))
		start := time.Now()

		resp, err := tr.RoundTrip(post(t, WithOperation(context.Background(), "op"), "http://x.invalid", "x"))
		require.NoError(t, err)
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()

		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, time.Second, time.Since(start))
		assert.Len(t, pendingKeys(t, store), 1)
	})
}

func TestFinalErrorNamesAttempts(t *testing.T) {
	srv := newServer(t, hangUp)
	_, err := NewTransport(newBaseTransport(t), WithBackoff(noWait)).RoundTrip(post(t, context.Background(), srv.URL, "x"))
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrAttemptsExhausted)
	assert.Contains(t, err.Error(), "idemhttp: 4 attempts, attempts exhausted: ")
	var re *RetryError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, 4, re.Attempts)
	assert.Equal(t, ReasonAttemptsExhausted, re.Reason)
}

func TestRetryErrorMessages(t *testing.T) {
	assert.Equal(t, "idemhttp: 1 attempt, not retryable: x", (&RetryError{Attempts: 1, Reason: ReasonNotRetryable, Err: errors.New("x")}).Error())
	assert.Equal(t, "idemhttp: 0 attempts, circuit open", (&RetryError{Reason: ReasonCircuitOpen}).Error())
	assert.ErrorIs(t, &RetryError{Reason: ReasonCircuitOpen}, ErrCircuitOpen)
	assert.ErrorIs(t, &RetryError{Reason: ReasonBudgetExhausted, Err: io.EOF}, ErrBudgetExhausted)
	assert.NotErrorIs(t, &RetryError{Reason: ReasonNotRetryable, Err: io.EOF}, ErrAttemptsExhausted)
}

// A request whose Method is empty is a GET, as net/http sends it, and is
// retried as one.
func TestEmptyMethodIsRetriedAsGet(t *testing.T) {
	srv := newServer(t, status(503), status(200))
	req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	require.NoError(t, err)
	req.Method = ""
	var attempts []Attempt
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }))

	resp := do(t, tr, req)

	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, int32(2), srv.hits.Load())
	assert.Equal(t, http.MethodGet, srv.received()[0].Method)
	assert.Empty(t, srv.received()[0].Key)
	require.Len(t, attempts, 2)
	assert.Equal(t, http.MethodGet, attempts[0].Method)
}

// readerFunc adapts a function to io.Reader.
type readerFunc func(p []byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }
