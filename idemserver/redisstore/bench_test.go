package redisstore_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

// BenchmarkPaths measures the middleware over the Redis store, and over a
// MemoryStore for comparison, on three paths: new keys, replays (of 1000
// keys), and a hot key (the clients on ten keys, replayed); and beside
// them a plain GET to the same Redis of a value the size of a stored
// response, the floor of any request that must ask Redis. C goroutines
// send the requests. Besides ns/op it reports requests per second, the 99th
// percentile latency and the round trips to Redis per request. Run it with
//
//	scripts/with-redis.sh go test -run '^$' -bench BenchmarkPaths -benchtime 2s ./idemserver/redisstore/
func BenchmarkPaths(b *testing.B) {
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"0123456789abcdef","status":"created"}`))
	})
	var rt counter
	client := newClient(b, &rt)
	prefix := newPrefix(b, client)
	var run atomic.Int64
	for _, path := range []string{"new", "replay", "hot"} {
		for _, c := range []int{1, 16, 64} {
			b.Run(fmt.Sprintf("path=%s/C=%d/store=get", path, c), func(b *testing.B) {
				// The value a replay of this handler's response reads.
				rec := httptest.NewRecorder()
				handler(rec, nil)
				value := respcodec.Encode(&idemserver.Response{Status: rec.Code, Header: rec.Header(), Body: rec.Body.Bytes()})
				key := prefix + "get"
				require.NoError(b, client.Set(b.Context(), key, value, time.Hour).Err())
				measure(b, &rt, c, func(int) {
					if err := client.Get(b.Context(), key).Err(); err != nil {
						b.Error(err)
					}
				})
			})
			for _, st := range []struct {
				name string
				new  func(b *testing.B) idemserver.Store
			}{
				{"memory", func(b *testing.B) idemserver.Store {
					s := idemserver.NewMemoryStore()
					b.Cleanup(func() { _ = s.Close() })
					return s
				}},
				{"redis", func(*testing.B) idemserver.Store {
					return redisstore.New(client, redisstore.WithPrefix(prefix+strconv.FormatInt(run.Add(1), 10)+":"))
				}},
			} {
				b.Run(fmt.Sprintf("path=%s/C=%d/store=%s", path, c, st.name), func(b *testing.B) {
					h := idemserver.Middleware(st.new(b))(handler)
					keyOf := func(i int) string { return strconv.Itoa(i) }
					switch path {
					case "replay":
						for i := range 1000 {
							serveKey(b, h, keyOf(i))
						}
						keyOf = func(i int) string { return strconv.Itoa(i % 1000) }
					case "hot":
						for i := range 10 {
							serveKey(b, h, keyOf(i))
						}
						keyOf = func(i int) string { return strconv.Itoa(i % 10) }
					}
					measure(b, &rt, c, func(i int) { serveKey(b, h, keyOf(i)) })
				})
			}
		}
	}
}

// serveKey serves a POST with key and fails unless it succeeds.
func serveKey(b *testing.B, h http.Handler, key string) {
	r := httptest.NewRequest(http.MethodPost, "/items", strings.NewReader(`{"amount":100}`))
	r.Header.Set(idemserver.DefaultKeyHeader, key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated {
		b.Errorf("key %s: status %d: %s", key, w.Code, w.Body)
	}
}

// measure runs b.N calls of do on c goroutines, and reports requests per
// second, the 99th percentile latency and the round trips rt counted per
// call. Untimed calls first open the client's connections, so that the
// count has no dialing in it; the timed calls get the indexes after theirs.
func measure(b *testing.B, rt *counter, c int, do func(i int)) {
	warm := 4 * c
	lat := make([][]time.Duration, c)
	run := func(from, to int, timed bool) {
		var next atomic.Int64
		next.Store(int64(from))
		var wg sync.WaitGroup
		for g := range c {
			wg.Go(func() {
				for {
					i := int(next.Add(1)) - 1
					if i >= to {
						return
					}
					start := time.Now()
					do(i)
					if timed {
						lat[g] = append(lat[g], time.Since(start))
					}
				}
			})
		}
		wg.Wait()
	}
	run(0, warm, false)
	rt.take()
	b.ResetTimer()
	run(warm, warm+b.N, true)
	b.StopTimer()
	all := slices.Concat(lat...)
	slices.Sort(all)
	b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(rt.take())/float64(b.N), "rt/op")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}
