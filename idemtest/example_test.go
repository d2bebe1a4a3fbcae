package idemtest_test

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemtest"
)

// pay is the client code under test: it charges one order, as one logical
// operation named after the order, so that every retry sends the same key.
func pay(ctx context.Context, client *http.Client, baseURL, order string) (string, error) {
	ctx = idemhttp.WithOperation(ctx, "pay-"+order)
	body := fmt.Sprintf(`{"order":%q,"amount":100}`, order)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/payments", strings.NewReader(body))
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	receipt, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		return "", fmt.Errorf("payment of %s: %s", order, resp.Status)
	}
	return string(receipt), err
}

func ExampleNewServer() {
	// The handler under test: it charges the card and answers with a receipt.
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // a real handler would charge here
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "charged 100")
	})

	// A lossy server: connections reset, responses lost after the charge,
	// 503s and 429s. The seed makes the faults repeatable.
	srv := idemtest.NewServer(charge, idemtest.WithSeed(1), idemtest.WithFaults(idemtest.Faults{
		ResetBefore:     0.05,
		LoseResponse:    0.3,
		Unavailable:     0.05,
		TooManyRequests: 0.05,
		Latency:         0.2, MaxLatency: 5 * time.Millisecond,
	}))
	defer srv.Close()

	// The client under test, with enough attempts to get through. The server
	// fails on purpose, so the retry budget and the circuit breaker, which
	// protect a struggling server, are off.
	client := srv.Client(
		idemhttp.WithMaxAttempts(15),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 10*time.Millisecond)),
		idemhttp.WithBudget(nil),
		idemhttp.WithoutBreaker(),
	)
	defer client.CloseIdleConnections()

	orders := []string{"A-1", "A-2", "A-3", "A-4", "A-5"}
	for _, order := range orders {
		receipt, err := pay(context.Background(), client, srv.URL, order)
		if err != nil {
			fmt.Println(order, "failed:", err)
			continue
		}
		fmt.Println(order, receipt)
	}

	// The ledger: one key per operation, each executed once.
	runs := slices.Sorted(maps.Values(srv.Executions()))
	fmt.Println("executions per key:", runs)
	fmt.Println("duplicates:", len(srv.Duplicates()))
	// Output:
	// A-1 charged 100
	// A-2 charged 100
	// A-3 charged 100
	// A-4 charged 100
	// A-5 charged 100
	// executions per key: [1 1 1 1 1]
	// duplicates: 0
}
