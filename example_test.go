package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemhttp/idemhttp"
)

// A server that fails twice, then succeeds: the client retries with the
// same idempotency key and the caller sees only the success.
func ExampleNewClient() {
	var calls atomic.Int32
	keys := map[string]bool{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys[r.Header.Get("Idempotency-Key")] = true
		if calls.Add(1) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		fmt.Fprint(w, "charged")
	}))
	defer srv.Close()

	client := idemhttp.NewClient(idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 10*time.Millisecond)))
	defer client.CloseIdleConnections()
	resp, err := client.Post(srv.URL, "application/json", strings.NewReader(`{"amount":100}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, "after", calls.Load(), "attempts with", len(keys), "key")
	// Output: 200 after 3 attempts with 1 key
}

// WithOperation ties a key to a business operation: a call whose retries
// ran out leaves the key pending, and the next call for the same operation
// sends it again, so the server can recognise the repeat.
func ExampleWithOperation() {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	store := idemhttp.NewMemoryKeyStore()
	client := idemhttp.NewClient(idemhttp.WithKeyStore(store), idemhttp.WithMaxAttempts(2),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)))
	defer client.CloseIdleConnections()
	ctx := idemhttp.WithOperation(context.Background(), "order-1234")

	for range 2 {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("{}"))
		resp, err := client.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
		pending, _ := store.Pending(ctx)
		fmt.Println(resp.StatusCode, "pending operations:", len(pending))
	}
	// Output:
	// 502 pending operations: 1
	// 201 pending operations: 0
}

// ParseRetryAfter accepts both forms RFC 9110 allows.
func ExampleParseRetryAfter() {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	for _, v := range []string{"120", "Sun, 22 Nov 2026 12:00:30 GMT", "soon"} {
		wait, ok := idemhttp.ParseRetryAfter(v, now)
		fmt.Println(wait, ok)
	}
	// Output:
	// 2m0s true
	// 30s true
	// 0s false
}
