package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
)

// DefaultTable is the table a Store keeps its records in unless
// [WithTable] names another.
const DefaultTable = "idempotency_keys"

// ErrInvalidTable is returned by [New] for a table name that [WithTable]
// does not accept.
var ErrInvalidTable = errors.New("pgstore: invalid table name")

// maxTableName is the longest table name accepted: PostgreSQL truncates
// identifiers to 63 bytes, and index names add "_expires_at" (the earlier
// schema's, which Migrate drops) or "_sweep_at" to it.
const maxTableName = 63 - len("_expires_at")

// migrateLock is the advisory lock that serializes Migrate across
// instances, since concurrent CREATE TABLE IF NOT EXISTS can fail.
// It is "idemhttp" in ASCII.
const migrateLock = 0x6964656d68747470

// tableName is a validated table name: an optional schema and a table.
type tableName struct {
	schema, name string
}

// parseTable validates s, "table" or "schema.table", each part a plain
// identifier: an ASCII letter or underscore, then letters, digits or
// underscores. Names are case-sensitive and used quoted.
func parseTable(s string) (tableName, error) {
	t := tableName{name: s}
	parts := []string{s}
	if schema, name, ok := strings.Cut(s, "."); ok {
		t = tableName{schema: schema, name: name}
		parts = []string{schema, name}
	}
	for _, part := range parts {
		if err := checkIdentifier(part); err != nil {
			return tableName{}, fmt.Errorf("%w %q: %v", ErrInvalidTable, s, err)
		}
	}
	if len(t.name) > maxTableName {
		return tableName{}, fmt.Errorf("%w %q: a table name is at most %d bytes", ErrInvalidTable, s, maxTableName)
	}
	return t, nil
}

func checkIdentifier(s string) error {
	if s == "" {
		return errors.New("empty identifier")
	}
	if len(s) > 63 {
		return errors.New("an identifier is at most 63 bytes")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		letter := c == '_' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
		if !letter && (i == 0 || c < '0' || c > '9') {
			return fmt.Errorf("byte %q at offset %d: only ASCII letters, digits and underscores, not starting with a digit", c, i)
		}
	}
	return nil
}

// quoted returns the table's name as it appears in SQL.
func (t tableName) quoted() string {
	if t.schema == "" {
		return quoteIdent(t.name)
	}
	return quoteIdent(t.schema) + "." + quoteIdent(t.name)
}

// index returns the quoted name of the sweep index; an index lives in its
// table's schema.
func (t tableName) index() string { return quoteIdent(t.name + "_sweep_at") }

// oldIndex returns the quoted name, with its schema, of the earlier
// schema's expiry index.
func (t tableName) oldIndex() string {
	if t.schema == "" {
		return quoteIdent(t.name + "_expires_at")
	}
	return quoteIdent(t.schema) + "." + quoteIdent(t.name+"_expires_at")
}

