package idemserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReplayedHeaders(t *testing.T) {
	for _, tt := range []struct {
		name     string
		field    string
		value    string
		opts     []Option
		replayed bool
	}{
		{"ordinary field", "X-Order", "1", nil, true},
		{"content type", "Content-Type", "application/json", nil, true},
		{"location", "Location", "/orders/1", nil, true},
		{"connection", "Connection", "X-Conn-Named", nil, false},
		{"keep-alive", "Keep-Alive", "timeout=5", nil, false},
		{"proxy-authenticate", "Proxy-Authenticate", "Basic", nil, false},
		{"proxy-connection", "Proxy-Connection", "keep-alive", nil, false},
		{"te", "Te", "trailers", nil, false},
		{"trailer", "Trailer", "X-Checksum", nil, false},
		{"transfer-encoding", "Transfer-Encoding", "gzip", nil, false},
		{"upgrade", "Upgrade", "h2c", nil, false},
		{"named in connection", "X-Conn-Named", "secret", nil, false},
		{"set-cookie", "Set-Cookie", "session=abc", nil, false},
		{"set-cookie allowed", "Set-Cookie", "session=abc", []Option{WithReplayedHeaders("set-cookie")}, true},
		{"hop-by-hop never allowed", "Keep-Alive", "timeout=5", []Option{WithReplayedHeaders("Keep-Alive")}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			mw := Middleware(nil, tt.opts...)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set(tt.field, tt.value)
				if tt.field == "X-Conn-Named" {
					w.Header().Set("Connection", "X-Conn-Named")
				}
				w.WriteHeader(http.StatusCreated)
			}))
			first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			require.Equal(t, tt.value, first.Header().Get(tt.field), "the first response is untouched")
			replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			require.Equal(t, "true", replay.Header().Get(ReplayedHeader))
			if tt.replayed {
				assert.Equal(t, tt.value, replay.Header().Get(tt.field))
			} else {
				assert.Empty(t, replay.Header().Values(tt.field))
			}
		})
	}
}

func TestReplayableIsCaseInsensitive(t *testing.T) {
	h := http.Header{"connection": {"close, x-named"}, "X-Named": {"1"}, "keep-alive": {"1"}, "x-kept": {"1"}}
	got := replayable(h, nil)
	assert.Equal(t, http.Header{"x-kept": {"1"}}, got)
}

func TestReplayDoesNotShareStoredValues(t *testing.T) {
	mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Vary", "Accept")
		w.WriteHeader(http.StatusCreated)
	}))
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	// A layer around the middleware adds to the replayed header.
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Vary", "Origin")
		mw.ServeHTTP(w, r)
		w.Header().Add("Vary", "Cookie")
	})
	for range 2 {
		w := serve(outer, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, []string{"Accept"}, w.Header().Values("Vary")[:1])
	}
	w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, []string{"Accept"}, w.Header().Values("Vary"))
}

// flushRecorder is a ResponseRecorder that reports each flush.
type flushRecorder struct {
	*httptest.ResponseRecorder
	flushes     int
	bodyAtFlush []string
}

func (f *flushRecorder) Flush() {
	f.flushes++
	f.bodyAtFlush = append(f.bodyAtFlush, f.Body.String())
	f.ResponseRecorder.Flush()
}

func TestFlushStreamsAndStillStores(t *testing.T) {
	for _, tt := range []struct {
		name  string
		flush func(w http.ResponseWriter) error
	}{
		{"http.Flusher", func(w http.ResponseWriter) error { w.(http.Flusher).Flush(); return nil }},
		{"ResponseController", func(w http.ResponseWriter) error { return http.NewResponseController(w).Flush() }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var flushErr error
			mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, "event 1\n")
				flushErr = tt.flush(w)
				_, _ = io.WriteString(w, "event 2\n")
			}))
			w := &flushRecorder{ResponseRecorder: httptest.NewRecorder()}
			mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
			require.NoError(t, flushErr)
			assert.Equal(t, []string{"event 1\n"}, w.bodyAtFlush, "the flush reaches the client")
			assert.Equal(t, "event 1\nevent 2\n", w.Body.String())

			replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
			assert.Equal(t, "event 1\nevent 2\n", replay.Body.String())
			assert.Equal(t, "text/event-stream", replay.Header().Get("Content-Type"))
		})
	}
}

// A streamed response without a Content-Type of its own gets the one
// net/http sniffs from the first bytes it is handed, or none if its status
// went out before any body; a replay, written whole, carries the same, not
// one sniffed from the whole body.
func TestStreamedResponseReplaysItsContentType(t *testing.T) {
	const page = "<html><body>paid</body></html>"
	for _, tt := range []struct {
		name    string
		handler http.HandlerFunc
		want    []string // the first response's Content-Type values
	}{
		{
			name: "status flushed before the body",
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
				w.(http.Flusher).Flush()
				_, _ = io.WriteString(w, page)
			},
		},
		{
			name: "first part sniffed otherwise than the whole",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, "  ")
				_ = http.NewResponseController(w).Flush()
				_, _ = io.WriteString(w, page)
			},
			want: []string{"text/plain; charset=utf-8"},
		},
		{
			name: "first part sniffed as the whole",
			handler: func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.WriteString(w, page[:12])
				w.(http.Flusher).Flush()
				_, _ = io.WriteString(w, page[12:])
			},
			want: []string{"text/html; charset=utf-8"},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(Middleware(nil)(tt.handler))
			defer srv.Close()
			post := func() *http.Response {
				req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("b"))
				require.NoError(t, err)
				req.Header.Set(DefaultKeyHeader, "k")
				resp, err := srv.Client().Do(req)
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.NoError(t, resp.Body.Close())
				assert.Equal(t, page, strings.TrimSpace(string(body)))
				return resp
			}
			first, replay := post(), post()
			require.Equal(t, "true", replay.Header.Get(ReplayedHeader))
			assert.Equal(t, tt.want, first.Header.Values("Content-Type"), "the first response")
			assert.Equal(t, tt.want, replay.Header.Values("Content-Type"), "the replay")
		})
	}
}

