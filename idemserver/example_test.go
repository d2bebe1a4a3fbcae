package idemserver_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

func ExampleMiddleware() {
	charges := 0
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge #%d", charges)
	})

	store := idemserver.NewMemoryStore()
	defer store.Close()
	handler := idemserver.Middleware(store, idemserver.RequireKey())(charge)

	// The client retries once, with the same key.
	for range 2 {
		r := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":100}`))
		r.Header.Set("Idempotency-Key", "order-1234")
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, r)
		fmt.Printf("%d replayed=%q %s\n", w.Code, w.Header().Get("Idempotent-Replayed"), w.Body)
	}
	fmt.Println("charges made:", charges)
	// Output:
	// 201 replayed="" charge #1
	// 201 replayed="true" charge #1
	// charges made: 1
}

func ExampleWithScope() {
	tenant := func(r *http.Request) string { return r.Header.Get("X-Tenant") }
	handler := idemserver.Middleware(nil, idemserver.WithScope(tenant))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "order for %s", r.Header.Get("X-Tenant"))
		}))

	// Two tenants happen to choose the same key.
	for _, t := range []string{"acme", "globex", "acme"} {
		r := httptest.NewRequest(http.MethodPost, "/orders", nil)
		r.Header.Set("Idempotency-Key", "1")
		r.Header.Set("X-Tenant", t)
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, r)
		fmt.Printf("%s: %s (replayed=%q)\n", t, w.Body, w.Header().Get("Idempotent-Replayed"))
	}
	// Output:
	// acme: order for acme (replayed="")
	// globex: order for globex (replayed="")
	// acme: order for acme (replayed="true")
}

func ExampleMemoryStore() {
	// At most 10,000 records, kept for an hour after they complete.
	store := idemserver.NewMemoryStore(idemserver.WithMaxEntries(10_000))
	defer store.Close()
	handler := idemserver.Middleware(store, idemserver.WithTTL(time.Hour))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "ok")
		}))

	for _, key := range []string{"a", "b", "a", "c"} {
		r := httptest.NewRequest(http.MethodPost, "/", nil)
		r.Header.Set("Idempotency-Key", key)
		handler.ServeHTTP(httptest.NewRecorder(), r)
	}
	fmt.Println("records:", store.Len())
	// Output:
	// records: 3
}

func ExampleParseKey() {
	for _, v := range []string{`8e03978e-40d5`, `"a key with \"quotes\""`, `not a key`} {
		key, err := idemserver.ParseKey(v)
		fmt.Printf("%q %v\n", key, err)
	}
	// Output:
	// "8e03978e-40d5" <nil>
	// "a key with \"quotes\"" <nil>
	// "" idemserver: malformed idempotency key: byte 0x20 at offset 3 is not allowed in a bare key
}
