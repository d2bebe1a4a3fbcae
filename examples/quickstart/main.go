// Command quickstart makes a few dozen payments through idemhttp against a
// deliberately unreliable local server, then prints what each payment took.
//
// The server drops connections, answers 503 and 429 with Retry-After, and
// sometimes charges the card but loses the response, the case that makes
// blind retries dangerous. Its payment handler sits behind
// idemserver.Middleware, which runs it once per idempotency key and replays
// the outcome to retries. The handler's ledger records every charge it
// executes, by key, so the table shows what really happened on the server,
// down to the count of duplicate charges.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

func main() {
	payments := flag.Int("n", 30, "number of payments")
	workers := flag.Int("workers", 8, "payments made at once")
	seed := flag.Uint64("seed", 1, "seed of the server's faults")
	flag.Parse()
	if err := run(os.Stdout, *payments, *workers, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(out io.Writer, payments, workers int, seed uint64) error {
	ledger := newLedger()
	store := idemserver.NewMemoryStore()
	defer store.Close()
	dedup := idemserver.Middleware(store, idemserver.RequireKey())
	srv := httptest.NewServer(flaky(dedup(ledger), seed))
	defer srv.Close()

	var mu sync.Mutex
	results := make(map[string]*result, payments)
	ops := make([]string, payments)
	for i := range ops {
		ops[i] = fmt.Sprintf("payment-%02d", i+1)
		results[ops[i]] = &result{}
	}
	hook := func(a idemhttp.Attempt) {
		mu.Lock()
		defer mu.Unlock()
		r := results[a.Operation]
		if a.Sent {
			r.attempts++
		}
		r.key = a.Key
	}
	client := idemhttp.NewClient(
		idemhttp.WithMaxAttempts(6),
		idemhttp.WithBackoff(idemhttp.FullJitter(10*time.Millisecond, 200*time.Millisecond)),
		idemhttp.WithMaxRetryAfter(time.Second),
		idemhttp.WithAttemptHook(hook),
	)
	defer client.CloseIdleConnections()

	jobs := make(chan string)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for op := range jobs {
				outcome := pay(client, srv.URL, op)
				mu.Lock()
				results[op].outcome = outcome
				mu.Unlock()
			}
		})
	}
	start := time.Now()
	for _, op := range ops {
		jobs <- op
	}
	close(jobs)
	wg.Wait()
	elapsed := time.Since(start)

	return report(out, ops, results, ledger, elapsed)
}

type result struct {
	key      string
	attempts int
	outcome  string
}

// pay charges 100 cents for one order, as one logical operation.
func pay(client *http.Client, url, op string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = idemhttp.WithOperation(ctx, op)
	body := fmt.Sprintf(`{"order":%q,"amount":100}`, op)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/charges", strings.NewReader(body))
	if err != nil {
		return err.Error()
	}
	resp, err := client.Do(req)
	if err != nil {
		return "error"
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.Header.Get(idemserver.ReplayedHeader) == "true" {
		return resp.Status + " (replayed)"
	}
	return resp.Status
}

func report(out io.Writer, ops []string, results map[string]*result, l *ledger, elapsed time.Duration) error {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "OPERATION\tKEY\tATTEMPTS\tOUTCOME\tCHARGED")
	var attempts, succeeded, duplicates int
	for _, op := range ops {
		r := results[op]
		charged := l.count(r.key)
		attempts += r.attempts
		if strings.HasPrefix(r.outcome, "2") {
			succeeded++
		}
		duplicates += max(charged-1, 0)
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\n", op, r.key, r.attempts, r.outcome, charged)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(out, "\noperations: %d  attempts: %d  retries: %d  succeeded: %d  time: %v  charges: %d  duplicates: %d\n",
		len(ops), attempts, attempts-len(ops), succeeded, elapsed.Round(time.Millisecond), l.total(), duplicates)
	return err
}

// ledger is the payment handler: it charges the card and records every
// charge it executes, by idempotency key.
type ledger struct {
	mu      sync.Mutex
	charges map[string]int
}

func newLedger() *ledger { return &ledger{charges: make(map[string]int)} }

func (l *ledger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	l.mu.Lock()
	l.charges[r.Header.Get("Idempotency-Key")]++
	l.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charged":100}`)
}

func (l *ledger) count(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charges[key]
}

func (l *ledger) total() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.charges {
		n += c
	}
	return n
}

// flaky stands for an unreliable network and an overloaded server in front
// of the payment handler next, with faults drawn from a seeded source so a
// run can be repeated.
func flaky(next http.Handler, seed uint64) http.Handler {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, seed))
	roll := func() float64 {
		mu.Lock()
		defer mu.Unlock()
		return rng.Float64()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch p := roll(); {
		case p < 0.10: // the connection drops before the charge
			hangUp(w)
		case p < 0.20:
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
		case p < 0.28:
			w.Header().Set("Retry-After", "1")
			http.Error(w, "slow down", http.StatusTooManyRequests)
		case p < 0.40: // the card is charged, then the response is lost
			next.ServeHTTP(httptest.NewRecorder(), r)
			hangUp(w)
		default:
			next.ServeHTTP(w, r)
		}
	})
}

func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		conn.Close()
	}
}
