package pgstore

import (
	"fmt"
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
	q := "INSERT INTO " + s.table.quoted() + ` (scope, key, fingerprint, token, expires_at, response)
SELECT '', 'expired-' || i, '\x00', 't', now() - i * interval '1 second',
       CASE WHEN i % 2 = 0 THEN '\x01'::bytea END
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
	rows, err := db.QueryContext(t.Context(), "SELECT key FROM "+s.table.quoted()+" ORDER BY key")
	require.NoError(t, err)
	defer rows.Close()
	var keys []string
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	return keys
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

func TestSweepConcurrently(t *testing.T) {
	// Several instances sweeping at once delete each expired row once and
	// never a live one.
	db := newTestDB(t, 8)
	s := db.newStore(t)
	live := fillForSweep(t, db, s, 500)
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
}

func TestSweepUsesTheExpiryIndex(t *testing.T) {
	db := newTestDB(t, 1)
	s := db.newStore(t)
	fillForSweep(t, db, s, 1000)
	_, err := db.ExecContext(t.Context(), "ANALYZE "+s.table.quoted())
	require.NoError(t, err)
	rows, err := db.QueryContext(t.Context(), "EXPLAIN "+strings.Replace(s.q.sweep, "$1", "100", 1))
	require.NoError(t, err)
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.NoError(t, rows.Err())
	assert.Contains(t, plan.String(), s.table.name+"_expires_at", "plan:\n%s", plan.String())
}
