package pgstore

import (
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

func TestLeaseModeUnderSerializableLoad(t *testing.T) {
	// Under serializable, PostgreSQL tracks what concurrent transactions
	// read by index page, and by table once it runs short of memory for
	// finer locks, so that on a busy table a statement fails with a
	// serialization failure although no other transaction touched its
	// row, and fails again each time it is run at that level. No lease
	// here can end, and no other claim has the keys, so every claim of a
	// new key, extension and completion must succeed: an extension that
	// kept failing would leave a live handler's lease to run out and its
	// key to be taken over, and a completion that did would leave its
	// record in progress, to be run again once the lease ended.
	db := newTestDB(t, 4)
	pool := db.openAtLevel(t, "serializable")
	pool.SetMaxOpenConns(32)
	s, err := New(pool, WithTable(db.newStore(t).table.name))
	require.NoError(t, err)

	const workers, rounds = 48, 20
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				key := strconv.Itoa(w) + "-" + strconv.Itoa(i)
				c := testClaim(key, time.Hour)
				c.Token = "token-" + key
				res, err := s.Claim(t.Context(), c)
				if !assert.NoError(t, err, "claim of %s", key) || !assert.True(t, res.Claimed, key) {
					return
				}
				for range 3 {
					assert.NoError(t, s.Extend(t.Context(), c.Key, c.Token, time.Now().Add(time.Hour)), "extension of %s", key)
					// A duplicate's claim reads the record in progress.
					dup := testClaim(key, time.Hour)
					dup.Token = "dup-" + key
					res, err := s.Claim(t.Context(), dup)
					if assert.NoError(t, err, "duplicate claim of %s", key) {
						assert.False(t, res.Claimed, key)
					}
				}
				assert.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)),
					"completion of %s", key)
			}
		})
	}
	wg.Wait()
	var n int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()+" WHERE response IS NOT NULL").Scan(&n))
	assert.Equal(t, workers*rounds, n, "every record completed")
}

func TestTransactionalUnderSerializableLoad(t *testing.T) {
	// Under serializable, the claim's transaction is the handler's, so
	// whatever the store's own statements read in it is tracked too, by
	// index page: a claim or a complete that looked its key up in the
	// table's index would conflict with every concurrent claim of a key
	// on the same page, and their requests would be rolled back, rerun
	// and, past MaxReruns, answered 503, though no two of them touched
	// one row. Here no handler reads anything: every request must run
	// once and be kept, and so at the other levels a database may
	// default to.
	for _, level := range []string{"read committed", "repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			pool := db.openAtLevel(t, level)
			pool.SetMaxOpenConns(16)
			s, err := New(pool, WithTransactional(), WithTable(db.newStore(t).table.name))
			require.NoError(t, err)
			var runs atomic.Int64
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				txPaymentsHandler().ServeHTTP(w, r)
			}))

			const workers, rounds = 8, 40
			var wg sync.WaitGroup
			for w := range workers {
				wg.Go(func() {
					for i := range rounds {
						key := strconv.Itoa(w) + "-" + strconv.Itoa(i)
						status, body, _ := post(h, key)
						assert.Equal(t, http.StatusCreated, status, "%s: %s", key, body)
					}
				})
			}
			wg.Wait()
			assert.Equal(t, int64(workers*rounds), runs.Load(), "handler runs")
			var n int
			require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM payments").Scan(&n))
			assert.Equal(t, workers*rounds, n, "payments")
		})
	}
}
