package pgstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestClaimExclusiveUnderChurn runs the read-first claim against
// every statement that deletes or replaces a key's row (Release, a Complete
// whose record expires at once and is then replaced, takeovers of expired
// leases, Sweep) and checks that no two requests ever hold one key at once,
// in both modes: in transactional mode Sweep runs beside claims that are
// open transactions, some of them replacing an expired row.
func TestClaimExclusiveUnderChurn(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) { claimUnderChurn(t, mode.opts...) })
	}
}

func claimUnderChurn(t *testing.T, opts ...Option) {
	db := newTestDB(t, 12)
	s := db.newStore(t, opts...)
	const (
		workers = 8
		keys    = 400
		lease   = time.Second
	)
	// A guessed retention of next to nothing puts sweep_at at the end of
	// each claim's lease, so that Sweep deletes rows while claims run.
	s.retention.Store(1)
	deadline := time.Now().Add(2 * time.Second)
	var holders [keys]atomic.Int32
	var wins, overlaps atomic.Int64
	var tokenN, sweptTotal atomic.Int64
	ctx := t.Context()
	stop := make(chan struct{})
	var sweeper sync.WaitGroup
	sweeper.Add(1)
	go func() {
		defer sweeper.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, _ := s.Sweep(ctx, 100)
			sweptTotal.Add(int64(n))
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				// Keys come back at random intervals, some shorter and
				// some longer than a lease, so that claims meet rows
				// that Sweep is deleting.
				time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
				k := rand.IntN(keys)
				c := testClaim(fmt.Sprintf("k%d", k), lease)
				c.Token = fmt.Sprintf("t%d", tokenN.Add(1))
				res, err := s.Claim(ctx, c)
				if err == nil && !res.Claimed && !res.Record.Completed() && !c.Now.Before(res.Record.LeaseExpires) {
					res, err = s.TakeOver(ctx, c, res.Record.Token)
				}
				if err != nil {
					errs <- err
					return
				}
				if !res.Claimed {
					continue
				}
				wins.Add(1)
				if holders[k].Add(1) > 1 {
					overlaps.Add(1)
				}
				time.Sleep(100 * time.Microsecond)
				holders[k].Add(-1)
				cctx := ctx // a transactional claim's own context
				if res.Context != nil {
					cctx = res.Context
				}
				switch i % 3 {
				case 0:
					err = s.Release(cctx, c.Key, c.Token)
				case 1: // kept for no time: expired at once, then replaced
					err = s.Complete(cctx, c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now())
				case 2: // a lease that ends at once, left to be taken over
					err = s.Extend(cctx, c.Key, c.Token, time.Now())
					if s.transactional && err == nil {
						// The claim holds until its transaction ends.
						err = s.Release(cctx, c.Key, c.Token)
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	sweeper.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	t.Logf("wins %d, rows swept %d", wins.Load(), sweptTotal.Load())
	assert.Positive(t, sweptTotal.Load(), "Sweep took part")
	assert.Positive(t, wins.Load())
	assert.Zero(t, overlaps.Load(), "two requests held one key at once")
}

// TestMigrateDoesNotWaitForOpenClaims: in transactional mode every
// request in flight holds ROW EXCLUSIVE on the table until it commits, and
// any DDL, even CREATE INDEX IF NOT EXISTS, takes a lock that waits for all
// of them while every claim after it waits behind it. Migrate of an
// up-to-date table, which every instance runs as it starts, runs no DDL.
func TestMigrateDoesNotWaitForOpenClaims(t *testing.T) {
	db := newTestDB(t, 8)
	s := db.newStore(t, WithTransactional())

	// A request in flight: claimed, its handler still running.
	c := testClaim("in-flight", time.Hour)
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	defer func() { _ = s.Release(res.Context, c.Key, c.Token) }()

	// Another instance starts.
	other, err := New(db.DB, WithTable(s.table.name), WithTransactional())
	require.NoError(t, err)
	migrated := make(chan error, 1)
	mctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	go func() { migrated <- other.Migrate(mctx) }()

	// A claim of an unrelated key while the new instance migrates.
	cctx, ccancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer ccancel()
	require.NoError(t, <-migrated, "Migrate of an up-to-date table waited for a request in flight")
	c2 := testClaim("unrelated", time.Hour)
	res2, err := s.Claim(cctx, c2)
	if err == nil && res2.Claimed {
		_ = s.Release(res2.Context, c2.Key, c2.Token)
	}
	assert.NoError(t, err, "a claim of an unrelated key waited behind Migrate")
}

// TestMigrateUpgradesConcurrently: several instances of the new
// build start at once over a table of the earlier schema.
func TestMigrateUpgradesConcurrently(t *testing.T) {
	db := newTestDB(t, 8)
	s, err := New(db.DB, WithTable("earlier"))
	require.NoError(t, err)
	for _, q := range []string{
		`CREATE TABLE "earlier" (scope bytea NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
    token text NOT NULL, expires_at timestamptz NOT NULL, response bytea, PRIMARY KEY (scope, key))`,
		`CREATE INDEX "earlier_expires_at" ON "earlier" (expires_at)`,
		`INSERT INTO "earlier" SELECT '', 'k' || i, '\x00', 't', now() + (i - 50) * interval '1 minute', '\x01'
    FROM generate_series(1, 100) AS i`,
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			other, err := New(db.DB, WithTable("earlier"))
			if err == nil {
				err = other.Migrate(t.Context())
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	var behind int
	require.NoError(t, db.QueryRowContext(t.Context(),
		`SELECT count(*) FROM "earlier" WHERE sweep_at < expires_at OR sweep_at = 'infinity'`).Scan(&behind))
	assert.Zero(t, behind)
	n, err := s.Sweep(t.Context(), 1000)
	require.NoError(t, err)
	assert.Equal(t, 50, n)
}

// TestSweepPastARowItCannotDelete: an instance of the earlier build, left
// running after Migrate, takes a row over by moving expires_at and not
// sweep_at, so a live record has its sweep_at passed. Sweep does not lock
// or count such a row, and deletes the expired row behind it.
func TestSweepPastARowItCannotDelete(t *testing.T) {
	db := newTestDB(t, 4)
	s := db.newStore(t)
	for _, key := range []string{"k", "dead"} {
		c := testClaim(key, time.Hour)
		_, err := s.Claim(t.Context(), c)
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))
	}
	// Both expired and due for sweeping, not swept yet.
	_, err := db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+
		` SET expires_at = now() - interval '3 seconds', sweep_at = now() - CASE key WHEN 'k' THEN interval '2 seconds' ELSE interval '1 second' END`)
	require.NoError(t, err)

	// The earlier build's replace, then its complete, of key k.
	_, err = db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+`
SET fingerprint = $1, token = 'old-build', expires_at = now() + 3600 * interval '1 second', response = NULL
WHERE key = 'k' AND token = 'token-k' AND expires_at <= now()`, make([]byte, 32))
	require.NoError(t, err)
	_, err = db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+`
SET response = '\x01c901000000', expires_at = statement_timestamp() + 86400 * interval '1 second'
WHERE key = 'k' AND token = 'old-build' AND response IS NULL`)
	require.NoError(t, err)

	var behind bool
	require.NoError(t, db.QueryRowContext(t.Context(),
		"SELECT sweep_at < expires_at FROM "+s.table.quoted()+" WHERE key = 'k'").Scan(&behind))
	require.True(t, behind, "a live record with sweep_at before expires_at")
	n, err := s.Sweep(t.Context(), 1)
	require.NoError(t, err)
	assert.Equal(t, 1, n, "Sweep(1) deleted no row, though one has expired")
}

// TestMigrateGivesUpOnALockedTable: Migrate's DDL that has to wait for the
// table's lock gives up after migrateLockTimeout, rather than queue behind
// a transaction in flight with every claim queued behind it.
func TestMigrateGivesUpOnALockedTable(t *testing.T) {
	db := newTestDB(t, 4)
	s, err := New(db.DB, WithTable("locked"))
	require.NoError(t, err)
	// The table without its index, so that Migrate has DDL to run.
	_, err = db.ExecContext(t.Context(), s.named.ddl[0])
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE "locked"`) })

	// A transaction in flight holds the table (ROW EXCLUSIVE), which
	// CREATE INDEX must wait for.
	tx, err := db.BeginTx(t.Context(), nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(t.Context(), `INSERT INTO "locked" (scope, key, fingerprint, token, expires_at) VALUES ('', 'k', '', 't', now())`)
	require.NoError(t, err)

	// Without a lock timeout of its own, Migrate would wait out this
	// context instead, and fail otherwise.
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	err = s.Migrate(ctx)
	require.ErrorContains(t, err, "lock timeout")

	require.NoError(t, tx.Rollback())
	require.NoError(t, s.Migrate(t.Context()), "once the table is free")
}
