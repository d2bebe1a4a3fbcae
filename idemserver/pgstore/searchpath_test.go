package pgstore

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestHandlerThatSetsTheSearchPath(t *testing.T) {
	// An app with a schema per tenant sets the search_path in the
	// handler's transaction, and each tenant's schema may hold a table of
	// the store's name (and payments of its own). The store's statements
	// name the schema its table was found in, so that whatever the
	// handler's search_path, the response is stored beside the claim in
	// the store's table, and a duplicate on another connection, or
	// another instance, replays it: the tenant's table of the same name
	// never holds a record.
	for _, tt := range []struct {
		name string
		set  string // run in Tx before the payment; %s is the tenant's schema
	}{
		{"SET LOCAL", "SET LOCAL search_path TO %s"},
		{"set_config local", "SELECT set_config('search_path', '%s', true)"},
		// Against the package's advice: a SET that outlives the
		// request on its pool connection once the transaction commits.
		{"SET", "SET search_path TO %s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 1) // one connection: each request reuses the one the handler set
			tenant := db.schema + "_tenant"
			_, err := db.ExecContext(t.Context(), "CREATE SCHEMA "+tenant)
			require.NoError(t, err)
			t.Cleanup(func() {
				_, err := db.ExecContext(context.Background(), "DROP SCHEMA "+tenant+" CASCADE")
				require.NoError(t, err)
			})
			s := db.newStore(t, WithTransactional())
			twin, err := New(db.DB, WithTable(tenant+"."+s.table.name))
			require.NoError(t, err)
			require.NoError(t, twin.Migrate(t.Context()))
			_, err = db.ExecContext(t.Context(), "CREATE TABLE "+tenant+".payments (id bigserial PRIMARY KEY, key text NOT NULL)")
			require.NoError(t, err)

			var runs int
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				_, err := Tx(r.Context()).ExecContext(r.Context(), fmt.Sprintf(tt.set, tenant))
				if !assert.NoError(t, err) {
					return
				}
				txPaymentsHandler().ServeHTTP(w, r)
			}))
			// Another instance, whose connections no handler has set.
			other := db.open(t, 1)
			s2, err := New(other, WithTable(s.table.name), WithTransactional())
			require.NoError(t, err)
			h2 := idemserver.Middleware(s2)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				w.WriteHeader(http.StatusTeapot)
			}))

			keys := []string{"a", "b", "c"}
			bodies := map[string]string{}
			for _, key := range keys {
				bodies[key] = payThenReplay(t, h, key)
			}
			for _, key := range keys {
				status, body, replayed := post(h2, key)
				assert.Equal(t, http.StatusCreated, status, key)
				assert.Equal(t, bodies[key], body, key)
				assert.True(t, replayed, key)
			}
			assert.Equal(t, len(keys), runs, "handler runs")
			var stored, twins, payments int
			require.NoError(t, other.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()+" WHERE response IS NOT NULL").Scan(&stored))
			require.NoError(t, other.QueryRowContext(t.Context(), "SELECT count(*) FROM "+twin.table.quoted()).Scan(&twins))
			require.NoError(t, other.QueryRowContext(t.Context(), "SELECT count(*) FROM "+tenant+".payments").Scan(&payments))
			assert.Equal(t, len(keys), stored, "records in the store's table")
			assert.Zero(t, twins, "records in the tenant's table of the same name")
			assert.Equal(t, len(keys), payments, "the tenant's payments")
		})
	}
}

func TestStoreFindsItsTableOnFirstUse(t *testing.T) {
	// A table that a team's own migration makes, rather than Migrate, is
	// looked up by the store's first statement: while there is none, a
	// claim fails and says how to make it; once there is one, the store
	// names its schema in every statement.
	db := newTestDB(t, 2)
	s, err := New(db.DB, WithTable("own"))
	require.NoError(t, err)
	_, err = s.Claim(t.Context(), testClaim("k", time.Hour))
	require.ErrorContains(t, err, "Migrate")

	_, err = db.ExecContext(t.Context(), strings.ReplaceAll(createTable, "{table}", `"own"`))
	require.NoError(t, err)
	res, err := s.Claim(t.Context(), testClaim("k", time.Hour))
	require.NoError(t, err)
	assert.True(t, res.Claimed)
	assert.Contains(t, s.stmt().complete, `"`+db.schema+`"."own"`)
	require.NoError(t, s.Complete(t.Context(), idemserver.Key{Key: "k"}, "token-k", &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))
}

func TestFirstUseWaitsForAConnectionWithinTheBound(t *testing.T) {
	// In transactional mode a claim's waits for a pool connection are
	// bounded, the wait of the lookup of its table's schema too.
	db := newTestDB(t, 1)
	table := db.newStore(t).table.name
	s, err := New(db.DB, WithTable(table), WithTransactional(), WithPoolWait(50*time.Millisecond))
	require.NoError(t, err)
	held, err := db.Conn(t.Context())
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = s.Claim(ctx, testClaim("k", time.Hour))
	require.ErrorIs(t, err, ErrPoolTimeout)
	require.NoError(t, held.Close())
	res, err := s.Claim(t.Context(), testClaim("k", time.Hour))
	require.NoError(t, err)
	assert.True(t, res.Claimed)
	require.NoError(t, s.Release(res.Context, idemserver.Key{Key: "k"}, "token-k"))
}
