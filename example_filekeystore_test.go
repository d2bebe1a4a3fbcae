package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/idemhttp/idemhttp"
)

// A key recorded in a file store survives a restart: the program that
// starts next lists the unfinished operations and sends each again with the
// key the server has already seen.
func ExampleOpenFileKeyStore() {
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		if len(keys) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable) // the first process gives up here
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	dir, _ := os.MkdirTemp("", "idemhttp-example")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "pending.keys")

	charge := func(store idemhttp.KeyStore, operation string) int {
		client := idemhttp.NewClient(idemhttp.WithKeyStore(store), idemhttp.WithMaxAttempts(1))
		defer client.CloseIdleConnections()
		ctx := idemhttp.WithOperation(context.Background(), operation)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
		resp, err := client.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}

	// The first run: the call fails and its key stays pending on disk.
	store, err := idemhttp.OpenFileKeyStore(path, idemhttp.WithStaleAfter(24*time.Hour))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("first run:", charge(store, "charge-order-1234"))
	store.Close()

	// The next run finishes what the last one left pending.
	store, err = idemhttp.OpenFileKeyStore(path, idemhttp.WithStaleAfter(24*time.Hour))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	pending, _ := store.Pending(context.Background())
	for _, op := range pending {
		if op.Stale {
			continue // the server may have forgotten the key: needs a person
		}
		fmt.Println("resumed", op.Operation+":", charge(store, op.Operation))
	}
	pending, _ = store.Pending(context.Background())
	fmt.Println("same key both times:", keys[0] == keys[1], "- pending now:", len(pending))
	// Output:
	// first run: 503
	// resumed charge-order-1234: 201
	// same key both times: true - pending now: 0
}