// Handlers that write their responses in many ways (fields set and
// deleted, statuses, 1xx, flushes, bodies that sniff as different types,
// a Transfer-Encoding of their own, bodies over the storage limit), behind
// each kind of store, over HTTP/1 and HTTP/2, reach the client the same on
// the first response and on its replay: the same status, the same header
// fields but those of the connection and the replay mark, and the same
// body. The steps are drawn from a seeded source, so a failure names a
// seed that repeats it.
func TestRandomHandlersReplayTheirFirstResponse(t *testing.T) {
	type step struct {
		op  string
		arg string
	}
	bodies := []string{"", " ", "<html>", "hello", `{"a":1}`, "\x00\x01binary", "%PDF-1.4", strings.Repeat("x", 600)}
	statuses := []string{"200", "201", "204", "304", "400", "409", "410", "422"}
	ops := []string{"type", "status", "write", "write", "flush", "encoding", "field", "no type", "103", "transfer"}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 0))
		steps := make([]step, 1+rng.IntN(6))
		for i := range steps {
			s := step{op: ops[rng.IntN(len(ops))]}
			switch s.op {
			case "type":
				s.arg = []string{"text/plain", "application/json", ""}[rng.IntN(3)]
			case "status":
				s.arg = statuses[rng.IntN(len(statuses))]
			case "write":
				s.arg = bodies[rng.IntN(len(bodies))]
			case "encoding":
				s.arg = []string{"gzip", ""}[rng.IntN(2)]
			case "transfer":
				s.arg = []string{"chunked", "identity", ""}[rng.IntN(3)]
			case "field":
				s.arg = strconv.Itoa(rng.IntN(3))
			}
			steps[i] = s
		}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			for _, s := range steps {
				switch s.op {
				case "type", "encoding", "transfer":
					name := map[string]string{"type": "Content-Type", "encoding": "Content-Encoding", "transfer": "Transfer-Encoding"}[s.op]
					if s.arg == "" {
						w.Header().Del(name)
					} else {
						w.Header().Set(name, s.arg)
					}
				case "status":
					code, _ := strconv.Atoi(s.arg)
					w.WriteHeader(code)
				case "write":
					_, _ = io.WriteString(w, s.arg)
				case "flush":
					w.(http.Flusher).Flush()
				case "field":
					w.Header().Set("X-Step", s.arg)
				case "no type":
					w.Header()["Content-Type"] = nil
				case "103":
					w.WriteHeader(http.StatusEarlyHints)
				}
			}
		})
		stores := []func() Store{
			func() Store { return NewMemoryStore() },
			func() Store { return newStubStore() },
			func() Store { return holdingStore{newStubStore()} },
		}
		limit := []int64{4, 700, DefaultMaxResponseBytes}[rng.IntN(3)]
		// The first response is stored when the observer hears of it; a
		// flushed one may reach the client before that.
		stored := make(chan struct{}, 2)
		mw := Middleware(stores[rng.IntN(len(stores))](), WithMaxResponseBytes(limit),
			WithObserver(func(Event) { stored <- struct{}{} }))(h)
		srv := httptest.NewUnstartedServer(mw)
		http2 := seed%2 == 1
		srv.EnableHTTP2 = http2
		srv.StartTLS()
		client := srv.Client()
		// The body is read as sent, whatever its Content-Encoding.
		client.Transport.(*http.Transport).DisableCompression = true
		post := func() (int, http.Header, string) {
			req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("b"))
			require.NoError(t, err)
			req.Header.Set(DefaultKeyHeader, "k")
			resp, err := client.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, http2, resp.ProtoMajor == 2)
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err, "seed %d: %+v", seed, steps)
			<-stored
			h := resp.Header.Clone()
			for _, k := range []string{"Date", "Content-Length", "Transfer-Encoding", ReplayedHeader} {
				delete(h, k)
			}
			return resp.StatusCode, h, string(body)
		}
		status, header, body := post()
		replayStatus, replayHeader, replayBody := post()
		client.CloseIdleConnections()
		srv.Close()
		if int64(len(body)) > limit {
			continue // replayed as a problem, by design
		}
		if !assert.Equal(t, status, replayStatus, "seed %d: %+v", seed, steps) ||
			!assert.Equal(t, header, replayHeader, "seed %d: %+v", seed, steps) ||
			!assert.Equal(t, body, replayBody, "seed %d: %+v", seed, steps) {
			return
		}
	}
}

func TestResponseIsHeldUntilStored(t *testing.T) {
	var w *flushRecorder
	store := newStubStore()
	var wroteBeforeComplete bool
	store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		wroteBeforeComplete = w.Body.Len() > 0 || w.Code != http.StatusOK || w.flushes > 0
		return store.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	mw := Middleware(store)(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rw.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(rw, "accepted")
	}))
	w = &flushRecorder{ResponseRecorder: httptest.NewRecorder()}
	mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.False(t, wroteBeforeComplete, "the client saw the response before it was stored")
	assert.Equal(t, http.StatusAccepted, w.Code)
	assert.Equal(t, "accepted", w.Body.String())
	assert.Equal(t, "8", w.Header().Get("Content-Length"))
}

