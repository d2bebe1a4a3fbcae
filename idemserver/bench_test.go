package idemserver

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
)

// discardWriter is the cheapest ResponseWriter, so that the benchmarks
// measure the middleware rather than a recorder.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }

const benchBody = `{"amount":1999,"currency":"EUR","customer":"cus_123","description":"order 1234"}`

// benchHandler stands for a cheap handler: it reads the body and answers
// with a small JSON document.
var benchHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, `{"id":"ch_1","status":"succeeded","amount":1999}`)
})

// BenchmarkMiddleware compares a request through the bare handler with one
// through the middleware with a new key (claim, run, store) and with a key
// already completed (replay). New keys go to a store of 100,000 records
// that evicts the oldest when full, so that the store reaches its steady
// state within the run; the default store would refuse new keys once full
// instead. Compare the paths with
//
//	benchstat -col /path
func BenchmarkMiddleware(b *testing.B) {
	for _, parallel := range []bool{false, true} {
		for _, bm := range []struct {
			name   string
			h      http.Handler
			newKey bool
		}{
			{"bare", benchHandler, true},
			{"new-key", Middleware(NewMemoryStore(WithMaxEntries(100_000), WithEvictOldest(), WithEvictionReport(func(Eviction) {})))(benchHandler), true},
			{"replay", Middleware(nil)(benchHandler), false},
		} {
			name := "path=" + bm.name
			if parallel {
				name = "parallel/" + name
			}
			b.Run(name, func(b *testing.B) {
				var workers atomic.Int64
				// worker sends requests with its own keys until more is false.
				worker := func(more func() bool) {
					r := httptest.NewRequest(http.MethodPost, "/charges?expand=customer", nil)
					w := &discardWriter{h: http.Header{}}
					body := strings.NewReader(benchBody)
					r.ContentLength = int64(len(benchBody))
					keyBuf := strconv.AppendInt([]byte("bench-"), workers.Add(1), 10)
					keyBuf = append(keyBuf, '-')
					for n := 0; more(); n++ {
						body.Reset(benchBody)
						r.Body = io.NopCloser(body)
						key := "replayed-key"
						if bm.newKey {
							key = string(strconv.AppendInt(keyBuf, int64(n), 10))
						}
						r.Header[DefaultKeyHeader] = []string{key}
						clear(w.h)
						bm.h.ServeHTTP(w, r)
					}
				}
				b.ReportAllocs()
				if parallel {
					b.RunParallel(func(pb *testing.PB) { worker(pb.Next) })
				} else {
					worker(b.Loop)
				}
			})
		}
	}
}
