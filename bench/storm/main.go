// Command storm measures how HTTP retry clients load a server through an
// outage: retry amplification, the server's load, success under random
// failures, and the time clients take to succeed again after the server
// recovers.
//
// Each configuration gets its own loopback server and its own http.Client,
// shared by many client goroutines that start requests at a steady rate
// whatever happens to earlier ones, as independent users of a service would.
// All configurations run at once, on the same timeline:
//
//	baseline  the server answers 200
//	outage    the server answers every request with 503
//	recovery  the server answers 200 again
//	steady    the server answers 503 to 5% of requests at random
//
// Usage, from the bench module:
//
//	go run ./storm [-rate 200] [-svg ../docs/retry-storm.svg]
//
// It prints a Markdown table and writes the requests per second the servers
// received during the first three phases as an SVG chart.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/failsafe-go/failsafe-go/failsafehttp"
	"github.com/hashicorp/go-retryablehttp"

	"github.com/idemhttp/idemhttp"
)

// phases of a run, as offsets from its start.
type phases struct {
	baseline, outage, recovery, steady time.Duration
}

func (p phases) outageStart() time.Duration    { return p.baseline }
func (p phases) outageEnd() time.Duration      { return p.baseline + p.outage }
func (p phases) steadyStart() time.Duration    { return p.outageEnd() + p.recovery }
func (p phases) end() time.Duration            { return p.steadyStart() + p.steady }
func (p phases) chartEnd() time.Duration       { return p.steadyStart() }
func (p phases) inOutage(d time.Duration) bool { return d >= p.outageStart() && d < p.outageEnd() }
func (p phases) inSteady(d time.Duration) bool { return d >= p.steadyStart() && d < p.end() }

// config is one client under test.
type config struct {
	name string
	// client builds the http.Client to test over base, which is the same
	// kind of connection pool for every configuration.
	client func(base *http.Transport) *http.Client
}

var configs = []config{
	{"idemhttp (defaults)", func(base *http.Transport) *http.Client {
		return &http.Client{Transport: idemhttp.NewTransport(base)}
	}},
	{"idemhttp (no budget, no breaker)", func(base *http.Transport) *http.Client {
		return &http.Client{Transport: idemhttp.NewTransport(base, idemhttp.WithBudget(nil), idemhttp.WithoutBreaker())}
	}},
	{"idemhttp (budget, no breaker)", func(base *http.Transport) *http.Client {
		return &http.Client{Transport: idemhttp.NewTransport(base, idemhttp.WithoutBreaker())}
	}},
	{"go-retryablehttp (defaults)", func(base *http.Transport) *http.Client {
		c := retryablehttp.NewClient()
		c.Logger = nil // it logs every attempt to stderr by default
		c.HTTPClient = &http.Client{Transport: base}
		return c.StandardClient()
	}},
	{"failsafe-go (HTTP retry policy defaults)", func(base *http.Transport) *http.Client {
		return &http.Client{Transport: failsafehttp.NewRoundTripper(base, failsafehttp.NewRetryPolicyBuilder().Build())}
	}},
}

const binWidth = 250 * time.Millisecond

// server is a loopback server that fails according to the phase, counting
// the attempts it receives per request and per time bin.
type server struct {
	ph    phases
	start time.Time
	ln    net.Listener
	srv   *http.Server

	bins []atomic.Int64 // attempts received per binWidth

	mu    sync.Mutex
	byReq map[int64]int // attempts received per logical request
}

func newServer(ph phases, start time.Time) (*server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &server{
		ph: ph, start: start, ln: ln,
		bins:  make([]atomic.Int64, int(ph.end()/binWidth)+400),
		byReq: make(map[int64]int),
	}
	s.srv = &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := s.srv.Serve(ln); err != http.ErrServerClosed {
			log.Printf("server: %v", err)
		}
	}()
	return s, nil
}

