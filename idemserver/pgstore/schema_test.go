package pgstore

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
				schema, table, table+"_expires_at").Scan(&indexdef))
			assert.Contains(t, indexdef, "(expires_at)")

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
	for _, q := range s.q.ddl {
		assert.Contains(t, string(doc), q+";\n", "docs/pgstore.md lacks the statement")
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
		"claim": q.claim, "replace": q.replace, "claimTx": q.claimTx, "read": q.read, "sweep": q.sweep,
	} {
		stmt = strings.ReplaceAll(stmt, `"t"`, "t")
		assert.True(t, strings.Contains(text, oneLine(stmt)), "docs/pgstore.md lacks the %s statement:\n%s", name, stmt)
	}
}
