package redisstore_test

import (
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/internal/cputime"
)

// BenchmarkPaths measures the middleware over the Redis store, and over a
// MemoryStore for comparison, on three paths: new keys, replays (of 1000
// keys), and a hot key (the clients on ten keys, replayed); and beside
// them a plain GET to the same Redis of a record as large as the one a
// replay reads (a completed record of the same handler's response), the
// floor of any request that must ask Redis: once as the client's call
// alone (store=get), and once from a handler behind the same harness as
// the store columns (store=get-handler), so that the two differ only in
// what the middleware and the store do. C goroutines send the requests. Besides ns/op it reports requests per second, the 99th
// percentile latency, the round trips to Redis per request, and the CPU
// time per request of the benchmark's process and of the Redis server (see
// measure). Run it with
//
//	scripts/with-redis.sh go test -run '^$' -bench BenchmarkPaths -benchtime 2s -count 3 ./idemserver/redisstore/
//
// The harness is lean, so that the store columns measure the middleware
// and the store rather than the test's own HTTP plumbing, and the same for
// the memory and the Redis columns: each request is an *http.Request built
// directly (a URL parsed once, the key's header value made once per key, a
// body reader of its own), not parsed from request text as
// httptest.NewRequest does, and the response goes to a writer that keeps
// its status and header and counts the body, without httptest's recorder.
// Add -benchmem to see the allocations of a request.
func BenchmarkPaths(b *testing.B) {
	handler := benchHandler
	var rt counter
	client := newClient(b, &rt)
	prefix := newPrefix(b, client)
	var run atomic.Int64
	// newRedis returns a store with a prefix of its own, and the prefix.
	newRedis := func() (*redisstore.Store, string) {
		p := prefix + strconv.FormatInt(run.Add(1), 10) + ":"
		return redisstore.New(client, redisstore.WithPrefix(p)), p
	}
	keys := newBenchKeys(1000)
	// storedRecord returns the Redis key of a completed record of
	// handler's response: the record a replay reads.
	storedRecord := func(b *testing.B) string {
		store, p := newRedis()
		serveKey(b, idemserver.Middleware(store)(handler), keys.of(0))
		recs, err := client.Keys(b.Context(), p+"*").Result()
		require.NoError(b, err)
		require.Len(b, recs, 1)
		return recs[0]
	}
	for _, path := range []string{"new", "replay", "hot"} {
		for _, c := range []int{1, 16, 64} {
			b.Run(fmt.Sprintf("path=%s/C=%d/store=get", path, c), func(b *testing.B) {
				key := storedRecord(b)
				measure(b, &rt, client, c, func(int) {
					if err := client.Get(b.Context(), key).Err(); err != nil {
						b.Error(err)
					}
				})
			})
			b.Run(fmt.Sprintf("path=%s/C=%d/store=get-handler", path, c), func(b *testing.B) {
				// The same GET, from a handler behind the harness the
				// store columns use.
				h := getHandler(client, storedRecord(b))
				measure(b, &rt, client, c, func(i int) { serveKey(b, h, keys.of(i%1000)) })
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
					s, _ := newRedis()
					return s
				}},
			} {
				b.Run(fmt.Sprintf("path=%s/C=%d/store=%s", path, c, st.name), func(b *testing.B) {
					h := idemserver.Middleware(st.new(b))(handler)
					keyOf := func(i int) benchKey { return benchKey{key: strconv.Itoa(i)} }
					switch path {
					case "replay":
						for i := range 1000 {
							serveKey(b, h, keys.of(i))
						}
						keyOf = func(i int) benchKey { return keys.of(i % 1000) }
					case "hot":
						for i := range 10 {
							serveKey(b, h, keys.of(i))
						}
						keyOf = func(i int) benchKey { return keys.of(i % 10) }
					}
					measure(b, &rt, client, c, func(i int) { serveKey(b, h, keyOf(i)) })
				})
			}
		}
	}
}

// benchHandler is the handler behind the middleware in the benchmarks: it
// answers 201 with a small JSON document.
var benchHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte(`{"id":"0123456789abcdef","status":"created"}`))
})

// getHandler returns the GET floor behind the benchmarks' harness: a
// handler that reads record from Redis with a plain GET and answers with
// it as benchHandler does.
func getHandler(client *redis.Client, record string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v, err := client.Get(r.Context(), record).Result()
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, v)
	})
}

// benchURL is the URL of every benchmark request, parsed once.
var benchURL = &url.URL{Path: "/items"}