func (s *server) url() string { return "http://" + s.ln.Addr().String() + "/work" }

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	at := time.Since(s.start)
	if at < 0 { // warming up
		return
	}
	if i := int(at / binWidth); i < len(s.bins) {
		s.bins[i].Add(1)
	}
	if id, err := strconv.ParseInt(r.Header.Get("X-Storm-Request"), 10, 64); err == nil {
		s.mu.Lock()
		s.byReq[id]++
		s.mu.Unlock()
	}
	fail := s.ph.inOutage(at) || (s.ph.inSteady(at) && rand.Float64() < 0.05)
	if fail {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok")
}

func (s *server) attempts(id int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byReq[id]
}

// hitsBetween counts the attempts received in [from, to).
func (s *server) hitsBetween(from, to time.Duration) int64 {
	var n int64
	for i := int(from / binWidth); i < int(to/binWidth) && i < len(s.bins); i++ {
		n += s.bins[i].Load()
	}
	return n
}

// request is one logical request as its client saw it.
type request struct {
	id         int64
	start, end time.Duration
	ok         bool
}

// warmUp sends clients concurrent requests before the run starts, so that
// the run does not begin with a burst of dials.
func warmUp(client *http.Client, url string, clients int) {
	var wg sync.WaitGroup
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := client.Get(url)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
}

// result is what one configuration measured.
type result struct {
	name          string
	amplification float64 // attempts per logical request started in the outage
	outageOK      float64 // share of requests started in the outage that succeeded in the end
	loadRatio     float64 // server attempts/s in the outage over the baseline's
	steadySuccess float64 // share of requests started in the steady phase that succeeded
	steadyCount   int
	recovery      time.Duration // from the server's recovery to the last failure a client saw
	rps           []float64     // attempts/s received per bin, for the chart
}