// hijackRecorder is a ResponseRecorder whose connection could be hijacked.
type hijackRecorder struct {
	*httptest.ResponseRecorder
	hijacked bool
}

func (h *hijackRecorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	h.hijacked = true
	return nil, nil, errors.New("test hijack")
}

func TestHijackIsRefused(t *testing.T) {
	for _, tt := range []struct {
		name   string
		hijack func(w http.ResponseWriter) error
	}{
		{"http.Hijacker", func(w http.ResponseWriter) error { _, _, err := w.(http.Hijacker).Hijack(); return err }},
		{"ResponseController", func(w http.ResponseWriter) error { _, _, err := http.NewResponseController(w).Hijack(); return err }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var err error
			mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				err = tt.hijack(w)
				w.WriteHeader(http.StatusCreated)
			}))
			w := &hijackRecorder{ResponseRecorder: httptest.NewRecorder()}
			mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.ErrorIs(t, err, http.ErrNotSupported)
			assert.False(t, w.hijacked, "the client's connection was reached")
			assert.Equal(t, http.StatusCreated, w.Code)
		})
	}
}

func TestResponseControllerReachesClientWriter(t *testing.T) {
	var err error
	mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err = http.NewResponseController(w).EnableFullDuplex()
	}))
	w := &duplexRecorder{ResponseRecorder: httptest.NewRecorder()}
	mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.NoError(t, err)
	assert.True(t, w.duplex, "full duplex reaches the client's writer")
}

// The deadlines of http.ResponseController reach the client's connection.
func TestResponseControllerSetsDeadlines(t *testing.T) {
	var errs []error
	srv := httptest.NewServer(Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		deadline := time.Now().Add(time.Minute)
		errs = append(errs, rc.SetReadDeadline(deadline), rc.SetWriteDeadline(deadline))
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	resp, _ := postKeyed(t, srv.Client(), srv.URL, "k")
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, []error{nil, nil}, errs)
}

// innermost unwraps w as far as it goes, as libraries that look for the
// server's own ResponseWriter do.
func innermost(w http.ResponseWriter) http.ResponseWriter {
	for {
		u, ok := w.(interface{ Unwrap() http.ResponseWriter })
		if !ok {
			return w
		}
		w = u.Unwrap()
	}
}

// A handler that unwraps its ResponseWriter cannot get past the recorder:
// what it writes, flushes or hijacks there would reach the client and not
// the store (a first response the replays differ from, a hijacked
// connection stored as an empty 200), or reach it before a transactional
// store's commit.
func TestUnwrappedWriterIsRecorded(t *testing.T) {
	for _, tt := range []struct {
		name    string
		handler func(t *testing.T, w http.ResponseWriter)
	}{
		{"write", func(t *testing.T, w http.ResponseWriter) {
			w = innermost(w)
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "made")
		}},
		{"flush", func(t *testing.T, w http.ResponseWriter) {
			w = innermost(w)
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "ma")
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, "de")
		}},
		{"hijack", func(t *testing.T, w http.ResponseWriter) {
			conn, bw, err := http.NewResponseController(innermost(w)).Hijack()
			if !assert.ErrorIs(t, err, http.ErrNotSupported) {
				defer conn.Close()
				_, _ = bw.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 4\r\nConnection: close\r\n\r\nmade")
				_ = bw.Flush()
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "made")
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, hold := range []bool{false, true} {
				stub := newStubStore()
				var store Store = stub
				if hold {
					store = holdingStore{stub}
				}
				early := false
				var client *watchedRecorder
				stub.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
					early = client != nil && client.wroteHeader.Load()
					return stub.MemoryStore.Complete(ctx, k, token, resp, exp)
				}
				mw := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { tt.handler(t, w) }))

				// Over a connection, so that a hijack could succeed.
				srv := httptest.NewServer(mw)
				first, body := postKeyed(t, srv.Client(), srv.URL, "k")
				replay, replayBody := postKeyed(t, srv.Client(), srv.URL, "k")
				srv.Close()
				require.Equal(t, "true", replay.Header.Get(ReplayedHeader), "hold %v", hold)
				assert.Equal(t, http.StatusCreated, first.StatusCode, "hold %v", hold)
				assert.Equal(t, "made", body, "hold %v", hold)
				assert.Equal(t, first.StatusCode, replay.StatusCode, "hold %v", hold)
				assert.Equal(t, body, replayBody, "hold %v", hold)

				if hold {
					client = httptestRecorder()
					mw.ServeHTTP(client, newRequest(http.MethodPost, "/x", "other", "b"))
					assert.False(t, early, "the client got the response before Complete")
					assert.Equal(t, http.StatusCreated, client.Code)
				}
			}
		})
	}
}

type duplexRecorder struct {
	*httptest.ResponseRecorder
	duplex bool
}

func (d *duplexRecorder) EnableFullDuplex() error { d.duplex = true; return nil }

