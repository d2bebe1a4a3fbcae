// Package transport compares what idemhttp's Transport costs per request
// with its peers, go-retryablehttp and failsafe-go, on the happy path: one
// request at a time, answered 200 at the first attempt by a base transport
// that answers from memory, so that only each library's own machinery is
// timed.
package transport

import (
	"bytes"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/failsafe-go/failsafe-go/failsafehttp"
	"github.com/hashicorp/go-retryablehttp"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/internal/cputime"
)

// memoryTransport answers every request 200 at once, with a small body, and
// closes the request body as a real transport does.
type memoryTransport struct{}

func (memoryTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	return &http.Response{
		StatusCode: http.StatusOK,
		Header:     http.Header{},
		Body:       io.NopCloser(bytes.NewReader(okBody)),
		Request:    r,
	}, nil
}

var okBody = []byte("ok")

// The retry policy every client is given, where it can be set: four
// attempts in all, waits growing from 100 ms up to 10 s, idemhttp's defaults.
const (
	maxAttempts = 4
	waitMin     = 100 * time.Millisecond
	waitMax     = 10 * time.Second
)

// clients are the configurations compared, each an http.Client over the
// same in-memory base transport, used as an application would use it.
var clients = []struct {
	name string
	make func(base http.RoundTripper) *http.Client
}{
	{"bare", func(base http.RoundTripper) *http.Client {
		return &http.Client{Transport: base}
	}},
	{"idemhttp", func(base http.RoundTripper) *http.Client {
		// Defaults: a key on POST, the retry budget and the circuit breaker.
		return &http.Client{Transport: idemhttp.NewTransport(base)}
	}},
	{"go-retryablehttp", func(base http.RoundTripper) *http.Client {
		c := retryablehttp.NewClient()
		c.Logger = nil // it logs every attempt to stderr by default
		c.RetryMax = maxAttempts - 1
		c.RetryWaitMin, c.RetryWaitMax = waitMin, waitMax
		c.HTTPClient = &http.Client{Transport: base}
		return c.StandardClient()
	}},
	{"failsafe-go", func(base http.RoundTripper) *http.Client {
		policy := failsafehttp.NewRetryPolicyBuilder().
			WithMaxAttempts(maxAttempts).
			WithBackoff(waitMin, waitMax).
			WithJitterFactor(0.5).
			Build()
		return &http.Client{Transport: failsafehttp.NewRoundTripper(base, policy)}
	}},
}

// BenchmarkMachinery sends GETs and 1 KiB POSTs through each client and
// reads and closes each response. Beside wall time it reports the CPU time
// per request (cpu-ns/op), which on a busy machine is the steadier figure.
// Compare with
//
//	benchstat -col /impl machinery.txt
func BenchmarkMachinery(b *testing.B) {
	payload := bytes.Repeat([]byte("p"), 1024)
	const url = "https://api.example.com/v1/charges"
	for _, method := range []string{"GET", "POST"} {
		name := method
		if method == "POST" {
			name = "POST-1KiB"
		}
		for _, c := range clients {
			b.Run("req="+name+"/impl="+c.name, func(b *testing.B) {
				client := c.make(memoryTransport{})
				b.ReportAllocs()
				cpu := cputime.Start()
				for b.Loop() {
					var body io.Reader
					if method == "POST" {
						body = bytes.NewReader(payload)
					}
					req, err := http.NewRequest(method, url, body)
					if err != nil {
						b.Fatal(err)
					}
					resp, err := client.Do(req)
					if err != nil {
						b.Fatal(err)
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				cpu.Report(b, b.N)
			})
		}
	}
}
