package pgstore

import (
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestConnectionSilentWhileEndingClaim has the connection go silent, as
// one does whose server vanished in a failover, just after the statement
// that ends a claim reached the server, which carries it out: the request
// must end within the middleware's store timeout, not when the kernel
// gives up on the connection, and without telling the client anything a
// retry would contradict. In transactional mode the COMMIT's outcome is
// unknown: 503, and no release. In lease mode the completion is tried
// again, finds its own response stored, and the client gets it.
func TestConnectionSilentWhileEndingClaim(t *testing.T) {
	const storeTimeout = time.Second
	for _, transactional := range []bool{true, false} {
		t.Run("transactional="+strconv.FormatBool(transactional), func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			var opts []Option
			if transactional {
				opts = append(opts, WithTransactional())
			}
			table := db.newStore(t, opts...).table.name

			cfg, err := pgx.ParseConfig(db.dsn)
			require.NoError(t, err)
			proxy := newCommitCutter(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), true)
			proxy.silent = true
			if !transactional {
				proxy.cutAt = "update" // the complete; the claim is a WITH
				cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
			}
			cfg.Host, cfg.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
			cfg.RuntimeParams["search_path"] = db.schema
			pool := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { _ = pool.Close() })
			s, err := New(pool, append(opts, WithTable(table))...)
			require.NoError(t, err)
			store := &releaseCounter{Store: s}

			var events []idemserver.Event
			payments := txPaymentsHandler()
			if !transactional {
				payments = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					_, err := db.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ($1)", r.Header.Get("Idempotency-Key"))
					require.NoError(t, err)
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write([]byte(`{"payment":1}`))
				})
			}
			h := idemserver.Middleware(store, idemserver.WithStoreTimeout(storeTimeout),
				idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					proxy.armed.Store(true) // this request's end goes silent
					payments.ServeHTTP(w, r)
				}))
			type answer struct {
				status int
				body   string
			}
			done := make(chan answer, 1)
			go func() {
				status, body, _ := post(h, "k")
				done <- answer{status, body}
			}()
			var a answer
			select {
			case a = <-done:
			case <-time.After(30 * time.Second):
				// Close the proxy's connections, so that the request
				// ends and the test can report.
				proxy.mu.Lock()
				for _, c := range proxy.conns {
					_ = c.Close()
				}
				proxy.mu.Unlock()
				<-done
				require.FailNow(t, "the request waited on the silent connection")
			}
			require.True(t, proxy.cut.Load(), "the end of the claim went through the proxy")
			require.Len(t, events, 1)
			assert.Zero(t, store.releases.Load(), "nothing released")
			if transactional {
				assert.Equal(t, http.StatusServiceUnavailable, a.status, a.body)
				assert.Contains(t, a.body, idemserver.ProblemStoreUnavailable)
				assert.ErrorIs(t, events[0].Err, idemserver.ErrOutcomeUnknown)
				assert.NotErrorIs(t, events[0].Err, idemserver.ErrRolledBack)
			} else {
				assert.Equal(t, http.StatusCreated, a.status, a.body)
				assert.Equal(t, idemserver.OutcomeExecuted, events[0].Outcome)
			}

			// The server committed: the retry replays, and the payment
			// was made once.
			direct, err := New(db.DB, append(opts, WithTable(table))...)
			require.NoError(t, err)
			retry := idemserver.Middleware(direct, idemserver.WithWaitInFlight(20*time.Second))(payments)
			status, body, replayed := post(retry, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.True(t, replayed, "replayed")
			assert.Equal(t, 1, countPayments(t, db.DB, "k"))
		})
	}
}
