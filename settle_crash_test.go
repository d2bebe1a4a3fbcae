package idemhttp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// holdChild is one run of a program that pays order pay-1 through a file
// key store with HoldKey and records the payment in its own database (a
// file beside the store) before it settles the key. At startup it pays
// every order its database lacks. "hold-slow" saves so slowly that it is
// killed first; "hold" saves at once. Each prints what it did, one fact
// per line.
func holdChild(mode, path string) {
	store, err := OpenFileKeyStore(path)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	defer store.Close()
	client := NewClient(WithKeyStore(store))
	defer client.CloseIdleConnections()
	ctx := context.Background()
	pending, err := store.Pending(ctx)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	for _, p := range pending {
		fmt.Println("pending", p.Operation, p.Key)
	}
	db := path + ".db"
	saved, _ := os.ReadFile(db) // none yet on the first run
	if slices.Contains(strings.Fields(string(saved)), "pay-1") {
		return
	}
	req, err := http.NewRequestWithContext(WithOperation(ctx, "pay-1", HoldKey()),
		http.MethodPost, os.Getenv(urlEnv), strings.NewReader(`{"amount":100}`))
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println("read", resp.StatusCode, string(body), "replayed", resp.Header.Get("Idempotent-Replayed"))
	if mode == "hold-slow" {
		time.Sleep(time.Minute) // killed here, before the save
	}
	if err := os.WriteFile(db, []byte("pay-1\n"), 0o600); err != nil {
		fmt.Println("error:", err)
		return
	}
	if err := Settle(ctx, resp); err != nil {
		fmt.Println("error:", err)
		return
	}
	left, err := store.Pending(ctx)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println("settled, pending", len(left))
}

// A program that holds its operation's key and is killed (SIGKILL) after
// reading the server's answer and before saving it restarts with the key
// still pending: it pays again with that key, gets the server's replay
// and settles, and the charge ran once. Without the held key, the key is
// released as the body is read, and the restarted program pays under a
// new key: a second charge.
func TestHeldKeySurvivesACrashBeforeTheSave(t *testing.T) {
	if testing.Short() {
		t.Skip("runs child processes")
	}
	srv := newChargeServer(t)
	t.Setenv(urlEnv, srv.URL)
	path := filepath.Join(t.TempDir(), "keys")

	lines := runKilledChild(t, "hold-slow:"+path, -1, func(line string) bool {
		return strings.HasPrefix(line, "read ")
	})
	require.Equal(t, []string{"read 200 paid replayed "}, lines)
	keys := srv.keys.all()
	require.Len(t, keys, 1)

	out := runChild(t, "hold", path)
	assert.Equal(t, "pending pay-1 "+keys[0]+"\nread 200 paid replayed true\nsettled, pending 0", out)
	assert.Equal(t, []string{keys[0], keys[0]}, srv.keys.all(), "the restarted program sent the held key")
	assert.Equal(t, int32(1), srv.executions.Load(), "charged once")

	assert.Empty(t, runChild(t, "hold", path), "a third run finds the payment saved and nothing pending")
	s := openTestStore(t, path)
	assert.Empty(t, pendingMap(t, s), "the settled key is gone from the file")
}