func main() {
	ratePerConfig := flag.Float64("rate", 200, "logical requests per second per configuration")
	clients := flag.Int("clients", 50, "client goroutines per configuration")
	svgPath := flag.String("svg", "", "write the outage chart to this SVG file")
	ph := phases{}
	flag.DurationVar(&ph.baseline, "baseline", 4*time.Second, "length of the baseline phase")
	flag.DurationVar(&ph.outage, "outage", 8*time.Second, "length of the outage (100% 503)")
	flag.DurationVar(&ph.recovery, "recovery", 8*time.Second, "length of the recovery phase")
	flag.DurationVar(&ph.steady, "steady", 10*time.Second, "length of the steady phase (5% 503)")
	flag.Parse()

	results, err := run(ph, *ratePerConfig, *clients)
	if err != nil {
		log.Fatal(err)
	}
	printTable(os.Stdout, ph, *ratePerConfig, *clients, results)
	if *svgPath != "" {
		lines := make([]series, len(results))
		for i, r := range results {
			lines[i] = series{name: r.name, values: r.rps}
		}
		svg := renderChart(lines, binWidth, ph.outageStart(), ph.outageEnd())
		if err := os.WriteFile(*svgPath, []byte(svg), 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

func run(ph phases, ratePerConfig float64, clients int) ([]result, error) {
	// Clients warm up in the second before the run starts.
	start := time.Now().Add(time.Second)
	var wg sync.WaitGroup
	results := make([]result, len(configs))
	for i, cfg := range configs {
		srv, err := newServer(ph, start)
		if err != nil {
			return nil, err
		}
		defer srv.srv.Close()
		base := &http.Transport{
			Proxy:               nil,
			MaxIdleConns:        2000,
			MaxIdleConnsPerHost: 2000,
			IdleConnTimeout:     90 * time.Second,
		}
		defer base.CloseIdleConnections()
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := cfg.client(base)
			warmUp(client, srv.url(), clients)
			reqs := drive(client, srv.url(), start, ph, ratePerConfig, clients)
			results[i] = measure(cfg.name, srv, ph, reqs)
		}()
	}
	wg.Wait()
	return results, nil
}

// drive runs clients goroutines that together start ratePerSecond requests
// per second until the end of the run, each request on its own goroutine,
// and returns every request once all have ended.
func drive(client *http.Client, url string, start time.Time, ph phases, ratePerSecond float64, clients int) []request {
	interval := time.Duration(float64(clients) / ratePerSecond * float64(time.Second))
	var (
		nextID   atomic.Int64
		mu       sync.Mutex
		requests []request
		inflight sync.WaitGroup
		drivers  sync.WaitGroup
	)
	for c := range clients {
		drivers.Add(1)
		go func() {
			defer drivers.Done()
			// Spread the clients evenly over one interval.
			next := start.Add(interval * time.Duration(c) / time.Duration(clients))
			for {
				time.Sleep(time.Until(next))
				if time.Since(start) >= ph.end() {
					return
				}
				id := nextID.Add(1)
				inflight.Add(1)
				go func() {
					defer inflight.Done()
					r := send(client, url, id, start)
					mu.Lock()
					requests = append(requests, r)
					mu.Unlock()
				}()
				next = next.Add(interval)
			}
		}()
	}
	drivers.Wait()
	inflight.Wait()
	return requests
}

// send makes one logical request and reports how it went.
func send(client *http.Client, url string, id int64, start time.Time) request {
	r := request{id: id, start: time.Since(start)}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"order":`+strconv.FormatInt(id, 10)+`}`))
	if err != nil {
		panic(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Storm-Request", strconv.FormatInt(id, 10))
	resp, err := client.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		r.ok = resp.StatusCode == http.StatusOK
	}
	r.end = time.Since(start)
	return r
}

func measure(name string, srv *server, ph phases, reqs []request) result {
	res := result{name: name}
	var outageReqs, outageAttempts, outageOK, steadyOK int
	for _, r := range reqs {
		if ph.inOutage(r.start) {
			outageReqs++
			outageAttempts += srv.attempts(r.id)
			if r.ok {
				outageOK++
			}
		}
		if ph.inSteady(r.start) {
			res.steadyCount++
			if r.ok {
				steadyOK++
			}
		}
		if !r.ok && r.end > ph.outageEnd() && r.end < ph.steadyStart() {
			res.recovery = max(res.recovery, r.end-ph.outageEnd())
		}
	}
	res.amplification = float64(outageAttempts) / float64(max(outageReqs, 1))
	res.outageOK = float64(outageOK) / float64(max(outageReqs, 1))
	base := float64(srv.hitsBetween(0, ph.outageStart())) / ph.outageStart().Seconds()
	outage := float64(srv.hitsBetween(ph.outageStart(), ph.outageEnd())) / ph.outage.Seconds()
	res.loadRatio = outage / max(base, 1)
	res.steadySuccess = float64(steadyOK) / float64(max(res.steadyCount, 1))
	for i := 0; i < int(ph.chartEnd()/binWidth); i++ {
		res.rps = append(res.rps, float64(srv.bins[i].Load())/binWidth.Seconds())
	}
	return res
}

func printTable(w io.Writer, ph phases, rate float64, clients int, results []result) {
	fmt.Fprintf(w, "%d client goroutines per configuration starting %.0f requests/s in all; "+
		"baseline %v, outage %v (100%% 503), recovery %v, steady %v (5%% random 503).\n\n",
		clients, rate, ph.baseline, ph.outage, ph.recovery, ph.steady)
	fmt.Fprintln(w, "| configuration | amplification in outage (attempts per request) | server load in outage vs. before | success at 5% failures | recovery after outage | outage requests that succeeded late |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: |")
	for _, r := range results {
		fmt.Fprintf(w, "| %s | %.3f | %.2f× | %.3f%% (%d requests) | %s | %.1f%% |\n",
			r.name, r.amplification, r.loadRatio, 100*r.steadySuccess, r.steadyCount,
			r.recovery.Round(10*time.Millisecond), 100*r.outageOK)
	}
}
