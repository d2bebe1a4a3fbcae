package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemhttp/idemhttp"
)

// With HoldKey the operation's key stays pending until the program has
// saved what the server answered and calls Settle. Had the program died
// before Settle, its next run would have found the operation pending and
// got the server's replay under the same key.
func ExampleSettle() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "paid pay_123")
	}))
	defer srv.Close()
	store := idemhttp.NewMemoryKeyStore() // a FileKeyStore, to survive a crash
	client := idemhttp.NewClient(idemhttp.WithKeyStore(store))
	defer client.CloseIdleConnections()

	ctx := context.Background()
	opCtx := idemhttp.WithOperation(ctx, "charge-order-1234", idemhttp.HoldKey())
	req, _ := http.NewRequestWithContext(opCtx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		fmt.Println(err) // the key stays pending: call again for the replay
		return
	}
	pending, _ := store.Pending(ctx)
	fmt.Printf("%s; pending until saved: %d\n", body, len(pending))

	// Save the payment in the program's own database here, then settle.
	if err := idemhttp.Settle(ctx, resp); err != nil {
		fmt.Println(err) // the key stays pending; the next call gets the replay
		return
	}
	pending, _ = store.Pending(ctx)
	fmt.Println("settled; pending:", len(pending))
	// Output:
	// paid pay_123; pending until saved: 1
	// settled; pending: 0
}