func TestInformationalResponsePassesThrough(t *testing.T) {
	// A 1xx goes to the client at once, before the final response is
	// stored, except over a store that holds responses until Complete
	// returns (a transactional store, whose commit may still fail): then
	// it is dropped, as a replay drops it.
	for _, tt := range []struct {
		name  string
		store func() Store
		hints int // 103s the first request's client gets
	}{
		{"passed through", func() Store { return NewMemoryStore() }, 1},
		{"dropped by a store that holds responses", func() Store { return holdingStore{newStubStore()} }, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			mw := Middleware(tt.store())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Link", "</style.css>; rel=preload")
				w.WriteHeader(http.StatusEarlyHints)
				w.WriteHeader(http.StatusCreated)
			}))
			srv := httptest.NewServer(mw)
			defer srv.Close()
			for i, want := range []struct {
				hints    int
				replayed string
			}{{tt.hints, ""}, {0, "true"}} {
				var hints int
				ctx := httptrace.WithClientTrace(t.Context(), &httptrace.ClientTrace{
					Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
						if code == http.StatusEarlyHints {
							hints++
							if i == 0 && tt.hints == 0 {
								assert.Fail(t, "a 103 reached the client before its response was stored")
							}
						}
						return nil
					},
				})
				r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("b"))
				require.NoError(t, err)
				r.Header.Set(DefaultKeyHeader, "k")
				resp, err := srv.Client().Do(r)
				require.NoError(t, err)
				_ = resp.Body.Close()
				assert.Equal(t, http.StatusCreated, resp.StatusCode, "the final status is stored, not the 103")
				assert.Equal(t, want.hints, hints, "early hints")
				assert.Equal(t, want.replayed, resp.Header.Get(ReplayedHeader))
				assert.Equal(t, "</style.css>; rel=preload", resp.Header.Get("Link"), "the field set for the hint stays in the final response")
			}
			srv.CloseClientConnections()
		})
	}
}

func TestHandlerWritingNothingStores200(t *testing.T) {
	mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusOK, w.Code)
	replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusOK, replay.Code)
	assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
	assert.Equal(t, "0", replay.Header().Get("Content-Length"))
}

// A store other than MemoryStore gets and returns a Response, and its
// replays match those of a MemoryStore, which keeps responses packed.
func TestReplayThroughAnyStore(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header()["X-Multi"] = []string{"a", "b", ""}
		w.Header().Set("Set-Cookie", "s=1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})
	var replays []*httptest.ResponseRecorder
	for _, store := range []Store{NewMemoryStore(), newStubStore()} {
		mw := Middleware(store)(h)
		first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
		assert.Equal(t, first.Code, replay.Code)
		assert.Equal(t, first.Body.String(), replay.Body.String())
		want := first.Header().Clone()
		want.Del("Set-Cookie")
		want.Set(ReplayedHeader, "true")
		assert.Equal(t, want, replay.Header())
		replays = append(replays, replay)
	}
	assert.Equal(t, replays[0].Header(), replays[1].Header())
	assert.Equal(t, replays[0].Body.String(), replays[1].Body.String())
}

// Under net/http a header changed after WriteHeader has no effect; behind
// the middleware too, so the first response equals its replays.
func TestHeaderChangedAfterWriteHeaderDoesNotReachClient(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Early", "1")
		w.WriteHeader(http.StatusCreated)
		w.Header().Set("X-Late", "1")
		w.Header().Del("X-Early")
		_, _ = io.WriteString(w, "made")
	})
	mw := Middleware(nil)(h)
	first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	require.Equal(t, "true", replay.Header().Get(ReplayedHeader))
	for _, rec := range []*httptest.ResponseRecorder{first, replay} {
		assert.Equal(t, "1", rec.Header().Get("X-Early"))
		assert.Empty(t, rec.Header().Get("X-Late"))
		assert.Equal(t, "made", rec.Body.String())
	}
}

// Trailers are set after WriteHeader by design; they still reach the first
// client (they are never replayed).
func TestTrailersReachTheFirstClient(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "made")
		w.Header().Set("X-Checksum", "abc")
		w.Header().Set(http.TrailerPrefix+"X-Extra", "def")
	})
	srv := httptest.NewServer(Middleware(nil)(h))
	defer srv.Close()
	resp, body := postKeyed(t, srv.Client(), srv.URL+"/x", "k")
	assert.Equal(t, "made", body)
	assert.Equal(t, "abc", resp.Trailer.Get("X-Checksum"))
	assert.Equal(t, "def", resp.Trailer.Get("X-Extra"))
}

// A response too large to store replays its status and header fields,
// with a problem document in place of the body and without the fields
// that described it.
func TestTooLargeResponseReplaysItsHeaders(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Location", "/orders/42")
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Etag", `"v1"`)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, strings.Repeat("x", 100))
	})
	mw := Middleware(nil, WithMaxResponseBytes(10))(h)
	first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	// A field of the replay's own request, set in front of the middleware,
	// stays, though its name is like those that describe a body.
	replay := httptest.NewRecorder()
	replay.Header().Set("Content-Security-Policy", "default-src 'self'")
	mw.ServeHTTP(replay, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, "default-src 'self'", replay.Header().Get("Content-Security-Policy"))
	require.Equal(t, "/orders/42", first.Header().Get("Location"))
	assert.Equal(t, http.StatusCreated, replay.Code)
	assert.Equal(t, "/orders/42", replay.Header().Get("Location"))
	assert.Equal(t, "application/problem+json", replay.Header().Get("Content-Type"))
	assert.Empty(t, replay.Header().Get("Etag"))
	assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
}

// postKeyed sends a keyed POST to url and returns the response with its
// body read, so that its trailers have arrived.
func postKeyed(t *testing.T, client *http.Client, url, key string) (*http.Response, string) {
	t.Helper()
	return sendKeyed(t, client, http.MethodPost, url, key)
}

// postKeyedRead is postKeyed for a response whose body may be cut: it
// returns the error reading the body ended with.
func postKeyedRead(t *testing.T, client *http.Client, url, key string) (*http.Response, string, error) {
	t.Helper()
	return sendKeyedRead(t, client, http.MethodPost, url, key)
}

// sendKeyed is postKeyed with another method.
func sendKeyed(t *testing.T, client *http.Client, method, url, key string) (*http.Response, string) {
	t.Helper()
	resp, body, err := sendKeyedRead(t, client, method, url, key)
	require.NoError(t, err)
	return resp, body
}

