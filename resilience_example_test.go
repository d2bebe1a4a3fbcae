package idemhttp_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/idemhttp/idemhttp"
)

// A server that is down: with a budget allowing retries of half the first
// attempts (and no floor), two clients sharing it make three retries for
// six requests instead of eighteen.
func ExampleNewBudget() {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()

	budget := idemhttp.NewBudget(idemhttp.BudgetRatio(0.5), idemhttp.BudgetMinRetriesPerSecond(0))
	opts := []idemhttp.Option{
		idemhttp.WithBudget(budget),
		idemhttp.WithoutBreaker(),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)),
	}
	clients := []*http.Client{idemhttp.NewClient(opts...), idemhttp.NewClient(opts...)}
	for i := range 6 {
		resp, err := clients[i%2].Get(srv.URL)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
	}
	fmt.Println("server hits:", hits.Load())
	fmt.Printf("%+v\n", budget.Stats())
	// Output:
	// server hits: 9
	// {FirstAttempts:6 Retries:3 Refused:6}
}

// A breaker that opens after three failures in a row: the first request
// ends with the server's last 503, the second fails fast without reaching
// the server.
func ExampleWithBreaker() {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()

	client := idemhttp.NewClient(
		idemhttp.WithBreaker(idemhttp.BreakerSettings{ConsecutiveFailures: 3, OpenTimeout: 30 * time.Second}),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)),
		idemhttp.WithAttemptHook(func(a idemhttp.Attempt) {
			for _, c := range a.BreakerChanges {
				fmt.Printf("attempt %d: breaker %s -> %s\n", a.Number, c.From, c.To)
			}
		}),
	)
	resp, err := client.Get(srv.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, "after", hits.Load(), "attempts")

	_, err = client.Get(srv.URL)
	fmt.Println("fails fast:", errors.Is(err, idemhttp.ErrCircuitOpen), "hits:", hits.Load())
	// Output:
	// attempt 3: breaker closed -> open
	// 503 after 3 attempts
	// fails fast: true hits: 3
}

// At most 50 attempts per second to each host, in bursts of up to 10; a 429
// from a host halves its rate, and successes restore it.
func ExampleWithRateLimit() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()

	client := idemhttp.NewClient(idemhttp.WithRateLimit(rate.Limit(50), 10))
	for range 3 {
		resp, err := client.Get(srv.URL)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode)
	}
	// Output:
	// 200
	// 200
	// 200
}
