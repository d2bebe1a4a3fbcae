package redisstore_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/internal/blockratio"
)

// BenchmarkReplayPaired measures replays over the Redis store against the
// two GET floors of BenchmarkPaths (store=get and store=get-handler) in
// one run, interleaved: the three take turns in blocks of pairedBlock
// requests from C goroutines, the order rotating from round to round, so
// that the machine's load and its drift over the run weigh on all alike.
// Each block's time per request is divided by the GET's, and by the
// get-handler's, in the same round; the benchmark reports the medians of
// those ratios (redis/get, redis/get-handler: the GET's requests per
// second over the replay's) and each side's mean time per request. Every
// b.N sends b.N requests from each side. Run it with
//
//	scripts/with-redis.sh go test -run '^$' -bench BenchmarkReplayPaired -benchtime 200000x -count 5 ./idemserver/redisstore/
func BenchmarkReplayPaired(b *testing.B) {
	var rt counter
	client := newClient(b, &rt)
	prefix := newPrefix(b, client)
	keys := newBenchKeys(1000)
	for _, path := range []struct {
		name string
		keys int // the completed keys the clients replay
	}{{"replay", 1000}, {"hot", 10}} {
		for _, c := range []int{1, 16, 64} {
			b.Run(fmt.Sprintf("path=%s/C=%d", path.name, c), func(b *testing.B) {
				p := fmt.Sprintf("%s%s-%d:", prefix, path.name, c)
				mw := idemserver.Middleware(redisstore.New(client, redisstore.WithPrefix(p)))(benchHandler)
				for i := range path.keys {
					serveKey(b, mw, keys.of(i))
				}
				// The record a replay reads, for the GETs to read.
				recs, err := client.Keys(b.Context(), p+"*").Result()
				require.NoError(b, err)
				require.Len(b, recs, path.keys)
				record := recs[0]
				get := func(int) {
					if err := client.Get(b.Context(), record).Err(); err != nil {
						b.Error(err)
					}
				}
				floor := getHandler(client, record)
				sides := []*pairedSide{
					{name: "get", do: get},
					{name: "get-handler", do: func(i int) { serveKey(b, floor, keys.of(i%path.keys)) }},
					{name: "redis", do: func(i int) { serveKey(b, mw, keys.of(i%path.keys)) }},
				}
				for _, s := range sides {
					runCalls(c, 0, 4*c, nil, s.do) // open the connections
				}
				b.ResetTimer()
				for done, round := 0, 0; done < b.N; round++ {
					n := min(pairedBlock, b.N-done)
					for i := range sides {
						s := sides[(round+i)%len(sides)]
						start := time.Now()
						runCalls(c, done, done+n, nil, s.do)
						s.perRequest = append(s.perRequest, float64(time.Since(start).Nanoseconds())/float64(n))
					}
					done += n
				}
				b.StopTimer()
				for _, s := range sides {
					b.ReportMetric(blockratio.Mean(s.perRequest), s.name+"-ns/req")
				}
				redis := sides[2].perRequest
				b.ReportMetric(blockratio.Median(blockratio.Ratios(redis, sides[0].perRequest)), "redis/get")
				b.ReportMetric(blockratio.Median(blockratio.Ratios(redis, sides[1].perRequest)), "redis/get-handler")
			})
		}
	}
}

// pairedBlock is how many requests one side of BenchmarkReplayPaired
// sends before the next takes over: at tens of thousands of requests per
// second, a few tens of milliseconds.
const pairedBlock = 2048

// pairedSide is one side of BenchmarkReplayPaired.
type pairedSide struct {
	name       string
	do         func(i int)
	perRequest []float64 // ns per request, per block
}