// sendKeyedRead is postKeyedRead with another method.
func sendKeyedRead(t *testing.T, client *http.Client, method, url, key string) (*http.Response, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader("b"))
	require.NoError(t, err)
	req.Header.Set(DefaultKeyHeader, key)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, string(body), err
}

// A handler may keep the map w.Header() returned before WriteHeader, which
// is the client's own, and edit it later. Under net/http only trailers set
// in it then reach the client; behind the middleware too, whether the
// response is held back or streamed, and its replays equal it.
func TestKeptHeaderMapEditedAfterWriteHeader(t *testing.T) {
	for _, flush := range []bool{false, true} {
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h.Set("Content-Type", "text/plain")
			h.Set("X-Early", "1")
			h.Set("Trailer", "X-Checksum")
			w.WriteHeader(http.StatusCreated)
			h.Set("X-Late", "1")
			h.Del("X-Early")
			h.Set("Content-Type", "application/json")
			h.Set("X-Checksum", "abc")
			h.Set(http.TrailerPrefix+"X-Extra", "def")
			if flush {
				w.(http.Flusher).Flush()
				h.Set("X-After-Flush", "1")
			}
			_, _ = io.WriteString(w, "made")
		})
		for _, behind := range []bool{false, true} {
			t.Run(fmt.Sprintf("flush=%v/middleware=%v", flush, behind), func(t *testing.T) {
				var srv *httptest.Server
				if behind {
					srv = httptest.NewServer(Middleware(nil)(h))
				} else {
					srv = httptest.NewServer(h)
				}
				defer srv.Close()
				resp, body := postKeyed(t, srv.Client(), srv.URL, "k")
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				assert.Equal(t, "made", body)
				assert.Equal(t, "1", resp.Header.Get("X-Early"))
				assert.Equal(t, "text/plain", resp.Header.Get("Content-Type"))
				assert.Empty(t, resp.Header.Values("X-Late"))
				assert.Empty(t, resp.Header.Values("X-After-Flush"))
				assert.Equal(t, "abc", resp.Trailer.Get("X-Checksum"))
				assert.Equal(t, "def", resp.Trailer.Get("X-Extra"))
				if !behind {
					return
				}
				replay, replayBody := postKeyed(t, srv.Client(), srv.URL, "k")
				require.Equal(t, "true", replay.Header.Get(ReplayedHeader))
				assert.Equal(t, http.StatusCreated, replay.StatusCode)
				assert.Equal(t, body, replayBody)
				for _, k := range []string{"X-Early", "Content-Type", "X-Late", "X-After-Flush"} {
					assert.Equal(t, resp.Header.Values(k), replay.Header.Values(k), k)
				}
			})
		}
	}
}

// outerFields is middleware in front of the idempotency middleware: it
// sets fields of its own on every response, one of them unique to the
// request.
func outerFields(next http.Handler) http.Handler {
	var n atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "req-"+strconv.FormatInt(n.Add(1), 10))
		w.Header().Set("Access-Control-Allow-Origin", "*")
		w.Header().Set("Vary", "Origin")
		w.Header().Set("X-Debug", "on")
		next.ServeHTTP(w, r)
	})
}

// Fields set by middleware in front of this one belong to each request:
// the replay carries its own request's, and only the fields the handler set
// or changed are stored and replayed.
func TestOuterFieldsBelongToEachRequest(t *testing.T) {
	var storedHeader http.Header
	stub := newStubStore()
	stub.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		storedHeader = resp.Header.Clone()
		return stub.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Add("Vary", "Accept")
		w.Header()["X-Multi"] = []string{"a", "", "b, c"}
		w.Header().Set("Location", "/orders/1")
		w.Header().Del("X-Debug")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})
	handlerFields := []string{"Content-Type", "Vary", "X-Multi", "Location", "Content-Length"}
	for _, tt := range []struct {
		name  string
		store Store
	}{{"MemoryStore", NewMemoryStore()}, {"other store", stub}} {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(outerFields(Middleware(tt.store)(h)))
			defer srv.Close()
			first, firstBody := postKeyed(t, srv.Client(), srv.URL, "k")
			replay, replayBody := postKeyed(t, srv.Client(), srv.URL, "k")
			require.Equal(t, "true", replay.Header.Get(ReplayedHeader))

			assert.Equal(t, "req-1", first.Header.Get("X-Request-Id"))
			assert.Equal(t, "req-2", replay.Header.Get("X-Request-Id"), "the replay keeps its own request's field")
			for _, resp := range []*http.Response{first, replay} {
				assert.Equal(t, []string{"*"}, resp.Header.Values("Access-Control-Allow-Origin"))
				assert.Equal(t, []string{"Origin", "Accept"}, resp.Header.Values("Vary"),
					"a field the handler changed is the handler's")
			}
			assert.Empty(t, first.Header.Values("X-Debug"), "the handler deleted it")
			assert.Equal(t, "on", replay.Header.Get("X-Debug"),
				"a deleted outer field cannot be deleted from the replay request's response")

			assert.Equal(t, first.StatusCode, replay.StatusCode)
			assert.Equal(t, firstBody, replayBody)
			for _, k := range handlerFields {
				assert.Equal(t, first.Header.Values(k), replay.Header.Values(k), k)
			}
			if tt.store == Store(stub) {
				assert.ElementsMatch(t, handlerFields, slices.Collect(maps.Keys(storedHeader)),
					"only the handler's fields are stored")
			}
		})
	}
}

