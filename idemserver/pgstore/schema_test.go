package pgstore

import (
	"context"
	"database/sql"
	"os"
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

func TestWithTable(t *testing.T) {
	db := &sql.DB{} // New does not touch the database
	for _, tt := range []struct {
		name   string
		quoted string // empty: refused
	}{
		{"keys", `"keys"`},
		{"Keys_2", `"Keys_2"`},
		{"_x", `"_x"`},
		{"app.keys", `"app"."keys"`},
		{strings.Repeat("k", maxTableName), `"` + strings.Repeat("k", maxTableName) + `"`},
		{"", ""},
		{".", ""},
		{"app.", ""},
		{".keys", ""},
		{"a.b.c", ""},
		{"1keys", ""},
		{"key-s", ""},
		{`ke"ys`, ""},
		{"keys; DROP TABLE users", ""},
		{"ké", ""},
		{strings.Repeat("k", maxTableName+1), ""},
		{strings.Repeat("s", 64) + ".keys", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, err := New(db, WithTable(tt.name))
			if tt.quoted == "" {
				require.ErrorIs(t, err, ErrInvalidTable)
				assert.Nil(t, s)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.quoted, s.table.quoted())
		})
	}
	s, err := New(db)
	require.NoError(t, err)
	assert.Equal(t, `"`+DefaultTable+`"`, s.table.quoted())
	_, err = New(nil)
	assert.Error(t, err)
}

func TestMigrate(t *testing.T) {
	db := newTestDB(t, 8)
	_, err := db.ExecContext(t.Context(), "CREATE SCHEMA other")
	require.NoError(t, err)
	// t.Context is done by the time cleanups run.
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP SCHEMA other CASCADE") })

	for _, name := range []string{DefaultTable, "Mixed_Case", "other.keys"} {
		t.Run(name, func(t *testing.T) {
			s, err := New(db.DB, WithTable(name))
			require.NoError(t, err)
			// Several instances at once, and again: idempotent.
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() { assert.NoError(t, s.Migrate(t.Context())) })
			}
			wg.Wait()
			require.NoError(t, s.Migrate(t.Context()))

			schema, table := db.schema, name
			if before, after, ok := strings.Cut(name, "."); ok {
				schema, table = before, after
			}
			var indexdef string
			require.NoError(t, db.QueryRowContext(t.Context(),
				"SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 AND indexname = $3",
				schema, table, table+"_sweep_at").Scan(&indexdef))
			assert.Contains(t, indexdef, "(sweep_at)")

			// The store works on the table it made.
			c := testClaim("k", 3600e9)
			res, err := s.Claim(t.Context(), c)
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		})
	}
}

func TestDocumentedSchemaIsMigrate(t *testing.T) {
	// docs/pgstore.md shows the SQL Migrate runs, for teams that run their
	// own migrations; it must be the same.
	doc, err := os.ReadFile("../../docs/pgstore.md")
	require.NoError(t, err)
	s, err := New(&sql.DB{})
	require.NoError(t, err)
	for _, q := range append(s.named.ddl, s.named.upgrade...) {
		assert.True(t, strings.Contains(string(doc), q+";\n"), "docs/pgstore.md lacks the statement\n%s", q)
	}
}

func TestDocumentedStatementsAreTheStores(t *testing.T) {
	// docs/pgstore.md shows the statements the store sends, over a table
	// named t; up to white space, they must be the code's.
	doc, err := os.ReadFile("../../docs/pgstore.md")
	require.NoError(t, err)
	oneLine := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	text := oneLine(string(doc))
	q := newStatements(tableName{name: "t"})
	for name, stmt := range map[string]string{
		"claim": q.claim, "replace": q.replace, "claimTx": q.claimTx, "read": q.read, "sweep": q.sweep, "complete": q.complete,
		"held": q.held, "completeAt": q.completeAt,
	} {
		stmt = strings.ReplaceAll(stmt, `"t"`, "t")
		assert.True(t, strings.Contains(text, oneLine(stmt)), "docs/pgstore.md lacks the %s statement:\n%s", name, stmt)
	}
}

