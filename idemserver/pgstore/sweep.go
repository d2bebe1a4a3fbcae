package pgstore

import (
	"context"
	"database/sql"
	"fmt"
)

// Sweep deletes up to limit expired records, and returns how many it
// deleted. A record has expired when its retention ended (a completed
// record) or its lease did (an in-progress record whose handler died,
// which the next request with its key would take over anyway); a live
// lease is never touched.
//
// One call is one statement on the index of sweep_at, the time from which a
// row may be swept, so its cost is bounded by limit. It runs in a
// transaction at read committed, whatever the database's default, so that
// sweeps running at once skip or re-check each other's rows rather than
// fail with serialization failures. A row's sweep_at is
// never before it expires, and may be later: a claim guesses its record's
// retention (the last one Complete was given) so that its complete need not
// change an indexed column, and a record kept for less, or a claim whose
// handler died, stays until that guess runs out, or until a claim of its
// key replaces it. An expired row is never replayed, only kept. Rows another transaction holds, such as another instance's sweep
// or a claim replacing an expired row, are skipped rather than waited for,
// so several instances may sweep at once. To clear a backlog, call Sweep
// again while it returns limit:
//
//	for {
//		n, err := store.Sweep(ctx, 1000)
//		if err != nil || n < 1000 {
//			break
//		}
//	}
//
// A limit below 1 is an error.
func (s *Store) Sweep(ctx context.Context, limit int) (int, error) {
	if limit < 1 {
		return 0, fmt.Errorf("pgstore: sweep limit %d; want at least 1", limit)
	}
	// Read committed, whatever the database's default: there a row that
	// another sweep or a claim changed after the statement's snapshot is
	// re-checked, or skipped while it is locked. Under repeatable read or
	// serializable the statement would fail instead, and sweeps running
	// at once would keep failing each other.
	q, err := s.statements(ctx)
	if err != nil {
		return 0, fmt.Errorf("pgstore: sweep: %w", err)
	}
	var n int64
	err = inReadCommitted(ctx, s.db, func(tx *sql.Tx) error {
		var err error
		n, err = execRows(ctx, tx, q.sweep, limit)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("pgstore: sweep: %w", err)
	}
	return int(n), nil
}
