package idemhttp

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhttp/idemhttp/internal/blockratio"
	"github.com/idemhttp/idemhttp/internal/cputime"
)

// BenchmarkTransport measures the happy path, one request at a time over a
// loopback keep-alive connection to a server in another process, so that
// the allocations reported are the client's alone. It compares a bare
// http.Transport; a bare one with the caller setting a fresh UUIDv7 key by
// hand, so the same bytes cross the wire; and idemhttp, with its defaults,
// wrapping the same kind of transport. Compare with
//
//	benchstat -col /impl bench.txt
func BenchmarkTransport(b *testing.B) {
	url := startBenchServer(b)

	impls := []struct {
		name string
		wrap func(http.RoundTripper) http.RoundTripper
	}{
		{"bare", func(rt http.RoundTripper) http.RoundTripper { return rt }},
		{"bare+key", keyByHand},
		{"idemhttp", func(rt http.RoundTripper) http.RoundTripper { return NewTransport(rt) }},
	}
	for _, rq := range benchRequests(url) {
		for _, impl := range impls {
			b.Run("req="+rq.name+"/impl="+impl.name, func(b *testing.B) {
				base := http.DefaultTransport.(*http.Transport).Clone()
				defer base.CloseIdleConnections()
				rt := impl.wrap(base)
				b.ReportAllocs()
				cpu := cputime.Start()
				for b.Loop() {
					benchRoundTrip(b, rt, rq.make())
				}
				cpu.Report(b, b.N)
			})
		}
	}
}

// benchRequest is a kind of request the loopback benchmarks send.
type benchRequest struct {
	name string
	make func() *http.Request
}

// benchRequests are a GET and a POST of 1 KiB to url.
func benchRequests(url string) []benchRequest {
	payload := bytes.Repeat([]byte("p"), 1024)
	return []benchRequest{
		{"GET", func() *http.Request { r, _ := http.NewRequest("GET", url, nil); return r }},
		{"POST-1KiB", func() *http.Request {
			r, _ := http.NewRequest("POST", url, bytes.NewReader(payload))
			return r
		}},
	}
}

// benchRoundTrip sends req through rt and reads and closes the response.
func benchRoundTrip(b *testing.B, rt http.RoundTripper, req *http.Request) {
	resp, err := rt.RoundTrip(req)
	if err != nil {
		b.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// BenchmarkTransportPaired measures idemhttp against a bare http.Transport
// over loopback, to a server in another process, in one run: bare, bare+key
// (a key set by hand on each POST, the same bytes on the wire as idemhttp's)
// and idemhttp send in turn, in blocks of pairedBlock requests, the order
// rotating and reversing from round to round, so that the machine's load
// and its drift over the run weigh on all alike. Each has its own
// http.Transport and so its own keep-alive connection. Every b.N sends b.N
// requests with each.
//
// It reports, per request, each side's wall time (bare-ns/req, ...) and the
// CPU time of this process, user and system, which counts the runtime's
// work too (bare-cpu-ns/req, ...), and the medians over the blocks of each
// side's time divided by bare's in the same round (idemhttp/bare-wall,
// idemhttp/bare-cpu, ...). The built-in ns/op is the time of one request
// by each side. Compare runs with
//
//	benchstat paired.txt
func BenchmarkTransportPaired(b *testing.B) {
	url := startBenchServer(b)
	for _, rq := range benchRequests(url) {
		b.Run("req="+rq.name, func(b *testing.B) {
			var sides []*pairedSide
			for _, s := range []struct {
				name string
				wrap func(http.RoundTripper) http.RoundTripper
			}{
				{"bare", func(rt http.RoundTripper) http.RoundTripper { return rt }},
				{"bare+key", keyByHand},
				{"idemhttp", func(rt http.RoundTripper) http.RoundTripper { return NewTransport(rt) }},
			} {
				base := http.DefaultTransport.(*http.Transport).Clone()
				defer base.CloseIdleConnections()
				side := &pairedSide{name: s.name, rt: s.wrap(base)}
				benchRoundTrip(b, side.rt, rq.make()) // open the connection
				sides = append(sides, side)
			}
			b.ResetTimer()
			order := make([]int, len(sides))
			for done, round := 0, 0; done < b.N; round++ {
				n := min(pairedBlock, b.N-done)
				for i := range order {
					order[i] = (round + i) % len(sides)
				}
				if round/len(sides)%2 == 1 {
					slices.Reverse(order)
				}
				for _, i := range order {
					sides[i].block(b, n, rq.make)
				}
				done += n
			}
			for _, s := range sides {
				s.report(b)
			}
			for _, s := range sides[1:] {
				b.ReportMetric(blockratio.Median(blockratio.Ratios(s.wall, sides[0].wall)), s.name+"/bare-wall")
				b.ReportMetric(blockratio.Median(blockratio.Ratios(s.cpu, sides[0].cpu)), s.name+"/bare-cpu")
			}
		})
	}
}

// pairedBlock is how many requests one side of BenchmarkTransportPaired
// sends before the next takes over: enough that reading the clocks costs
// nothing in comparison, few enough that both sides see the same load.
const pairedBlock = 64

// pairedSide is one side of BenchmarkTransportPaired, with the wall and CPU
// time per request of each of its blocks.
type pairedSide struct {
	name      string
	rt        http.RoundTripper
	wall, cpu []float64 // ns per request, per block
	n         int       // requests sent
}

// block sends n requests and records their time.
func (s *pairedSide) block(b *testing.B, n int, make func() *http.Request) {
	start, cpu := time.Now(), cputime.Start()
	for range n {
		benchRoundTrip(b, s.rt, make())
	}
	s.wall = append(s.wall, float64(time.Since(start).Nanoseconds())/float64(n))
	s.cpu = append(s.cpu, float64(cpu.Elapsed().Nanoseconds())/float64(n))
	s.n += n
}

// report adds the side's mean times per request to b's results.
func (s *pairedSide) report(b *testing.B) {
	b.ReportMetric(blockratio.Mean(s.wall), s.name+"-ns/req")
	if cputime.Supported {
		b.ReportMetric(blockratio.Mean(s.cpu), s.name+"-cpu-ns/req")
	}
}

// keyByHand wraps rt so that every POST carries a fresh UUIDv7 key, set by
// hand on the caller's request and made as idemhttp makes its own: what
// sending a key costs without idemhttp, so that idemhttp/bare+key is the
// cost of idemhttp's own work alone.
func keyByHand(rt http.RoundTripper) http.RoundTripper {
	keys := new(keySource)
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if r.Method == http.MethodPost {
			key, _ := keys.newKey(time.Now())
			r.Header.Set(DefaultKeyHeader, key)
		}
		return rt.RoundTrip(r)
	})
}

