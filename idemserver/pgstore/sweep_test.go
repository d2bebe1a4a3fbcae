package pgstore

import (
	"database/sql"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// fillForSweep puts expired rows (completed and in progress) and live rows
// (a live lease, a live completed record) in s's table, and returns the
// keys of the live ones.
func fillForSweep(t *testing.T, db *testDB, s *Store, expired int) []string {
	t.Helper()
	q := "INSERT INTO " + s.table.quoted() + ` (scope, key, fingerprint, token, expires_at, response, sweep_at)
SELECT '', 'expired-' || i, '\x00', 't', now() - i * interval '1 second',
       CASE WHEN i % 2 = 0 THEN '\x01'::bytea END, now() - i * interval '1 second'
FROM generate_series(1, $1) AS i`
	_, err := db.ExecContext(t.Context(), q, expired)
	require.NoError(t, err)
	var live []string
	for i, completed := range []bool{false, true, false, true} {
		c := testClaim(fmt.Sprintf("live-%d", i), time.Hour)
		res, err := s.Claim(t.Context(), c)
		require.NoError(t, err)
		require.True(t, res.Claimed)
		if completed {
			require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))
		}
		live = append(live, c.Key.Key)
	}
	return live
}

func keysIn(t *testing.T, db *testDB, s *Store) []string {
	t.Helper()
	return queryStrings(t, db.DB, "SELECT key FROM "+s.table.quoted()+" ORDER BY key")
}

// queryStrings returns the one text column of the rows that q returns.
func queryStrings(t *testing.T, db *sql.DB, q string, args ...any) []string {
	t.Helper()
	rows, err := db.QueryContext(t.Context(), q, args...)
	require.NoError(t, err)
	defer rows.Close()
	var all []string
	for rows.Next() {
		var v string
		require.NoError(t, rows.Scan(&v))
		all = append(all, v)
	}
	require.NoError(t, rows.Err())
	return all
}

func TestSweepInBatches(t *testing.T) {
	db := newTestDB(t, 4)
	s := db.newStore(t)
	live := fillForSweep(t, db, s, 25)
	var batches []int
	for {
		n, err := s.Sweep(t.Context(), 10)
		require.NoError(t, err)
		batches = append(batches, n)
		if n < 10 {
			break
		}
	}
	assert.Equal(t, []int{10, 10, 5}, batches)
	assert.Equal(t, live, keysIn(t, db, s), "only the live records remain")

	// The live lease is untouched and still completes.
	c := testClaim("live-0", time.Hour)
	require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))

	_, err := s.Sweep(t.Context(), 0)
	assert.Error(t, err)
}

func TestSweepLimits(t *testing.T) {
	db := newTestDB(t, 4)
	s := db.newStore(t)
	live := fillForSweep(t, db, s, 5)
	for _, limit := range []int{0, -1, math.MinInt} {
		n, err := s.Sweep(t.Context(), limit)
		assert.Error(t, err, "limit %d", limit)
		assert.Zero(t, n)
	}
	assert.Len(t, keysIn(t, db, s), 5+len(live), "a refused limit deletes nothing")
	n, err := s.Sweep(t.Context(), 1)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	n, err = s.Sweep(t.Context(), math.MaxInt)
	require.NoError(t, err)
	assert.Equal(t, 4, n)
	assert.Equal(t, live, keysIn(t, db, s), "only the live records remain")
}

func TestSweepConcurrently(t *testing.T) {
	// Several instances sweeping at once delete each expired row once and
	// never a live one, and none fails, whatever the database's default
	// isolation level: under repeatable read or serializable, a sweep
	// that meets a row another deleted after its snapshot would fail.
	for _, level := range isolationLevels {
		t.Run(level, func(t *testing.T) {
			db := newTestDB(t, 8)
			filled := db.newStore(t)
			live := fillForSweep(t, db, filled, 500)
			s, err := New(db.openAtLevel(t, level), WithTable(filled.table.name))
			require.NoError(t, err)
			var total atomic.Int64
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for {
						n, err := s.Sweep(t.Context(), 7)
						if !assert.NoError(t, err) {
							return
						}
						total.Add(int64(n))
						if n == 0 {
							return
						}
					}
				})
			}
			wg.Wait()
			assert.Equal(t, int64(500), total.Load())
			assert.Equal(t, live, keysIn(t, db, s))
		})
	}
}

func TestSweepUsesItsIndex(t *testing.T) {
	db := newTestDB(t, 1)
	s := db.newStore(t)
	fillForSweep(t, db, s, 1000)
	_, err := db.ExecContext(t.Context(), "ANALYZE "+s.table.quoted())
	require.NoError(t, err)
	rows, err := db.QueryContext(t.Context(), "EXPLAIN "+strings.Replace(s.stmt().sweep, "$1", "100", 1))
	require.NoError(t, err)
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.NoError(t, rows.Err())
	assert.Contains(t, plan.String(), s.table.name+"_sweep_at", "plan:\n%s", plan.String())
}

