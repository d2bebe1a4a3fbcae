package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// urlEnv passes the server's address to the restart children.
const urlEnv = "IDEMHTTP_KEYSTORE_TEST_URL"

// restartChild is one run of a program that charges through a file store.
// "restart-a" charges op-1 once; "restart-b" resumes whatever is pending.
// Each prints what it did, one fact per line.
func restartChild(mode, path string) {
	store, err := OpenFileKeyStore(path)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	defer store.Close()
	client := NewClient(WithKeyStore(store), WithMaxAttempts(3),
		WithBackoff(FullJitter(time.Millisecond, time.Millisecond)))
	defer client.CloseIdleConnections()
	charge := func(op string) {
		ctx := WithOperation(context.Background(), op)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, os.Getenv(urlEnv), strings.NewReader(`{"amount":100}`))
		if err != nil {
			fmt.Println("error:", err)
			return
		}
		resp, err := client.Do(req)
		if err != nil {
			fmt.Println("error:", err)
			return
		}
		resp.Body.Close()
		fmt.Println("status", op, resp.StatusCode)
	}
	listPending := func() []PendingOperation {
		ps, err := store.Pending(context.Background())
		if err != nil {
			fmt.Println("error:", err)
		}
		for _, p := range ps {
			fmt.Println("pending", p.Operation, p.Key)
		}
		return ps
	}
	switch mode {
	case "restart-a":
		charge("op-1")
		listPending()
	case "restart-b":
		for _, p := range listPending() {
			charge(p.Operation)
		}
		fmt.Println("left", len(listPending()))
	}
}

func TestFileKeyStoreRestartEndToEnd(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	status := http.StatusServiceUnavailable
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		w.WriteHeader(status)
	}))
	defer srv.Close()
	t.Setenv(urlEnv, srv.URL)
	path := filepath.Join(t.TempDir(), "keys")

	// Process A: every attempt gets a 503 until its retries run out.
	outA := runChild(t, "restart-a", path)
	mu.Lock()
	require.Len(t, keys, 3, "process A made all its attempts; it printed:\n%s", outA)
	key := keys[0]
	require.NotEmpty(t, key)
	for _, k := range keys {
		assert.Equal(t, key, k, "one key for every attempt of process A")
	}
	status = http.StatusCreated
	mu.Unlock()
	assert.Equal(t, "status op-1 503\npending op-1 "+key, outA)

	// Process B: a new process finds op-1 pending and finishes it.
	outB := runChild(t, "restart-b", path)
	assert.Equal(t, "pending op-1 "+key+"\nstatus op-1 201\nleft 0", outB)
	mu.Lock()
	require.Len(t, keys, 4)
	assert.Equal(t, key, keys[3], "process B sent process A's key")
	mu.Unlock()

	s := openTestStore(t, path)
	assert.Empty(t, pendingMap(t, s), "the finished operation is gone from the file")
}