// quoteIdent quotes an identifier for SQL. Names given to WithTable hold no
// quote; a schema that Migrate finds in the catalog may.
func quoteIdent(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// statements holds the SQL of one table.
type statements struct {
	ddl      []string
	upgrade  []string
	claim    string
	replace  string
	complete string
	release  string
	extend   string
	sweep    string
	read     string
	claimTx  string
	held     string

	completeAt string
}

// newStatements returns the statements over table t.
//
// Every record is a row keyed by (scope, key). A row whose response is
// NULL is in progress, and its expires_at is the end of its lease; a row
// with a response is completed, and its expires_at is the end of its
// retention. Its sweep_at, on which Sweep finds it, is never before its
// expires_at: each statement that moves expires_at later moves sweep_at
// too unless it already lies beyond. A claim sets sweep_at a retention
// past the end of its lease, so that the complete, which sets the
// retention, leaves it as it is when the retention is no longer than the
// one guessed: the complete changes no indexed column and is a HOT update.
// Times are the database's: each statement computes them from now() and a
// duration in seconds.
func newStatements(t tableName) statements {
	r := strings.NewReplacer("{table}", t.quoted(), "{index}", t.index(), "{old_index}", t.oldIndex())
	// complete measures the retention from the statement, not from
	// now(), the start of its transaction: in transactional mode that
	// is the claim, and the handler may have run for longer than the
	// retention since. A completion sent again, after the answer to
	// one that stored its response was lost, finds that response
	// under its token (tokens are unique to a claim) and succeeds,
	// rather than report the lease lost to a client whose outcome
	// is kept.
	complete := r.Replace(`UPDATE {table}
SET response = $4, expires_at = statement_timestamp() + $5::float8 * interval '1 second',
	sweep_at = greatest(sweep_at, statement_timestamp() + $5::float8 * interval '1 second')
WHERE scope = $1 AND key = $2 AND token = $3 AND (response IS NULL OR response = $4)`)
	return statements{
		ddl: []string{
			r.Replace(createTable),
			r.Replace(createIndex),
		},
		upgrade: []string{
			r.Replace(upgradeColumn),
			r.Replace(upgradeRows),
			r.Replace(upgradeFillfactor),
			r.Replace(createIndex),
			r.Replace(upgradeDropIndex),
		},
		// The claim reads the key's row and, when there is none,
		// inserts one, in one statement that writes nothing when a row
		// exists; a claim that inserted returns a row of NULLs. The read
		// comes first, so that a replay probes the primary key once and
		// the insert gets no row to try. Both parts see the statement's
		// snapshot: when a concurrent claim commits the row after the
		// snapshot was taken, the read does not see it and the insert
		// finds the conflict (waiting for that claim's commit), so no row
		// comes back and the store runs the statement again.
		claim: r.Replace(`WITH cur AS (
	SELECT ` + rowColumns + ` FROM {table}
	WHERE scope = $1 AND key = $2
), ins AS (
	INSERT INTO {table} (scope, key, fingerprint, token, expires_at, sweep_at)
	SELECT $1, $2, $3, $4, now() + $5::float8 * interval '1 second', now() + $6::float8 * interval '1 second'
	WHERE NOT EXISTS (SELECT FROM cur)
	ON CONFLICT (scope, key) DO NOTHING
	RETURNING true
)
SELECT NULL::bytea, NULL::text, NULL::float8, NULL::bytea FROM ins
UNION ALL
SELECT * FROM cur`),
		// replace takes over a row that has expired, in progress (its
		// lease ended) or completed (its retention ended), and still holds
		// the token the caller saw: a compare-and-set.
		replace: r.Replace(`UPDATE {table}
SET fingerprint = $3, token = $4, expires_at = now() + $5::float8 * interval '1 second', response = NULL,
	sweep_at = now() + $7::float8 * interval '1 second'
WHERE scope = $1 AND key = $2 AND token = $6 AND expires_at <= now()`),
		complete: complete,
		release: r.Replace(`DELETE FROM {table}
WHERE scope = $1 AND key = $2 AND token = $3 AND response IS NULL`),
		extend: r.Replace(`UPDATE {table}
SET expires_at = now() + $4::float8 * interval '1 second',
	sweep_at = greatest(sweep_at, now() + $4::float8 * interval '1 second')
WHERE scope = $1 AND key = $2 AND token = $3 AND response IS NULL`),
		read: r.Replace(`SELECT ` + rowColumns + ` FROM {table}
WHERE scope = $1 AND key = $2`),
		// claimTx is the claim of transactional mode, in the claim's
		// transaction: with the key's advisory lock and its token's (see
		// tokenLockID), both taken without waiting, it inserts the claim;
		// it always returns one row, with whether it got each lock, the
		// inserted row's ctid (NULL unless it inserted) and the token's
		// lock, which the claim's checks look for (see held). The row
		// that is there is read only by a claim that did not insert: the
		// lateral subquery's condition on the insert gates its index
		// scan, so that a claim that inserts reads nothing of the table,
		// which under serializable would be tracked by index page (see
		// completeAt).
		// The locks are the key's (see lockID) and the token's mixed with
		// the table's oid: a name without a schema names a different
		// table under each search_path, and those tables' keys must not
		// share locks. The lock CTE is read twice, so it runs once.
		claimTx: r.Replace(`WITH lock AS (
	SELECT pg_try_advisory_xact_lock(id) AS locked, pg_try_advisory_xact_lock(token_id) AS token_locked, token_id
	FROM (SELECT $6 # '{table}'::regclass::oid::int8, $8 # '{table}'::regclass::oid::int8) AS k (id, token_id)
), ins AS (
	INSERT INTO {table} (scope, key, fingerprint, token, expires_at, sweep_at)
	SELECT $1, $2, $3, $4, now() + $5::float8 * interval '1 second', now() + $7::float8 * interval '1 second'
	FROM lock WHERE locked AND token_locked
	ON CONFLICT (scope, key) DO NOTHING
	RETURNING ctid::text AS at
)
SELECT lock.locked, lock.token_locked, (SELECT at FROM ins), lock.token_id, found.*
FROM lock LEFT JOIN LATERAL (
	SELECT ` + rowColumns + ` FROM {table}
	WHERE scope = $1 AND key = $2 AND lock.locked AND NOT EXISTS (SELECT FROM ins)
) AS found ON true`),
		// completeAt is complete in transactional mode, for a claim whose
		// row its transaction inserted at ctid $6: it finds the row by
		// ctid, not through the primary key. Under serializable a lookup
		// in the index is tracked by index page, which every concurrent
		// claim of a key on that page writes to, so that claims of
		// different keys would fail each other's commits; the row this
		// transaction wrote it reads without being tracked. A row the
		// transaction updated since is no longer at that ctid; the
		// complete by key finds it (see completeTx).
		completeAt: strings.Replace(complete, "WHERE ", "WHERE ctid = $6::tid AND ", 1),
		// held reports whether a claim of transactional mode is still
		// open: whether any session holds the advisory lock $1 of its
		// token in this database, which only the claim's transaction
		// takes. An advisory lock on a bigint shows in pg_locks as its
		// high and low 32 bits, with objsubid 1. Whether the claim's row
		// was committed instead is the next statement's question (see
		// extendTx), not this one's.
		held: `SELECT EXISTS (SELECT FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted
	AND classid = (($1::int8 >> 32) & 4294967295)::oid AND objid = ($1::int8 & 4294967295)::oid
	AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()))`,
		// sweep deletes a batch of expired rows. SKIP LOCKED lets several
		// instances sweep at once without waiting on each other's rows
		// (or on a row a claim is replacing), and the outer test of
		// expires_at keeps a row that was extended meanwhile.
		sweep: r.Replace(`DELETE FROM {table} AS d
USING (
	SELECT scope, key FROM {table}
	WHERE sweep_at <= now() AND expires_at <= now()
	ORDER BY sweep_at
	LIMIT $1
	FOR UPDATE SKIP LOCKED
) AS old
WHERE d.scope = old.scope AND d.key = old.key AND d.expires_at <= now()`),
	}
}

// rowColumns are the columns of a record's row that the claim statements
// return, scanned by [row.dest]; the time left is the seconds from the
// database's now() to expires_at, so that no clock but the database's
// is read.
const rowColumns = `fingerprint, token, extract(epoch FROM expires_at - now())::float8, response`

// The DDL of a store's table; docs/pgstore.md shows the same SQL for
// DefaultTable.
const (
	createTable = `CREATE TABLE IF NOT EXISTS {table} (
    scope       bytea       NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    token       text        NOT NULL,
    expires_at  timestamptz NOT NULL,
    response    bytea,
    sweep_at    timestamptz NOT NULL DEFAULT 'infinity',
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 80)`
	createIndex = `CREATE INDEX IF NOT EXISTS {index} ON {table} (sweep_at)`
)

// The statements that bring a table of the earlier schema (no sweep_at,
// an index on expires_at) to this one; Migrate runs them, with createIndex
// before the last, when the table lacks sweep_at. docs/pgstore.md shows
// them too.
const (
	upgradeColumn     = `ALTER TABLE {table} ADD COLUMN IF NOT EXISTS sweep_at timestamptz NOT NULL DEFAULT 'infinity'`
	upgradeRows       = `UPDATE {table} SET sweep_at = expires_at WHERE sweep_at = 'infinity'`
	upgradeFillfactor = `ALTER TABLE {table} SET (fillfactor = 80)`
	upgradeDropIndex  = `DROP INDEX IF EXISTS {old_index}`
)

// earlierColumns are the columns of a store's table before sweep_at, as
// PostgreSQL array text, for Migrate to tell a table of the earlier schema
// from another that has the store's name.
const earlierColumns = "{scope,key,fingerprint,token,expires_at,response}"

// migrateLockTimeout is how long Migrate's DDL waits for the table's lock
// before it fails.
const migrateLockTimeout = "10s"

// Migrate creates the store's table and its index unless they exist, and
// brings a table of the earlier schema (without sweep_at) to this one. It
// is safe to run at every start, from several instances at once: an
// advisory lock makes them take turns. A table of the store's name that
// lacks one of the store's columns is someone else's: Migrate changes
// nothing and returns an error that says so. So it does for a table whose
// expires_at or sweep_at is a timestamp without a time zone, which each
// session would read in its own TimeZone. Teams that run their own migrations can apply
// the same SQL, shown in docs/pgstore.md, instead. Migrate also finds the
// schema of a table named without one, which the store's statements name
// from then on (see [WithTable]).
func (s *Store) Migrate(ctx context.Context) error {
	// Read committed, whatever the database's default: each statement
	// sees what committed before it began, so that the catalog read after
	// the lock sees the table that the instance it waited for made. A
	// snapshot taken with the lock's statement, before the wait, would see
	// the table's name (to_regclass reads the latest catalog) without its
	// columns, and take it for someone else's.
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(migrateLock)); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	// A table of the earlier schema has the columns of earlierColumns and
	// no sweep_at; a current one has sweep_at and its index. A table that
	// lacks one of earlierColumns is not the store's, and is left alone.
	var exists, hasSweepAt, hasIndex bool
	var missing, schema, zoneless sql.NullString
	if err := tx.QueryRowContext(ctx, `SELECT
	to_regclass($1) IS NOT NULL,
	(SELECT nspname FROM pg_class JOIN pg_namespace ON pg_namespace.oid = relnamespace WHERE pg_class.oid = to_regclass($1)),
	(SELECT string_agg(name, ', ') FROM unnest($3::text[]) AS name
		WHERE NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = name AND NOT attisdropped)),
	EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'sweep_at' AND NOT attisdropped),
	EXISTS (SELECT FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass($1) AND c.relname = $2),
	(SELECT string_agg(attname || ' is ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum) FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname IN ('expires_at', 'sweep_at') AND NOT attisdropped
		AND atttypid <> 'timestamptz'::regtype)`,
		s.table.quoted(), s.table.name+"_sweep_at", earlierColumns).Scan(&exists, &schema, &missing, &hasSweepAt, &hasIndex, &zoneless); err != nil {
		return fmt.Errorf("pgstore: migrate %s: %w", s.table.quoted(), err)
	}
	if exists && missing.Valid {
		return fmt.Errorf("pgstore: migrate: %s exists and is not a store's table: it has no column %s; name another with WithTable",
			s.table.quoted(), missing.String)
	}
	if zoneless.Valid {
		// A timestamp without a time zone holds the wall-clock time of the
		// session that wrote it, read back in the reader's TimeZone: an
		// instance whose sessions have another would find live leases
		// ended (and take them over) and records expired (and sweep them).
		return fmt.Errorf("pgstore: migrate: in %s, %s, not timestamp with time zone: each session would read the times in its own TimeZone; "+
			"alter the column to timestamptz, naming the zone its times were written in", s.table.quoted(), zoneless.String)
	}
	earlier, current := exists && !hasSweepAt, hasSweepAt && hasIndex
	if current {
		// Even CREATE … IF NOT EXISTS locks the table first, and would
		// queue behind every transactional-mode claim in flight, and every
		// claim after it behind it: an instance that starts must not
		// stall the others.
		return s.migrated(ctx, tx)
	}
	// DDL that must wait for the table gives up rather than hold every
	// claim up behind it.
	if _, err := tx.ExecContext(ctx, `SET LOCAL lock_timeout = '`+migrateLockTimeout+`'`); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	// The statements name the schema of the table found: without one,
	// CREATE TABLE IF NOT EXISTS looks in the first schema of the
	// search_path only, and a table found in a later one would get, in
	// the first, an empty twin that hides it, and every record in it, from
	// every statement after.
	q := s.named
	if exists && s.table.schema == "" {
		q = newStatements(tableName{schema: schema.String, name: s.table.name})
	}
	stmts := q.ddl
	if earlier {
		stmts = q.upgrade
	}
	for _, q := range stmts {
		if _, err := tx.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("pgstore: migrate %s: %w", s.table.quoted(), err)
		}
	}
	return s.migrated(ctx, tx)
}