// Replayed fields are byte-identical to the first response's on the wire,
// values in order, whatever fields the outer middleware sets.
func TestHandlerFieldsReplayByteIdentically(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["X-Multi"] = []string{"z", "", "a, b", "\tq"}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Access-Control-Allow-Origin", "https://example.com") // overrides the outer value
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, "queued")
	})
	srv := httptest.NewServer(outerFields(Middleware(nil)(h)))
	defer srv.Close()
	first := rawPost(t, srv.Listener.Addr().String(), "k")
	replay := rawPost(t, srv.Listener.Addr().String(), "k")
	drop := func(lines []string, names ...string) []string {
		return slices.DeleteFunc(slices.Clone(lines), func(l string) bool {
			for _, n := range names {
				if strings.HasPrefix(strings.ToLower(l), strings.ToLower(n)+":") {
					return true
				}
			}
			return false
		})
	}
	// The per-request fields differ; everything else is the same bytes.
	assert.Equal(t, drop(first, "Date", "X-Request-Id"), drop(replay, "Date", "X-Request-Id", ReplayedHeader))
	i, j := slices.Index(first, "X-Multi: z"), slices.Index(first, "X-Multi: a, b")
	assert.True(t, i >= 0 && i < j, "values in the handler's order: %q", first)
	assert.Contains(t, replay, "X-Request-Id: req-2")
	assert.Contains(t, replay, ReplayedHeader+": true")
}

// rawPost sends a keyed POST over a new connection and returns the
// response's lines as they arrived (net/http writes the fields sorted by
// name, each field's values in order), then an empty line and the body.
func rawPost(t *testing.T, addr, key string) []string {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"+
		DefaultKeyHeader+": "+key+"\r\nContent-Length: 1\r\n\r\nb")
	require.NoError(t, err)
	raw, err := io.ReadAll(conn)
	require.NoError(t, err)
	head, body, ok := strings.Cut(string(raw), "\r\n\r\n")
	require.True(t, ok, "response: %q", raw)
	return append(strings.Split(head, "\r\n"), "", body)
}

// Write on a response whose status allows no body fails as under net/http;
// the status still reaches the client, and nothing is recorded for replay.
func TestWriteWhereBodyNotAllowed(t *testing.T) {
	for _, tt := range []struct {
		name    string
		method  string
		status  int // 0: none before the write
		inform  int // a 1xx written first
		write   string
		wantErr error
	}{
		{"204", http.MethodPost, http.StatusNoContent, 0, "x", http.ErrBodyNotAllowed},
		{"304", http.MethodPost, http.StatusNotModified, 0, "x", http.ErrBodyNotAllowed},
		{"204 empty write", http.MethodPost, http.StatusNoContent, 0, "", nil},
		{"200", http.MethodPost, http.StatusOK, 0, "x", nil},
		{"implicit 200", http.MethodPost, 0, 0, "x", nil},
		{"103 then implicit 200", http.MethodPost, 0, http.StatusEarlyHints, "x", nil},
		{"103 then 204", http.MethodPost, http.StatusNoContent, http.StatusEarlyHints, "x", http.ErrBodyNotAllowed},
		{"HEAD 200", http.MethodHead, http.StatusOK, 0, "x", nil},
		{"HEAD 204", http.MethodHead, http.StatusNoContent, 0, "x", http.ErrBodyNotAllowed},
	} {
		for _, behind := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/middleware=%v", tt.name, behind), func(t *testing.T) {
				var writeErr []error
				var wrote []int
				// The client may have the response before the handler
				// returns: a handler run is waited for before the next
				// request.
				ran := make(chan struct{}, 1)
				h := http.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					defer func() { ran <- struct{}{} }()
					if tt.inform != 0 {
						w.WriteHeader(tt.inform)
					}
					if tt.status != 0 {
						w.WriteHeader(tt.status)
					}
					n, err := io.WriteString(w, tt.write)
					wrote, writeErr = append(wrote, n), append(writeErr, err)
					// A second write after streaming began fails the same way.
					w.(http.Flusher).Flush()
					n, err = io.WriteString(w, tt.write)
					wrote, writeErr = append(wrote, n), append(writeErr, err)
				}))
				if behind {
					h = Middleware(nil, WithMethods(tt.method))(h)
				}
				srv := httptest.NewServer(h)
				defer srv.Close()
				want := tt.status
				if want == 0 {
					want = http.StatusOK
				}
				wantBody := ""
				if tt.wantErr == nil && tt.method != http.MethodHead {
					wantBody = tt.write + tt.write
				}
				for i := range 2 {
					resp, body := sendKeyed(t, srv.Client(), tt.method, srv.URL, "k")
					assert.Equal(t, want, resp.StatusCode)
					assert.Equal(t, wantBody, body)
					if i == 1 && behind {
						assert.Equal(t, "true", resp.Header.Get(ReplayedHeader))
					} else {
						<-ran
					}
				}
				wantN := len(tt.write)
				if tt.wantErr != nil {
					wantN = 0
				}
				calls := 2
				if behind {
					calls = 1
				}
				require.Len(t, writeErr, 2*calls)
				for i := range writeErr {
					assert.Equal(t, wantN, wrote[i])
					assert.Equal(t, tt.wantErr, writeErr[i])
				}
			})
		}
	}
}

