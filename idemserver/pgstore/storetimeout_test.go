package pgstore

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestStoreTimeoutFiresMidCall runs concurrent duplicates of payments with
// a store timeout short enough to end claims, completions and commits
// while they are out, and a handler that runs longer than the timeout in
// the claim's transaction: whatever each client was told, no payment is
// made twice, no client is told of a payment that was not made, and once
// the store answers in time again every retry gets the answer the first
// client got (in lease mode, but for keys left in progress by a claim or
// completion that landed after its call timed out, until their lease
// ends). In transactional mode every payment comes with its stored
// response, so each key ends with exactly one.
func TestStoreTimeoutFiresMidCall(t *testing.T) {
	const keys = 12
	for _, transactional := range []bool{true, false} {
		for _, timeout := range []time.Duration{time.Millisecond, 40 * time.Millisecond} {
			t.Run(fmt.Sprintf("transactional=%t/timeout=%v", transactional, timeout), func(t *testing.T) {
				db := newTestDB(t, 6)
				_, err := db.ExecContext(t.Context(), createPayments)
				require.NoError(t, err)
				var opts []Option
				if transactional {
					opts = append(opts, WithTransactional())
				}
				store := db.newStore(t, opts...)
				// The end of a claim takes up to twice the store timeout,
				// in the server, so that the deadline cuts some in the
				// middle and lets others finish: a COMMIT that runs a
				// deferred trigger first, a completion in lease mode.
				_, err = db.ExecContext(t.Context(), fmt.Sprintf(`
					CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
					BEGIN PERFORM pg_sleep(random() * %f); RETURN NULL; END $$`, 2*timeout.Seconds()))
				require.NoError(t, err)
				if transactional {
					_, err = db.ExecContext(t.Context(), `CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON payments
						DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow()`)
				} else {
					_, err = db.ExecContext(t.Context(), `CREATE TRIGGER slow AFTER UPDATE ON `+store.table.quoted()+`
						FOR EACH ROW WHEN (NEW.response IS NOT NULL) EXECUTE FUNCTION slow()`)
				}
				require.NoError(t, err)
				payments := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					key := r.Header.Get("Idempotency-Key")
					var id int64
					var err error
					if tx := Tx(r.Context()); tx != nil {
						err = tx.QueryRowContext(r.Context(), "INSERT INTO payments (key) VALUES ($1) RETURNING id", key).Scan(&id)
						if err == nil {
							// Longer than the store timeout: the claim's
							// context must not end with the claim's call.
							_, err = tx.ExecContext(r.Context(), "SELECT pg_sleep(0.05)")
						}
					} else {
						err = db.QueryRowContext(r.Context(), "INSERT INTO payments (key) VALUES ($1) RETURNING id", key).Scan(&id)
					}
					if err != nil {
						Rerun(r.Context(), err)
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					w.WriteHeader(http.StatusCreated)
					fmt.Fprintf(w, `{"payment":%d}`, id)
				})
				var unknown, rolledBack, executed atomic.Int64
				h := idemserver.Middleware(store, idemserver.WithStoreTimeout(timeout),
					idemserver.WithObserver(func(e idemserver.Event) {
						switch {
						case errors.Is(e.Err, idemserver.ErrOutcomeUnknown):
							unknown.Add(1)
						case errors.Is(e.Err, idemserver.ErrRolledBack):
							rolledBack.Add(1)
						case e.Outcome == idemserver.OutcomeExecuted:
							executed.Add(1)
						}
					}))(payments)

				type answer struct {
					status int
					body   string
				}
				var mu sync.Mutex
				first := map[string][]answer{}
				var wg sync.WaitGroup
				for i := range keys {
					key := "k" + strconv.Itoa(i)
					for range 2 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							status, body, _ := post(h, key)
							mu.Lock()
							first[key] = append(first[key], answer{status, body})
							mu.Unlock()
						}()
					}
				}
				wg.Wait()

				t.Logf("executed %d, commits unknown %d, rolled back %d", executed.Load(), unknown.Load(), rolledBack.Load())
				// A transaction whose connection the store closed may
				// still be open on the server for a moment.
				wait := time.Duration(0)
				if transactional {
					wait = 5 * time.Second
				}
				healthy := idemserver.Middleware(store, idemserver.WithWaitInFlight(wait))(payments)
				for i := range keys {
					key := "k" + strconv.Itoa(i)
					n := countPayments(t, db.DB, key)
					assert.LessOrEqual(t, n, 1, "%s: paid once at most", key)
					for _, a := range first[key] {
						if a.status == http.StatusCreated {
							assert.Equal(t, 1, n, "%s: a client told of a payment that was made", key)
						}
					}
					status, body, _ := post(healthy, key)
					if !transactional && status == http.StatusConflict {
						// A claim or completion that landed after its
						// call timed out: the key stays in progress until
						// its lease ends.
						continue
					}
					require.Equal(t, http.StatusCreated, status, "%s: %s", key, body)
					assert.Equal(t, 1, countPayments(t, db.DB, key), "%s: paid once", key)
					for _, a := range first[key] {
						if a.status == http.StatusCreated {
							assert.Equal(t, a.body, body, "%s: the retry gets the first answer", key)
						}
					}
				}
			})
		}
	}
}