func TestMigrateUpgradesAnEarlierTable(t *testing.T) {
	// A table of the earlier schema (no sweep_at, an index on expires_at)
	// gets sweep_at from expires_at, the sweep index instead of the old
	// one, and works: its expired rows are swept, its live ones kept.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), "CREATE SCHEMA upgraded")
	require.NoError(t, err)
	// t.Context is done by the time cleanups run.
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP SCHEMA upgraded CASCADE") })

	for _, name := range []string{"earlier", "upgraded.earlier"} {
		t.Run(name, func(t *testing.T) {
			s, err := New(db.DB, WithTable(name))
			require.NoError(t, err)
			// The earlier schema is written out, not derived from
			// createTable: it is what earlier builds made, whatever this
			// one makes.
			for _, q := range []string{
				`CREATE TABLE {table} (
    scope       bytea       NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    token       text        NOT NULL,
    expires_at  timestamptz NOT NULL,
    response    bytea,
    PRIMARY KEY (scope, key)
)`,
				`CREATE INDEX {old_index} ON {table} (expires_at)`,
				`INSERT INTO {table} VALUES
    ('', 'expired', '\x00', 't', now() - interval '1 second', '\x01'),
    ('', 'live', '\x00', 't', now() + interval '1 hour', '\x01')`,
			} {
				q = strings.NewReplacer("{table}", s.table.quoted(), "{old_index}", `"`+s.table.name+`_expires_at"`).Replace(q)
				_, err := db.ExecContext(t.Context(), q)
				require.NoError(t, err)
			}

			require.NoError(t, s.Migrate(t.Context()))
			require.NoError(t, s.Migrate(t.Context()), "again")

			schema := db.schema
			if before, _, ok := strings.Cut(name, "."); ok {
				schema = before
			}
			indexes := queryStrings(t, db.DB,
				"SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 ORDER BY indexname", schema, s.table.name)
			assert.Equal(t, []string{s.table.name + "_pkey", s.table.name + "_sweep_at"}, indexes)

			var behind int
			require.NoError(t, db.QueryRowContext(t.Context(),
				"SELECT count(*) FROM "+s.table.quoted()+" WHERE sweep_at IS DISTINCT FROM expires_at").Scan(&behind))
			assert.Zero(t, behind, "rows whose sweep_at is not their expires_at")
			var options string
			require.NoError(t, db.QueryRowContext(t.Context(),
				"SELECT coalesce(array_to_string(reloptions, ','), '') FROM pg_class WHERE oid = to_regclass($1)",
				s.table.quoted()).Scan(&options))
			assert.Equal(t, "fillfactor=80", options)

			n, err := s.Sweep(t.Context(), 10)
			require.NoError(t, err)
			assert.Equal(t, 1, n)
			assert.Equal(t, []string{"live"}, keysIn(t, db, s))
		})
	}
}

func TestMigrateLeavesAForeignTableAlone(t *testing.T) {
	// A table of the store's name that the store did not make (another
	// library's, say, with an expires_at column and an index named as the
	// earlier schema's was) is refused with an error that names it, and
	// left as it was: no column added, no index dropped, no row rewritten.
	db := newTestDB(t, 4)
	s, err := New(db.DB)
	require.NoError(t, err)
	for _, q := range []string{
		`CREATE TABLE "idempotency_keys" (id serial PRIMARY KEY, key text NOT NULL, expires_at timestamptz NOT NULL)`,
		`CREATE INDEX "idempotency_keys_expires_at" ON "idempotency_keys" (expires_at)`,
		`INSERT INTO "idempotency_keys" (key, expires_at) VALUES ('theirs', now())`,
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err)
	}
	columns := func() []string {
		return queryStrings(t, db.DB, `SELECT attname FROM pg_attribute
WHERE attrelid = '"idempotency_keys"'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum`)
	}
	indexes := func() []string {
		return queryStrings(t, db.DB, `SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'idempotency_keys' ORDER BY indexname`, db.schema)
	}
	wantColumns, wantIndexes := columns(), indexes()

	err = s.Migrate(t.Context())
	require.Error(t, err)
	assert.Contains(t, err.Error(), `"idempotency_keys"`)
	assert.Contains(t, err.Error(), "scope")
	assert.Equal(t, wantColumns, columns(), "the table's columns")
	assert.Equal(t, wantIndexes, indexes(), "the table's indexes")
	assert.Equal(t, []string{"theirs"}, keysIn(t, db, s))
}