// benchServerEnv, when set, makes the test binary serve for a benchmark
// instead of running tests.
const benchServerEnv = "IDEMHTTP_BENCH_SERVER"

// startBenchServer runs this test binary again as a loopback server and
// returns its URL. The server exits when its standard input closes: at the
// benchmark's end, or when this process dies.
func startBenchServer(b *testing.B) string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), benchServerEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	addr, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("benchmark server: %v", err)
	}
	return "http://" + strings.TrimSpace(addr)
}

// serveForBenchmark is the benchmark server: it reads the request body and
// answers "ok", until standard input closes.
func serveForBenchmark() {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(l.Addr())
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = w.Write([]byte("ok"))
	}))
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// BenchmarkTransportOverhead isolates what idemhttp itself costs per
// request: the base transport answers at once from memory, so nothing but
// the wrapper's own work is measured, without the network's noise.
func BenchmarkTransportOverhead(b *testing.B) {
	inMemory(b, func(b *testing.B, rt http.RoundTripper, newRequest func() *http.Request) {
		b.ReportAllocs()
		for b.Loop() {
			memoryRoundTrip(b, rt, newRequest())
		}
	})
}

// BenchmarkTransportOverheadHTTP is BenchmarkTransportOverhead over an
// [http.Transport], as the default Transport is, whose "https" protocol
// answers from memory (RegisterProtocol): what the wrapper costs on top of
// net/http's own entry into a round trip, without the network's noise.
func BenchmarkTransportOverheadHTTP(b *testing.B) {
	// An empty TLSNextProto keeps HTTP/2 from claiming "https" too.
	base := &http.Transport{TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{}}
	base.RegisterProtocol("https", memoryBase())
	inMemoryOver(b, base, func(b *testing.B, rt http.RoundTripper, newRequest func() *http.Request) {
		b.ReportAllocs()
		for b.Loop() {
			memoryRoundTrip(b, rt, newRequest())
		}
	})
}

// BenchmarkTransportOverheadCold is BenchmarkTransportOverhead with the
// caches cold, as they are for a client that waits on the network between
// requests while other work runs: before each request it writes to every
// cache line of a buffer larger than the caches it can evict. It reports
// the median time of a RoundTrip alone (rt-ns/op); its ns/op is mostly
// the eviction's.
func BenchmarkTransportOverheadCold(b *testing.B) {
	evict := make([]byte, 16<<20)
	inMemory(b, func(b *testing.B, rt http.RoundTripper, newRequest func() *http.Request) {
		took := make([]float64, 0, b.N)
		for b.Loop() {
			for i := 0; i < len(evict); i += 64 {
				evict[i]++
			}
			req := newRequest()
			start := time.Now()
			memoryRoundTrip(b, rt, req)
			took = append(took, float64(time.Since(start).Nanoseconds()))
		}
		b.ReportMetric(blockratio.Median(took), "rt-ns/op")
	})
}

// inMemory runs bench for a GET and a 1 KiB POST, each through a base
// transport that answers 200 at once from memory and through idemhttp
// over it.
func inMemory(b *testing.B, bench func(b *testing.B, rt http.RoundTripper, newRequest func() *http.Request)) {
	inMemoryOver(b, memoryBase(), bench)
}

// memoryBase returns a transport that answers 200 at once from memory.
func memoryBase() http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		return &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
	})
}

// inMemoryOver is inMemory over the given base transport.
func inMemoryOver(b *testing.B, base http.RoundTripper, bench func(b *testing.B, rt http.RoundTripper, newRequest func() *http.Request)) {
	payload := bytes.Repeat([]byte("p"), 1024)
	for _, method := range []string{"GET", "POST"} {
		newRequest := func() *http.Request {
			var body io.Reader
			if method == "POST" {
				body = bytes.NewReader(payload)
			}
			req, _ := http.NewRequest(method, "https://api.example.com/v1/charges", body)
			return req
		}
		for _, impl := range []struct {
			name string
			rt   http.RoundTripper
		}{{"bare", base}, {"idemhttp", NewTransport(base)}} {
			b.Run("req="+method+"/impl="+impl.name, func(b *testing.B) {
				bench(b, impl.rt, newRequest)
			})
		}
	}
}

// memoryRoundTrip sends req through rt and closes the response body.
func memoryRoundTrip(b *testing.B, rt http.RoundTripper, req *http.Request) {
	resp, err := rt.RoundTrip(req)
	if err != nil {
		b.Fatal(err)
	}
	resp.Body.Close()
}
