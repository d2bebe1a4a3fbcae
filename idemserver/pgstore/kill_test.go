package pgstore

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// The kill tests run a server in a child process (this test binary again,
// running TestChildServer) and kill it with SIGKILL inside its handler,
// after the handler's business write.
const (
	childEnv      = "PGSTORE_TEST_CHILD"
	childSchema   = "PGSTORE_TEST_CHILD_SCHEMA"
	childTable    = "PGSTORE_TEST_CHILD_TABLE"
	childLease    = "PGSTORE_TEST_CHILD_LEASE"
	modeLease     = "lease"
	modeTx        = "transactional"
	childReady    = "ADDR "
	childWrote    = "WROTE"
	killTestLease = 4 * time.Second
)

// TestChildServer is the child's server: it prints its address, serves
// payments through the middleware, and in the handler, after recording the
// payment, prints that it did and hangs until it is killed.
func TestChildServer(t *testing.T) {
	mode := os.Getenv(childEnv)
	if mode == "" {
		t.Skip("the server the kill tests run in a child process")
	}
	cfg, err := pgx.ParseConfig(os.Getenv(dsnVariable))
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = os.Getenv(childSchema)
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	lease, err := time.ParseDuration(os.Getenv(childLease))
	require.NoError(t, err)
	opts := []Option{WithTable(os.Getenv(childTable))}
	if mode == modeTx {
		opts = append(opts, WithTransactional())
	}
	s, err := New(db, opts...)
	require.NoError(t, err)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var q querier = db
		if tx := Tx(r.Context()); tx != nil {
			q = tx
		}
		_, err := q.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ($1)", r.Header.Get("Idempotency-Key"))
		require.NoError(t, err)
		fmt.Println(childWrote)
		select {} // killed here
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	fmt.Println(childReady + ln.Addr().String())
	_ = http.Serve(ln, idemserver.Middleware(s, idemserver.WithLease(lease))(handler))
}

// killedChild starts the child server in mode over table, sends it a
// payment with key, and kills it with SIGKILL once its handler has
// recorded the payment.
func killedChild(t *testing.T, db *testDB, mode, table, key string) {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.CommandContext(t.Context(), exe, "-test.run=^TestChildServer$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode, childSchema+"="+db.schema, childTable+"="+table,
		childLease+"="+killTestLease.String())
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(out)
	next := func() string {
		require.True(t, lines.Scan(), "the child server ended: %v", lines.Err())
		return lines.Text()
	}
	addr, ok := strings.CutPrefix(next(), childReady)
	require.True(t, ok)

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/pay", strings.NewReader("b"))
		req.Header.Set("Idempotency-Key", key)
		client := &http.Client{Transport: &http.Transport{}}
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		assert.Error(t, err, "the killed server answered")
	})
	require.Equal(t, childWrote, next())
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	_, _ = io.Copy(io.Discard, out)
}

// post sends a payment with key to h and returns the status and body, and
// whether it was a replay.
func post(h http.Handler, key string) (int, string, bool) {
	w := serveOnce(h, key)
	return w.Code, w.Body.String(), w.Header().Get(idemserver.ReplayedHeader) == "true"
}

// serveOnce sends a payment, a POST /pay with body "b", with key to h.
func serveOnce(h http.Handler, key string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	r, _ := http.NewRequest(http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", key)
	h.ServeHTTP(w, r)
	return w
}

func TestKillLeaseMode(t *testing.T) {
	// A server dies in its handler after the business write. Its claim
	// stays in progress until the lease ends: retries get 409 until then,
	// and then exactly one of them takes over and runs the handler.
	db := newTestDB(t, 10)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t)
	start := time.Now()
	killedChild(t, db, modeLease, s.table.name, "k")
	require.Equal(t, 1, countPayments(t, db.DB, "k"), "the dead handler's write, not undone in lease mode")

	h := idemserver.Middleware(s, idemserver.WithLease(killTestLease))(paymentsHandler(db.DB))
	status, body, _ := post(h, "k")
	if time.Since(start) < killTestLease {
		assert.Equal(t, http.StatusConflict, status, "the dead lease has not ended: %s", body)
	}

	// Eight clients retry until they are answered.
	type answer struct {
		status   int
		body     string
		replayed bool
	}
	answers := make([]answer, 8)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Go(func() {
			deadline := time.Now().Add(killTestLease + 20*time.Second)
			for time.Now().Before(deadline) {
				status, body, replayed := post(h, "k")
				if status != http.StatusConflict {
					answers[i] = answer{status, body, replayed}
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	executed := 0
	for i, a := range answers {
		assert.Equal(t, http.StatusCreated, a.status, "client %d: %s", i, a.body)
		assert.Equal(t, answers[0].body, a.body, "client %d", i)
		if !a.replayed {
			executed++
		}
	}
	assert.Equal(t, 1, executed, "exactly one retry took over and ran")
	assert.Equal(t, 2, countPayments(t, db.DB, "k"), "the dead handler's write and the takeover's")
}

func TestKillTransactionalMode(t *testing.T) {
	// A server dies in its handler after the business write: its
	// transaction dies with its connection, so neither the payment nor the
	// claim is left, and the retry runs the handler once, at once.
	db := newTestDB(t, 10)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	killedChild(t, db, modeTx, s.table.name, "k")

	h := idemserver.Middleware(s, idemserver.WithWaitInFlight(20*time.Second))(txPaymentsHandler())
	status, body, replayed := post(h, "k")
	assert.Equal(t, http.StatusCreated, status, body)
	assert.False(t, replayed)
	assert.Equal(t, 1, countPayments(t, db.DB, "k"), "the retry's payment only")
	status, body2, replayed := post(h, "k")
	assert.Equal(t, http.StatusCreated, status)
	assert.True(t, replayed)
	assert.Equal(t, body, body2)
}