// migrated finds the schema of the table that Migrate's transaction tx
// made or found (see resolve), and commits tx.
func (s *Store) migrated(ctx context.Context, tx *sql.Tx) error {
	if _, err := s.resolve(ctx, tx); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	return nil
}

// statements returns the statements over the store's table named with the
// schema it is in, which it finds in the search_path first if it is not
// known yet (see resolve). In transactional mode its wait for a pool
// connection is bounded as a claim's are (see WithPoolWait).
func (s *Store) statements(ctx context.Context) (*statements, error) {
	if q := s.q.Load(); q != nil {
		return q, nil
	}
	if !s.transactional {
		return s.resolve(ctx, s.db)
	}
	var q *statements
	err := s.onConn(ctx, func(conn *sql.Conn) error {
		defer conn.Close()
		var err error
		q, err = s.resolve(ctx, conn)
		return err
	})
	return q, err
}

// stmt returns the statements that statements returned, which every
// method of the store asks for before any other statement of its table:
// a claim before the complete, release or extension of its key.
func (s *Store) stmt() *statements {
	if q := s.q.Load(); q != nil {
		return q
	}
	return &s.named
}

// resolve finds, on q, the schema of the store's table, a name without a
// schema looked up in the search_path, and keeps the statements that name
// it. They are the statements of the store from then on: the search_path
// of the claim's transaction is the handler's to set, and a statement that
// looked the name up there could find another table of that name (a
// tenant's, in an app with a schema per tenant) where no claim is, fail
// to store a response, or, on a connection whose search_path a handler
// set for its session, keep claims where no other connection sees them.
func (s *Store) resolve(ctx context.Context, q querier) (*statements, error) {
	var schema sql.NullString
	err := q.QueryRowContext(ctx, `SELECT nspname FROM pg_catalog.pg_class JOIN pg_catalog.pg_namespace ON pg_namespace.oid = relnamespace
WHERE pg_class.oid = to_regclass($1)`, s.table.quoted()).Scan(&schema)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, fmt.Errorf("pgstore: no table %s in the search_path: create it with Migrate or the SQL of docs/pgstore.md", s.table.quoted())
	case err != nil:
		return nil, fmt.Errorf("pgstore: find the schema of %s: %w", s.table.quoted(), err)
	}
	st := newStatements(tableName{schema: schema.String, name: s.table.name})
	s.q.Store(&st)
	return &st, nil
}
