package idemserver_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idemhttp/idemhttp/idemserver"
)

func ExampleKeyFrom() {
	// A payment provider that deduplicates requests by their key.
	var charges atomic.Int64
	provider := httptest.NewServer(idemserver.Middleware(nil, idemserver.RequireKey())(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "ch_%d", charges.Add(1))
		})))
	defer provider.Close()

	// The shop's handler charges the customer, naming the charge by a key
	// derived from its own, and then saves the order.
	runs := 0
	shop := idemserver.Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		key, _ := idemserver.KeyFrom(r.Context())
		req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, provider.URL+"/charges",
			strings.NewReader(`{"amount":100}`))
		req.Header.Set("Idempotency-Key", key.Derive("charge"))
		resp, err := provider.Client().Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		charge, _ := io.ReadAll(resp.Body)
		if runs == 1 {
			// Saving the order fails the first time. The 500 releases the
			// shop's key, so the client's retry runs the handler again.
			http.Error(w, "could not save the order", http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, "order paid by %s", charge)
	}))

	// The client sends the order, and retries it with the same key.
	for range 2 {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		r.Header.Set("Idempotency-Key", "order-1234")
		w := httptest.NewRecorder()
		shop.ServeHTTP(w, r)
		fmt.Println(w.Code, strings.TrimSpace(w.Body.String()))
	}
	fmt.Println("handler runs:", runs, "charges:", charges.Load())
	// Output:
	// 500 could not save the order
	// 200 order paid by ch_1
	// handler runs: 2 charges: 1
}

func ExampleKey_Derive() {
	key := idemserver.Key{Scope: "tenant-42", Key: "order-1234"}
	fmt.Println(key.Derive("charge"))
	fmt.Println(key.Derive("refund"))
	// Output:
	// 3Q4mnb5idbXSQsZ6jo1_RmMJMd--uJUnqO8HfQW_ynU
	// HaJHOqK0uqINy5Ig1H7_IonhAao_bOzOlOYVJw7JLB8
}
