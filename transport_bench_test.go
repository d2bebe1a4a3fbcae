package idemhttp

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
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
	payload := bytes.Repeat([]byte("p"), 1024)

	impls := []struct {
		name string
		wrap func(http.RoundTripper) http.RoundTripper
	}{
		{"bare", func(rt http.RoundTripper) http.RoundTripper { return rt }},
		{"bare+key", func(rt http.RoundTripper) http.RoundTripper {
			return roundTripFunc(func(r *http.Request) (*http.Response, error) {
				if r.Method == http.MethodPost {
					key, _ := newUUIDv7()
					r.Header.Set(DefaultKeyHeader, key)
				}
				return rt.RoundTrip(r)
			})
		}},
		{"idemhttp", func(rt http.RoundTripper) http.RoundTripper { return NewTransport(rt) }},
	}
	reqs := []struct {
		name string
		make func() *http.Request
	}{
		{"GET", func() *http.Request { r, _ := http.NewRequest("GET", url, nil); return r }},
		{"POST-1KiB", func() *http.Request {
			r, _ := http.NewRequest("POST", url, bytes.NewReader(payload))
			return r
		}},
	}
	for _, rq := range reqs {
		for _, impl := range impls {
			b.Run("req="+rq.name+"/impl="+impl.name, func(b *testing.B) {
				base := http.DefaultTransport.(*http.Transport).Clone()
				defer base.CloseIdleConnections()
				rt := impl.wrap(base)
				b.ReportAllocs()
				for b.Loop() {
					resp, err := rt.RoundTrip(rq.make())
					if err != nil {
						b.Fatal(err)
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
	}
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
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		return &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
	})
	payload := bytes.Repeat([]byte("p"), 1024)
	for _, method := range []string{"GET", "POST"} {
		for _, impl := range []struct {
			name string
			rt   http.RoundTripper
		}{{"bare", base}, {"idemhttp", NewTransport(base)}} {
			b.Run("req="+method+"/impl="+impl.name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					var body io.Reader
					if method == "POST" {
						body = bytes.NewReader(payload)
					}
					req, _ := http.NewRequest(method, "https://api.example.com/v1/charges", body)
					resp, err := impl.rt.RoundTrip(req)
					if err != nil {
						b.Fatal(err)
					}
					resp.Body.Close()
				}
			})
		}
	}
}
