package idemhttp

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkTransport measures the happy path, one request at a time over a
// loopback connection: through a bare http.Transport; through a bare one
// with the caller setting a fresh UUIDv7 key by hand, so the same bytes
// cross the wire and the server parses the same header; and through
// idemhttp wrapping the same kind of transport. The server runs in the same
// process, so its allocations count too. Compare with
//
//	benchstat -col /impl old.txt
func BenchmarkTransport(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = w.Write([]byte("ok"))
	}))
	defer srv.Close()
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
		{"GET", func() *http.Request { r, _ := http.NewRequest("GET", srv.URL, nil); return r }},
		{"POST-1KiB", func() *http.Request {
			r, _ := http.NewRequest("POST", srv.URL, bytes.NewReader(payload))
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