func TestMigrateRefusesTimesWithoutATimeZone(t *testing.T) {
	// A table made by hand whose expires_at or sweep_at is a timestamp
	// without a time zone keeps the wall-clock time of the session that
	// wrote it, and each session reads it in its own TimeZone: an instance
	// whose sessions are in Tokyo finds a lease claimed from UTC ended
	// eight hours ago, takes it over while its handler runs, and sweeps
	// live records. Migrate refuses such a table, naming the columns, and
	// changes nothing in it.
	for _, tt := range []struct {
		name, expiresAt, sweepAt, want string
	}{
		{"both", "timestamp", "timestamp", "expires_at is timestamp without time zone, sweep_at is timestamp without time zone"},
		{"expires_at", "timestamp(3)", "timestamptz", "expires_at is timestamp(3) without time zone"},
		{"sweep_at", "timestamptz", "timestamp", "sweep_at is timestamp without time zone"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s, err := New(db.DB, WithTable("keys"))
			require.NoError(t, err)
			_, err = db.ExecContext(t.Context(), `CREATE TABLE keys (
	scope bytea NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL, token text NOT NULL,
	expires_at `+tt.expiresAt+` NOT NULL, response bytea, sweep_at `+tt.sweepAt+` NOT NULL DEFAULT 'infinity',
	PRIMARY KEY (scope, key));
CREATE INDEX keys_sweep_at ON keys (sweep_at)`)
			require.NoError(t, err)
			types := func() []string {
				return queryStrings(t, db.DB, `SELECT format_type(atttypid, atttypmod) FROM pg_attribute
WHERE attrelid = 'keys'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum`)
			}
			before := types()

			err = s.Migrate(t.Context())
			require.Error(t, err)
			assert.Contains(t, err.Error(), `"keys"`)
			assert.Contains(t, err.Error(), tt.want)
			assert.Equal(t, before, types(), "the columns' types")
		})
	}
}

func TestMigrateAfterAnotherInstanceUnderEachIsolationLevel(t *testing.T) {
	// Migrate waits for its advisory lock while another instance creates
	// the table, and then finds the table made: whatever the database's
	// default isolation level, which a snapshot taken before the wait
	// would keep from showing the new table's columns, so that the table
	// would look like someone else's and the instance would fail to start.
	for _, level := range isolationLevels {
		t.Run(level, func(t *testing.T) {
			db := newTestDB(t, 4)
			s, err := New(db.openAtLevel(t, level), WithTable("keys"))
			require.NoError(t, err)

			// The other instance, holding the lock, as its Migrate does.
			other, err := db.BeginTx(t.Context(), nil)
			require.NoError(t, err)
			defer func() { _ = other.Rollback() }()
			_, err = other.ExecContext(t.Context(), `SELECT pg_advisory_xact_lock($1)`, int64(migrateLock))
			require.NoError(t, err)

			done := make(chan error, 1)
			go func() { done <- s.Migrate(t.Context()) }()
			require.Eventually(t, func() bool {
				var waiting bool
				err := db.QueryRowContext(t.Context(), `SELECT EXISTS (SELECT FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND objid = $1::bigint & x'ffffffff'::bigint)`, int64(migrateLock)).Scan(&waiting)
				return err == nil && waiting
			}, 10*time.Second, time.Millisecond, "Migrate waits for the lock")
			for _, q := range s.named.ddl {
				_, err := other.ExecContext(t.Context(), q)
				require.NoError(t, err)
			}
			require.NoError(t, other.Commit())

			require.NoError(t, <-done)
			res, err := s.Claim(t.Context(), testClaim("k", 3600e9))
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		})
	}
}

func TestMigrateCompletesTheTableItFinds(t *testing.T) {
	// The search_path names two schemas, and the store's table, without
	// its sweep index, is in the second: the first is where CREATE TABLE
	// puts a table without a schema. Migrate must add the index to the
	// table the store uses, not create another, empty one in the first
	// schema that hides it, and every record in it with it, from then on.
	// The second schema's name, found in the catalog, needs quoting: it
	// has a capital, a dot, a space and a double quote.
	db := newTestDB(t, 2)
	later := db.schema + `_Later. "x"`
	_, err := db.ExecContext(t.Context(), "CREATE SCHEMA "+quoteIdent(later))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP SCHEMA "+quoteIdent(later)+" CASCADE") })
	_, err = db.ExecContext(t.Context(), strings.ReplaceAll(strings.ReplaceAll(createTable, "{table}", quoteIdent(later)+".keys"), "IF NOT EXISTS ", ""))
	require.NoError(t, err)

	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = `"$user", ` + db.schema + ", " + quoteIdent(later)
	pool := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pool.Close() })
	s, err := New(pool, WithTable("keys"))
	require.NoError(t, err)
	c := testClaim("k", time.Hour)
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, time.Now().Add(time.Hour)))

	require.NoError(t, s.Migrate(t.Context()))
	var tables int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM pg_tables WHERE tablename = 'keys' AND schemaname IN ($1, $2)",
		db.schema, later).Scan(&tables))
	assert.Equal(t, 1, tables, "Migrate made a second table")
	var indexes int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'keys' AND indexname = 'keys_sweep_at'",
		later).Scan(&indexes))
	assert.Equal(t, 1, indexes, "the table's sweep index")

	c2 := testClaim("k", time.Hour)
	c2.Token = "another"
	res, err = s.Claim(t.Context(), c2)
	require.NoError(t, err)
	assert.False(t, res.Claimed, "the key's record was forgotten")
	assert.Equal(t, 201, res.Record.Response.Status)
}
