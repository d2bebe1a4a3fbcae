package pgstore

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestCompleteFindsARecordTheHandlerUpdated(t *testing.T) {
	// A claim that inserted its row completes it by the ctid the insert
	// returned. A handler that updates the store's table in Tx (its own
	// record, or every row, by a statement of its own or a trigger) gives
	// the row a new version at another ctid: the complete must still find
	// it, rather than roll back a request whose handler did nothing
	// wrong, and roll it back again on every retry.
	for _, tt := range []struct {
		name   string
		update string // run in Tx, with the store's table for %s and the key for $1
	}{
		{"own record", `UPDATE %s SET fingerprint = fingerprint WHERE key = $1`},
		{"every record", `UPDATE %s SET sweep_at = sweep_at WHERE key <> '' OR key = $1`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, err := Tx(r.Context()).ExecContext(r.Context(), fmt.Sprintf(tt.update, s.table.quoted()), r.Header.Get("Idempotency-Key"))
				if !assert.NoError(t, err) {
					return
				}
				txPaymentsHandler().ServeHTTP(w, r)
			}))
			payThenReplay(t, h, "k")
			assert.Equal(t, 1, countPayments(t, db.DB, "k"))
		})
	}
}

func TestHandlerThatDeletesItsRecordIsRolledBack(t *testing.T) {
	// A complete that finds no row of its claim, at its ctid or by key,
	// is never taken for a success: the transaction is rolled back with
	// the handler's writes, the client gets 503, and nothing is kept.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := Tx(r.Context()).ExecContext(r.Context(), "DELETE FROM "+s.table.quoted()+" WHERE key = $1", r.Header.Get("Idempotency-Key"))
		if !assert.NoError(t, err) {
			return
		}
		txPaymentsHandler().ServeHTTP(w, r)
	}))
	status, body, _ := post(h, "k")
	assert.Equal(t, http.StatusServiceUnavailable, status, body)
	assert.Zero(t, countPayments(t, db.DB, "k"), "payments")
	assert.Zero(t, countKeys(t, db, s), "records")
	assert.Zero(t, db.Stats().InUse, "no transaction left open")
}

func TestTransactionalOverAPartitionedTable(t *testing.T) {
	// A team that runs its own migrations may partition the table. A
	// ctid is unique only within a partition; the complete's checks of
	// scope, key and token keep it to the claim's row, in each partition
	// the statement scans.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	for _, q := range []string{
		`CREATE TABLE parted (scope bytea NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL, token text NOT NULL,
    expires_at timestamptz NOT NULL, response bytea, sweep_at timestamptz NOT NULL DEFAULT 'infinity',
    PRIMARY KEY (scope, key)) PARTITION BY HASH (key)`,
		`CREATE TABLE parted_0 PARTITION OF parted FOR VALUES WITH (MODULUS 2, REMAINDER 0)`,
		`CREATE TABLE parted_1 PARTITION OF parted FOR VALUES WITH (MODULUS 2, REMAINDER 1)`,
		`CREATE INDEX parted_sweep_at ON parted (sweep_at)`,
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err, q)
	}
	s, err := New(db.DB, WithTable("parted"), WithTransactional())
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	h := idemserver.Middleware(s)(txPaymentsHandler())
	// Keys that land in both partitions, each at the same ctid there.
	for _, key := range []string{"a", "b", "c", "d", "e", "f"} {
		payThenReplay(t, h, key)
		assert.Equal(t, 1, countPayments(t, db.DB, key), key)
	}
	var parts int
	require.NoError(t, db.QueryRowContext(t.Context(), `SELECT count(DISTINCT tableoid) FROM parted WHERE response IS NOT NULL`).Scan(&parts))
	assert.Equal(t, 2, parts, "records in both partitions")
	var shared int
	require.NoError(t, db.QueryRowContext(t.Context(), `SELECT count(*) - count(DISTINCT ctid) FROM parted`).Scan(&shared))
	assert.Positive(t, shared, "rows of both partitions at one ctid")
}

// payThenReplay posts a payment with key to h, which must run it (201), and
// posts it again, which must replay that response, and returns its body.
func payThenReplay(t *testing.T, h http.Handler, key string) string {
	t.Helper()
	status, body, replayed := post(h, key)
	require.Equal(t, http.StatusCreated, status, body)
	require.False(t, replayed, key)
	status, again, replayed := post(h, key)
	assert.Equal(t, http.StatusCreated, status, key)
	assert.Equal(t, body, again, key)
	assert.True(t, replayed, "%s: the retry replays the stored response", key)
	return body
}

func TestClaimKeepsItsCtidThroughVacuum(t *testing.T) {
	// The complete finds an inserted claim at the ctid its insert
	// returned. While the claim's transaction is open, VACUUM (and the
	// pruning any statement does on the page) removes only versions no
	// snapshot can see, and VACUUM FULL, which rewrites the table, waits
	// for the claim's lock on it.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	// Dead versions on the page the claim's row goes to.
	for _, q := range []string{
		"INSERT INTO " + s.table.quoted() + " (scope, key, fingerprint, token, expires_at) SELECT '', 'dead-' || i, '', 't', now() FROM generate_series(1, 20) AS i",
		"DELETE FROM " + s.table.quoted(),
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err)
	}
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := Tx(r.Context())
		ctid := func() string {
			var at string
			require.NoError(t, tx.QueryRowContext(r.Context(), "SELECT ctid::text FROM "+s.table.quoted()+" WHERE key = 'k'").Scan(&at))
			return at
		}
		before := ctid()
		_, err := db.ExecContext(r.Context(), "VACUUM "+s.table.quoted())
		require.NoError(t, err)
		conn, err := db.Conn(r.Context())
		require.NoError(t, err)
		defer conn.Close()
		_, err = conn.ExecContext(r.Context(), "SET lock_timeout = '100ms'")
		require.NoError(t, err)
		_, err = conn.ExecContext(r.Context(), "VACUUM FULL "+s.table.quoted())
		assert.Equal(t, "55P03", sqlState(err), "VACUUM FULL waits for the claim's transaction: %v", err)
		assert.Equal(t, before, ctid(), "the claim's ctid")
		assert.Equal(t, before, r.Context().Value(txKey{}).(*txState).at, "the ctid the claim's insert returned")
		txPaymentsHandler().ServeHTTP(w, r)
	}))
	payThenReplay(t, h, "k")
}
