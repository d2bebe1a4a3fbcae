package pgstore

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestCommitWaitingForSynchronousStandby has a transactional COMMIT wait
// longer than the store timeout for a synchronous standby, as it does
// when the standby lags: the server committed locally and waits to report
// it. The Complete must report the outcome unknown and release nothing;
// the retry must find the key in progress while the commit waits, and
// replay it once the commit is reported, with the payment made once.
//
// The server's configuration names a standby that never connects, for
// this test's sessions only: everyone else's commits are local.
func TestCommitWaitingForSynchronousStandby(t *testing.T) {
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	table := db.newStore(t, WithTransactional()).table.name

	admin := db.open(t, 1)
	for _, q := range []string{
		"ALTER SYSTEM SET synchronous_commit = 'local'",
		"ALTER SYSTEM SET synchronous_standby_names = 'idemtest_standby_that_never_connects'",
		"SELECT pg_reload_conf()",
	} {
		if _, err := admin.ExecContext(t.Context(), q); err != nil {
			t.Skipf("cannot configure synchronous replication: %v", err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{
			"ALTER SYSTEM RESET synchronous_standby_names",
			"ALTER SYSTEM RESET synchronous_commit",
			"SELECT pg_reload_conf()",
		} {
			_, err := admin.ExecContext(context.Background(), q)
			assert.NoError(t, err)
		}
	})

	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = db.schema
	cfg.RuntimeParams["synchronous_commit"] = "on"
	cfg.RuntimeParams["application_name"] = "idemtest_syncrep"
	pool := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pool.Close() })
	s, err := New(pool, WithTable(table), WithTransactional())
	require.NoError(t, err)
	store := &releaseCounter{Store: s}

	var events []idemserver.Event
	h := idemserver.Middleware(store, idemserver.WithStoreTimeout(300*time.Millisecond),
		idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(txPaymentsHandler())
	status, body, _ := post(h, "k")
	assert.Equal(t, http.StatusServiceUnavailable, status, body)
	assert.Contains(t, body, idemserver.ProblemStoreUnavailable)
	require.Len(t, events, 1)
	assert.ErrorIs(t, events[0].Err, idemserver.ErrOutcomeUnknown)
	assert.Zero(t, store.releases.Load(), "nothing released")

	// The commit still waits for the standby: the key is in progress. (A
	// COMMIT whose wait the store had cancelled would have been reported
	// committed, without the standby, and replayed: a failover would
	// then lose a payment its client was told of.)
	direct, err := New(db.DB, WithTable(table), WithTransactional())
	require.NoError(t, err)
	retry := idemserver.Middleware(direct)(txPaymentsHandler())
	status, body, _ = post(retry, "k")
	assert.Equal(t, http.StatusConflict, status, body)

	// Ending the wait reports the local commit.
	var cancelled bool
	require.NoError(t, admin.QueryRowContext(t.Context(), `
		SELECT count(pg_cancel_backend(pid)) = 1 FROM pg_stat_activity
		WHERE application_name = 'idemtest_syncrep' AND wait_event = 'SyncRep'`).Scan(&cancelled))
	require.True(t, cancelled, "one backend waited for the standby")
	require.Eventually(t, func() bool {
		status, body, _ = post(retry, "k")
		return status != http.StatusConflict
	}, 10*time.Second, 20*time.Millisecond)
	assert.Equal(t, http.StatusCreated, status, body)
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
}