// benchBody is the body of every benchmark request.
const benchBody = `{"amount":100}`

// A benchKey is an idempotency key with its header value made once, so
// that a request with it allocates neither.
type benchKey struct {
	key    string
	values []string // the key header's values; made on first use if nil
}

// benchKeys holds the keys of the replay and hot-key paths.
type benchKeys []benchKey

func newBenchKeys(n int) benchKeys {
	keys := make(benchKeys, n)
	for i := range keys {
		k := strconv.Itoa(i)
		keys[i] = benchKey{key: k, values: []string{k}}
	}
	return keys
}

func (k benchKeys) of(i int) benchKey { return k[i] }

// benchRequestBody is a request body: a strings.Reader that closes.
type benchRequestBody struct{ strings.Reader }

func (*benchRequestBody) Close() error { return nil }

// benchWriter is a light http.ResponseWriter: it keeps the status and the
// header, and counts the body's bytes.
type benchWriter struct {
	header http.Header
	status int
	n      int
}

func (w *benchWriter) Header() http.Header { return w.header }

func (w *benchWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

func (w *benchWriter) Write(p []byte) (int, error) {
	return w.WriteString(string(p)) // does not allocate
}

// WriteString makes benchWriter an io.StringWriter, as net/http's
// response writers are, so that a replay's body is not copied into a
// byte slice first.
func (w *benchWriter) WriteString(s string) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.n += len(s)
	return len(s), nil
}

// serveKey serves a POST with key and fails unless it succeeds. The
// request is built directly, with a fresh header and body, the way a
// server hands a parsed request to its handler.
func serveKey(b *testing.B, h http.Handler, key benchKey) {
	values := key.values
	if values == nil {
		values = []string{key.key}
	}
	body := &benchRequestBody{}
	body.Reset(benchBody)
	r := &http.Request{
		Method:        http.MethodPost,
		URL:           benchURL,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{idemserver.DefaultKeyHeader: values},
		Body:          body,
		ContentLength: int64(len(benchBody)),
		Host:          "example.com",
		RequestURI:    "/items",
	}
	w := &benchWriter{header: make(http.Header, 4)}
	h.ServeHTTP(w, r)
	if w.status != http.StatusCreated {
		b.Errorf("key %s: status %d", key.key, w.status)
	}
}

// measure runs b.N calls of do on c goroutines, and reports requests per
// second, the 99th percentile latency and the round trips rt counted per
// call. Untimed calls first open the client's connections, so that the
// count has no dialing in it; the timed calls get the indexes after theirs.
//
// It also reports the CPU time per call of this process (cpu-ns/op) and of
// the Redis server that client reaches (redis-cpu-ns/op, from INFO cpu; on
// loopback, the server's work for this benchmark alone). On a shared
// machine these vary far less than wall time, and on an idle one with two
// cores their sum is what bounds the requests per second at high C.
func measure(b *testing.B, rt *counter, client *redis.Client, c int, do func(i int)) {
	warm := 4 * c
	lat := make([][]time.Duration, c)
	runCalls(c, 0, warm, nil, do)
	server := serverCPU(b, client)
	rt.take()
	cpu := cputime.Start()
	b.ResetTimer()
	runCalls(c, warm, warm+b.N, lat, do)
	b.StopTimer()
	cpu.Report(b, b.N)
	rts := rt.take()
	b.ReportMetric(float64((serverCPU(b, client)-server).Nanoseconds())/float64(b.N), "redis-cpu-ns/op")
	all := slices.Concat(lat...)
	slices.Sort(all)
	b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(rts)/float64(b.N), "rt/op")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// serverCPU returns the CPU time the Redis server has used, user and
// system, from INFO cpu.
func serverCPU(b *testing.B, client *redis.Client) time.Duration {
	info, err := client.Info(b.Context(), "cpu").Result()
	require.NoError(b, err)
	var total time.Duration
	for line := range strings.Lines(info) {
		name, value, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (name == "used_cpu_sys" || name == "used_cpu_user") {
			secs, err := strconv.ParseFloat(value, 64)
			require.NoError(b, err, line)
			total += time.Duration(secs * float64(time.Second))
		}
	}
	return total
}

// runCalls calls do(i) for i from from to to-1 on c goroutines, and
// appends each call's latency to lat[g] of the goroutine g that made it,
// unless lat is nil.
func runCalls(c, from, to int, lat [][]time.Duration, do func(i int)) {
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
				if lat != nil {
					lat[g] = append(lat[g], time.Since(start))
				}
			}
		})
	}
	wg.Wait()
}