// As under net/http, a Write that would take the body past the
// Content-Length the handler declared fails with http.ErrContentLength, and
// so does every later one: the client gets the body up to it, and so do the
// replays. Recorded, the refused bytes turned the stored response into one
// that no client could read (net/http refuses to send them), the first
// client's too unless it was streamed.
func TestWritePastDeclaredContentLength(t *testing.T) {
	for _, tt := range []struct {
		name  string
		flush bool
		hold  bool
		limit int64
	}{
		{"held back", false, false, 0},
		{"streamed", true, false, 0},
		{"too large to store", false, false, 3},
		{"held by the store", true, true, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var errs []error
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				errs = errs[:0]
				w.Header().Set("Content-Length", "5")
				w.WriteHeader(http.StatusCreated)
				if tt.flush {
					w.(http.Flusher).Flush()
				}
				for _, s := range []string{"hel", "lo", " world", "!"} {
					_, err := io.WriteString(w, s)
					errs = append(errs, err)
				}
			})
			var store Store = NewMemoryStore()
			if tt.hold {
				store = holdingStore{newStubStore()}
			}
			opts := []Option{}
			if tt.limit > 0 {
				opts = append(opts, WithMaxResponseBytes(tt.limit))
			}
			srv := httptest.NewServer(Middleware(store, opts...)(h))
			defer srv.Close()
			first, body := postKeyed(t, srv.Client(), srv.URL, "k")
			assert.Equal(t, http.StatusCreated, first.StatusCode)
			assert.Equal(t, "hello", body)
			assert.Equal(t, []error{nil, nil, http.ErrContentLength, http.ErrContentLength}, errs)
			replay, replayBody := postKeyed(t, srv.Client(), srv.URL, "k")
			require.Equal(t, "true", replay.Header.Get(ReplayedHeader))
			assert.Equal(t, http.StatusCreated, replay.StatusCode)
			if tt.limit == 0 {
				assert.Equal(t, "hello", replayBody)
			}
		})
	}
}

// A body shorter than the Content-Length the handler declared reaches the
// first client cut (net/http closes the connection after it). Stored, it
// made every replay cut too, so that no retry could learn the outcome; it
// is stored without its body, and a replay carries the status with a
// problem in its place.
func TestWriteShortOfDeclaredContentLength(t *testing.T) {
	for _, flush := range []bool{false, true} {
		t.Run("flush "+strconv.FormatBool(flush), func(t *testing.T) {
			srv := httptest.NewServer(Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Location", "/orders/1")
				w.Header().Set("Content-Length", "10")
				w.WriteHeader(http.StatusCreated)
				if flush {
					w.(http.Flusher).Flush()
				}
				_, _ = io.WriteString(w, "hello")
			})))
			defer srv.Close()
			send := func() (*http.Response, string, error) { return postKeyedRead(t, srv.Client(), srv.URL, "k") }
			first, body, err := send()
			assert.ErrorIs(t, err, io.ErrUnexpectedEOF, "net/http cuts the first response")
			assert.Equal(t, http.StatusCreated, first.StatusCode)
			assert.Equal(t, "hello", body)

			replay, body, err := send()
			require.NoError(t, err, "the replay is whole")
			assert.Equal(t, "true", replay.Header.Get(ReplayedHeader))
			assert.Equal(t, http.StatusCreated, replay.StatusCode)
			assert.Equal(t, "/orders/1", replay.Header.Get("Location"))
			assert.Equal(t, "application/problem+json", replay.Header.Get("Content-Type"))
			assert.Contains(t, body, ProblemResponseNotStored)
		})
	}
}

// A response to HEAD declares the length of a body it does not send, as
// http.ServeContent's does: net/http sends it whole, and so must a replay,
// with the same fields, not a problem for a body cut short.
func TestHeadDeclaresLengthWithoutBody(t *testing.T) {
	srv := httptest.NewServer(Middleware(nil, WithMethods(http.MethodHead))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "11")
		w.WriteHeader(http.StatusOK)
	})))
	defer srv.Close()
	first, _ := sendKeyed(t, srv.Client(), http.MethodHead, srv.URL, "k")
	assert.Equal(t, http.StatusOK, first.StatusCode)
	assert.Equal(t, int64(11), first.ContentLength)
	replay, _ := sendKeyed(t, srv.Client(), http.MethodHead, srv.URL, "k")
	assert.Equal(t, "true", replay.Header.Get(ReplayedHeader))
	assert.Equal(t, http.StatusOK, replay.StatusCode)
	assert.Equal(t, "text/plain", replay.Header.Get("Content-Type"))
	assert.Equal(t, int64(11), replay.ContentLength)
}

// A Write refused for passing the declared Content-Length leaves the body
// as long as it was, and it was short of that length unless the writes
// before it had filled it: net/http sends it cut, and so must a replay
// not. A handler that answers with json.Encoder's trailing newline after
// declaring the length of the JSON alone, or that writes a part of its
// body before a part too long, was stored with its cut body, every replay
// cut too; its body is not stored. One that wrote its whole body first is.
func TestWritePastDeclaredContentLengthAfterShortBody(t *testing.T) {
	for _, tt := range []struct {
		name   string
		writes []string
		whole  bool // the first client gets the whole body, and a replay too
	}{
		{"one write too long", []string{"{\"id\":1}\n"}, false},
		{"part, then a part too long", []string{"{\"id", "\":1}\n"}, false},
		{"whole body, then more", []string{"{\"id\":1}", "\n"}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var errs []error
			srv := httptest.NewServer(Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Location", "/orders/1")
				w.Header().Set("Content-Length", strconv.Itoa(len(`{"id":1}`)))
				w.WriteHeader(http.StatusCreated)
				for _, s := range tt.writes {
					_, err := io.WriteString(w, s)
					errs = append(errs, err)
				}
			})))
			defer srv.Close()
			send := func() (*http.Response, string, error) { return postKeyedRead(t, srv.Client(), srv.URL, "k") }
			first, firstBody, err := send()
			assert.ErrorIs(t, errs[len(errs)-1], http.ErrContentLength)
			assert.Equal(t, http.StatusCreated, first.StatusCode)
			if tt.whole {
				require.NoError(t, err)
				assert.Equal(t, `{"id":1}`, firstBody)
			} else {
				assert.ErrorIs(t, err, io.ErrUnexpectedEOF, "net/http cuts the first response")
			}

			replay, body, err := send()
			require.NoError(t, err, "the replay is whole")
			assert.Equal(t, "true", replay.Header.Get(ReplayedHeader))
			assert.Equal(t, http.StatusCreated, replay.StatusCode)
			assert.Equal(t, "/orders/1", replay.Header.Get("Location"))
			if tt.whole {
				assert.Equal(t, firstBody, body)
				return
			}
			assert.Equal(t, "application/problem+json", replay.Header.Get("Content-Type"))
			assert.Contains(t, body, ProblemResponseNotStored)
		})
	}
}

