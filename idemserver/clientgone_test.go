package idemserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errClientGone = errors.New("client timed out")

// TestClientGoneIsNotStored sends a request whose client gives up after a
// second, while the handler is still working, and then retries it. A
// handler that gave up too, without answering, did not act, so its claim is
// released and the retry runs it; one that finished its response anyway
// has its response stored and replayed.
func TestClientGoneIsNotStored(t *testing.T) {
	for _, tt := range []struct {
		name string
		// gaveUp is what the handler does when its context ends.
		gaveUp     func(w http.ResponseWriter)
		wantStatus int    // the first response's status
		wantType   string // its problem type, for a problem
		stored     bool
	}{
		{
			name:       "returns without writing",
			gaveUp:     func(http.ResponseWriter) {},
			wantStatus: http.StatusServiceUnavailable, wantType: ProblemRequestCanceled,
		},
		{
			name:       "sets header fields and returns without writing",
			gaveUp:     func(w http.ResponseWriter) { w.Header().Set("X-Partial", "yes") },
			wantStatus: http.StatusServiceUnavailable, wantType: ProblemRequestCanceled,
		},
		{
			name:       "answers 499",
			gaveUp:     func(w http.ResponseWriter) { w.WriteHeader(499) },
			wantStatus: 499,
		},
		{
			name: "finishes its response",
			gaveUp: func(w http.ResponseWriter) {
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "charged")
			},
			wantStatus: http.StatusCreated,
			stored:     true,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := NewMemoryStore()
				var events []Event
				h := &countingHandler{}
				mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						select {
						case <-r.Context().Done():
							h.calls.Add(1)
							tt.gaveUp(w)
						case <-time.After(5 * time.Second):
							h.ServeHTTP(w, r)
						}
					}))

				ctx, cancel := context.WithTimeoutCause(t.Context(), time.Second, errClientGone)
				defer cancel()
				first := serve(mw, newRequest(http.MethodPost, "/charges", "k", "b").WithContext(ctx))
				require.Len(t, events, 1)
				if tt.wantType != "" {
					decodeProblem(t, first, tt.wantType, tt.wantStatus)
					assert.NotEmpty(t, first.Header().Get("Retry-After"))
					assert.Empty(t, first.Header().Get("X-Partial"), "the handler's fields do not reach the client")
				} else {
					assert.Equal(t, tt.wantStatus, first.Code)
				}
				assert.Equal(t, tt.wantStatus, events[0].Status)

				retry := serve(mw, newRequest(http.MethodPost, "/charges", "k", "b"))
				if tt.stored {
					assert.Equal(t, OutcomeExecuted, events[0].Outcome)
					assert.NoError(t, events[0].Err)
					assertReplayed(t, true, retry, h)
					assert.Equal(t, first.Body.String(), retry.Body.String())
					return
				}
				assert.Equal(t, OutcomeReleased, events[0].Outcome)
				assert.ErrorIs(t, events[0].Err, errClientGone, "the observer learns why")
				assert.Equal(t, http.StatusCreated, retry.Code)
				assert.Equal(t, "call 2", retry.Body.String())
				assertReplayed(t, false, retry, h)
			})
		})
	}
}

// TestClientGoneStoreContext checks that the request's own context decides,
// even when a store gives the handler a context of its own that does not
// end with the request's.
func TestClientGoneStoreContext(t *testing.T) {
	store := newStubStore()
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := store.MemoryStore.Claim(ctx, c)
		res.Context = context.WithoutCancel(ctx)
		return res, err
	}
	ctx, cancel := context.WithCancelCause(t.Context())
	calls := 0
	mw := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		if calls == 1 {
			cancel(errClientGone) // the client leaves; the handler gives up
		}
	}))
	first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))
	decodeProblem(t, first, ProblemRequestCanceled, http.StatusServiceUnavailable)
	assert.Zero(t, store.Len(), "claim released")
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, 2, calls)
}

// brokenWriter is a client's ResponseWriter whose connection breaks after
// the first write, or at the first flush.
type brokenWriter struct {
	*httptest.ResponseRecorder
	writes     int
	flushBreak bool
}

var errBrokenPipe = errors.New("write: broken pipe")

func (b *brokenWriter) Write(p []byte) (int, error) {
	if b.writes++; b.writes > 1 {
		return 0, errBrokenPipe
	}
	return b.ResponseRecorder.Write(p)
}

func (b *brokenWriter) WriteString(s string) (int, error) { return b.Write([]byte(s)) }

func (b *brokenWriter) FlushError() error {
	if b.flushBreak {
		return errBrokenPipe
	}
	b.ResponseRecorder.Flush()
	return nil
}