func TestCompleteIsAHOTUpdate(t *testing.T) {
	// A claim sets sweep_at a retention past its lease, so that a complete
	// within that retention changes no indexed column: every complete is
	// a HOT update, in both modes.
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			}))
			const keys = 50
			for i := range keys {
				require.Equal(t, http.StatusCreated, serveOnce(h, fmt.Sprintf("k%d", i)).Code)
			}
			// Backends report their counts within a second or so of going
			// idle.
			var updates, hot int
			require.Eventually(t, func() bool {
				err := db.QueryRowContext(t.Context(), "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
					s.table.quoted()).Scan(&updates, &hot)
				return err == nil && updates == keys
			}, 20*time.Second, 50*time.Millisecond)
			assert.Equal(t, updates, hot, "updates that were not HOT")
		})
	}
}

func TestSweepAtNeverBeforeExpiry(t *testing.T) {
	// Sweep finds rows on sweep_at; a row must never be swept before it
	// expires, so every statement that moves expires_at keeps sweep_at at
	// or after it, whatever the retention guessed at the claim.
	db := newTestDB(t, 4)
	s := db.newStore(t)
	gap := func(key string) time.Duration {
		t.Helper()
		var seconds float64
		require.NoError(t, db.QueryRowContext(t.Context(),
			"SELECT extract(epoch FROM sweep_at - expires_at)::float8 FROM "+s.table.quoted()+" WHERE key = $1", key).Scan(&seconds))
		return time.Duration(seconds * float64(time.Second))
	}
	c := testClaim("k", time.Hour)
	_, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	assert.InDelta(t, idemserver.DefaultTTL.Seconds(), gap("k").Seconds(), 1, "a claim: the default retention past its lease")

	require.NoError(t, s.Extend(t.Context(), c.Key, c.Token, time.Now().Add(72*time.Hour)))
	assert.Zero(t, gap("k"), "an extension past sweep_at moves it")

	require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(100*time.Hour)))
	assert.Zero(t, gap("k"), "a retention past sweep_at moves it")

	// The store now guesses 100 hours; a shorter retention leaves sweep_at.
	c2 := testClaim("k2", time.Hour)
	_, err = s.Claim(t.Context(), c2)
	require.NoError(t, err)
	require.NoError(t, s.Complete(t.Context(), c2.Key, c2.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))
	assert.InDelta(t, 100*time.Hour.Seconds(), gap("k2").Seconds(), 5, "a retention shorter than guessed")

	// Expired by its retention, not yet by sweep_at: kept, never
	// replayed; a claim of its key replaces it.
	_, err = db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+" SET expires_at = now() - interval '1 second' WHERE key = 'k2'")
	require.NoError(t, err)
	n, err := s.Sweep(t.Context(), 10)
	require.NoError(t, err)
	assert.Zero(t, n)
	c3 := testClaim("k2", time.Hour)
	res, err := s.Claim(t.Context(), c3)
	require.NoError(t, err)
	assert.True(t, res.Claimed)
	// The last retention given was an hour: the replacing claim's
	// sweep_at is that past its lease.
	assert.InDelta(t, time.Hour.Seconds(), gap("k2").Seconds(), 5, "a replacing claim sets sweep_at anew")
}

func TestSweepAtOfTheLongestRetention(t *testing.T) {
	// A retention as long as a time.Duration holds, added to a lease,
	// must not wrap around and put sweep_at before the lease's end.
	db, s := newCompleted(t, "long", time.Now().Add(math.MaxInt64))
	c2 := testClaim("after", time.Hour)
	_, err := s.Claim(t.Context(), c2)
	require.NoError(t, err)
	var before bool
	require.NoError(t, db.QueryRowContext(t.Context(),
		"SELECT sweep_at < expires_at FROM "+s.table.quoted()+" WHERE key = 'after'").Scan(&before))
	assert.False(t, before, "sweep_at before the lease's end")
}

func TestCompleteTakesTheRetentionAsGiven(t *testing.T) {
	// The middleware stamps a completion with its time and the record's
	// expiry; the retention is their difference, exactly, in both modes,
	// so the store's guess of it for later claims' sweep_at settles.
	for _, mode := range []struct {
		name string
		opts []Option
	}{{"lease", nil}, {"transactional", []Option{WithTransactional()}}} {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			const ttl = 7 * time.Hour
			h := idemserver.Middleware(s, idemserver.WithTTL(ttl))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			}))
			status, body, _ := post(h, "k")
			require.Equal(t, http.StatusCreated, status, body)
			assert.Equal(t, ttl, time.Duration(s.retention.Load()))
		})
	}
}