// Write and WriteString record and pass through the same bytes, whether the
// response is held back, streamed after a flush, or larger than the limit
// (10 bytes here), and return the same counts.
func TestWriteAndWriteStringAgree(t *testing.T) {
	writers := map[string]func(w http.ResponseWriter, s string) (int, error){
		"Write":       func(w http.ResponseWriter, s string) (int, error) { return w.Write([]byte(s)) },
		"WriteString": func(w http.ResponseWriter, s string) (int, error) { return w.(io.StringWriter).WriteString(s) },
	}
	for _, tt := range []struct {
		name       string
		flushAfter int // flush after this many writes; 0 for none
		writes     []string
		wantReplay string
	}{
		{"held back", 0, []string{"abc", "def"}, "abcdef"},
		{"streamed", 1, []string{"abc", "def"}, "abcdef"},
		{"past the limit", 0, []string{"abcdef", "ghijkl", "mn"}, ""},
		{"streamed past the limit", 1, []string{"abcdef", "ghijkl"}, ""},
		{"empty", 0, []string{""}, ""},
	} {
		for name, write := range writers {
			t.Run(tt.name+"/"+name, func(t *testing.T) {
				var ns []int
				mw := Middleware(nil, WithMaxResponseBytes(10))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(http.StatusCreated)
					for i, s := range tt.writes {
						n, err := write(w, s)
						assert.NoError(t, err)
						ns = append(ns, n)
						if i+1 == tt.flushAfter {
							w.(http.Flusher).Flush()
						}
					}
				}))
				first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				all := strings.Join(tt.writes, "")
				assert.Equal(t, http.StatusCreated, first.Code)
				assert.Equal(t, all, first.Body.String())
				for i, s := range tt.writes {
					assert.Equal(t, len(s), ns[i])
				}
				replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
				if tt.wantReplay == "" && all != "" {
					decodeProblem(t, replay, ProblemResponseNotStored, http.StatusCreated)
				} else {
					assert.Equal(t, tt.wantReplay, replay.Body.String())
				}
			})
		}
	}
}

// A header field whose name net/http would not send (empty, or not a
// token) never reached the client, so it is not stored for a replay
// either; a store's decoder would refuse an empty name.
func TestFieldsNetHTTPDropsAreNotStored(t *testing.T) {
	store := newStubStore()
	var stored *Response
	store.complete = func(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error {
		stored = resp
		return store.MemoryStore.Complete(ctx, key, token, resp, expires)
	}
	h := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()[""] = []string{"no name"}
		w.Header()["Bad Name"] = []string{"a space"}
		w.Header()["Bad:Name"] = []string{"a colon"}
		w.Header().Set("X-Good", "kept")
		w.WriteHeader(http.StatusCreated)
	}))
	w := serve(h, newRequest(http.MethodPost, "/x", "k", "b"))
	require.Equal(t, http.StatusCreated, w.Code)
	require.NotNil(t, stored)
	assert.Equal(t, []string{"kept"}, stored.Header["X-Good"])
	for _, name := range []string{"", "Bad Name", "Bad:Name"} {
		assert.NotContains(t, stored.Header, name)
	}
}

// TestTransferEncodingSetByHandlerReplaysItsContentType: over HTTP/1,
// net/http neither sends nor sniffs a Content-Type for a response whose
// handler set a Transfer-Encoding and no type; over HTTP/2 it ignores the
// field and sniffs. A replay, which never carries the hop-by-hop
// Transfer-Encoding, must get the first response's type (or lack of one)
// either way, not one sniffed from its body.
func TestTransferEncodingSetByHandlerReplaysItsContentType(t *testing.T) {
	for _, tt := range []struct {
		name    string
		handler http.HandlerFunc
	}{
		{"chunked", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Transfer-Encoding", "chunked")
			_, _ = io.WriteString(w, `<html>{"paid":true}`)
		}},
		{"identity", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Transfer-Encoding", "identity")
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, `<html>{"paid":true}`)
		}},
		{"chunked and flushed", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Transfer-Encoding", "chunked")
			_, _ = io.WriteString(w, "  ")
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, `<html>{"paid":true}`)
		}},
	} {
		for _, http2 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/http2=%v", tt.name, http2), func(t *testing.T) {
				srv := httptest.NewUnstartedServer(Middleware(nil)(tt.handler))
				srv.EnableHTTP2 = http2
				srv.StartTLS()
				defer srv.Close()
				first, _ := postKeyed(t, srv.Client(), srv.URL, "k")
				replay, body := postKeyed(t, srv.Client(), srv.URL, "k")
				require.Equal(t, "true", replay.Header.Get(ReplayedHeader))
				require.Equal(t, http2, first.ProtoMajor == 2)
				assert.Contains(t, body, `{"paid":true}`)
				assert.Equal(t, first.Header["Content-Type"], replay.Header["Content-Type"])
			})
		}
	}
}