// A streaming handler whose client went away mid-stream is told by a
// failed write or flush, and stops, as handlers do: what it wrote is not
// its whole body. Stored, it was replayed as a complete response (with a
// Content-Length to match), a cut body passed off as whole; only its
// status and header fields are kept, as for a body too large to store.
func TestStreamCutByClientKeepsNoBody(t *testing.T) {
	for _, tt := range []struct {
		name   string
		client func() http.ResponseWriter
	}{
		{"write fails", func() http.ResponseWriter { return &brokenWriter{ResponseRecorder: httptest.NewRecorder()} }},
		{"flush fails", func() http.ResponseWriter {
			return &brokenWriter{ResponseRecorder: httptest.NewRecorder(), flushBreak: true}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var events []Event
			var errs []error
			mw := Middleware(nil, WithObserver(func(e Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Location", "/exports/1")
					w.Header().Set("Content-Type", "text/csv")
					w.WriteHeader(http.StatusCreated)
					for _, row := range []string{"a,1\n", "b,2\n", "c,3\n"} {
						_, err := io.WriteString(w, row)
						if err == nil {
							err = http.NewResponseController(w).Flush()
						}
						if err != nil {
							errs = append(errs, err)
							return
						}
					}
				}))
			mw.ServeHTTP(tt.client(), newRequest(http.MethodPost, "/exports", "k", "b"))
			require.Len(t, events, 1)
			assert.Equal(t, OutcomeExecuted, events[0].Outcome, "the status reached the client: it is the outcome")
			assert.Equal(t, []error{errBrokenPipe}, errs, "the handler was told")

			replay := serve(mw, newRequest(http.MethodPost, "/exports", "k", "b"))
			assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
			decodeProblem(t, replay, ProblemResponseNotStored, http.StatusCreated)
			assert.Equal(t, "/exports/1", replay.Header().Get("Location"))
		})
	}
}

// The same over a connection the client closes mid-stream.
func TestStreamCutByClientOverConnection(t *testing.T) {
	gone := make(chan struct{})
	var writeErr error
	events := make(chan Event, 2)
	observe := WithObserver(func(e Event) { events <- e })
	srv := httptest.NewServer(Middleware(nil, WithMaxResponseBytes(64<<20), observe)(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			rc := http.NewResponseController(w)
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "row 0\n")
			_ = rc.Flush()
			<-gone
			row := strings.Repeat("x", 4<<10) + "\n"
			for range 1 << 12 { // 16 MiB at most; the broken connection fails long before
				if _, writeErr = io.WriteString(w, row); writeErr == nil {
					writeErr = rc.Flush()
				}
				if writeErr != nil {
					return
				}
			}
		})))
	defer srv.Close()

	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("b"))
	require.NoError(t, err)
	req.Header.Set(DefaultKeyHeader, "k")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	line := make([]byte, len("row 0\n"))
	_, err = io.ReadFull(resp.Body, line)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close()) // closes the connection, the body being unread
	close(gone)
	assert.Equal(t, OutcomeExecuted, (<-events).Outcome)
	require.Error(t, writeErr, "the handler saw the client go")

	replay, body := postKeyed(t, srv.Client(), srv.URL, "k")
	assert.Equal(t, http.StatusCreated, replay.StatusCode)
	assert.Equal(t, "true", replay.Header.Get(ReplayedHeader))
	assert.True(t, strings.Contains(body, ProblemResponseNotStored), "a cut body is replayed as whole: %d bytes: %.300q", len(body), body)
}

// A client that has the whole of a body whose length was declared may
// close it before the stream ends: over HTTP/2 that resets the stream, and
// a flush the handler makes after its last write then fails. The client
// got the whole response, and the handler had written all of it: the body
// is stored, and a replay is the same answer. Without a declared length,
// no client has the whole body before the stream ends, and a failed flush
// still keeps it from being stored.
func TestFlushFailsAfterWholeDeclaredBody(t *testing.T) {
	for _, declared := range []bool{true, false} {
		t.Run("declared "+strconv.FormatBool(declared), func(t *testing.T) {
			body := strings.Repeat("x", 10<<10)
			read := make(chan struct{})
			var flushErr error
			events := make(chan Event, 2)
			srv := httptest.NewUnstartedServer(Middleware(nil, WithObserver(func(e Event) { events <- e }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if declared {
						w.Header().Set("Content-Length", strconv.Itoa(len(body)))
					}
					w.Header().Set("Content-Type", "text/plain")
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, body)
					rc := http.NewResponseController(w)
					if err := rc.Flush(); err != nil {
						flushErr = err
						return
					}
					<-read
					<-r.Context().Done() // the client reset the stream
					// The server cancels the request's context a moment
					// before it fails the stream's writes.
					for range 10000 {
						if flushErr = rc.Flush(); flushErr != nil {
							return
						}
						time.Sleep(time.Millisecond)
					}
				})))
			srv.EnableHTTP2 = true
			srv.StartTLS()
			defer srv.Close()

			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("b"))
			require.NoError(t, err)
			req.Header.Set(DefaultKeyHeader, "k")
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			require.Equal(t, 2, resp.ProtoMajor)
			got := make([]byte, len(body))
			_, err = io.ReadFull(resp.Body, got)
			require.NoError(t, err)
			require.NoError(t, resp.Body.Close()) // resets the stream, which has not ended
			close(read)
			assert.Equal(t, OutcomeExecuted, (<-events).Outcome)
			require.Error(t, flushErr, "the handler's last flush failed")

			replay, replayBody := postKeyed(t, srv.Client(), srv.URL, "k")
			assert.Equal(t, "true", replay.Header.Get(ReplayedHeader))
			assert.Equal(t, http.StatusCreated, replay.StatusCode)
			if declared {
				assert.Equal(t, "text/plain", replay.Header.Get("Content-Type"))
				assert.True(t, replayBody == string(got), "the replay is the answer the client got, not %.200q", replayBody)
				return
			}
			assert.Contains(t, replayBody, ProblemResponseNotStored)
		})
	}
}
