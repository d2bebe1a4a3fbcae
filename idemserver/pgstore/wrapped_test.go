package pgstore

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// meteredStore wraps a store as metrics and tracing wrappers do: it
// forwards the methods of idemserver.Store, and their results whole, and
// defines no other, so the store's optional interfaces
// (idemserver.ResponseHolder among them) are hidden behind it.
type meteredStore struct {
	s     idemserver.Store
	calls atomic.Int64
}

func (m *meteredStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	m.calls.Add(1)
	return m.s.Claim(ctx, c)
}

func (m *meteredStore) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	m.calls.Add(1)
	return m.s.TakeOver(ctx, c, expiredToken)
}

func (m *meteredStore) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	m.calls.Add(1)
	return m.s.Complete(ctx, key, token, resp, expires)
}

func (m *meteredStore) Release(ctx context.Context, key idemserver.Key, token string) error {
	m.calls.Add(1)
	return m.s.Release(ctx, key, token)
}

func (m *meteredStore) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	m.calls.Add(1)
	return m.s.Extend(ctx, key, token, leaseExpires)
}

func TestTransactionalHoldsResponsesBehindAWrapper(t *testing.T) {
	// A store wrapped by one that forwards only the Store methods still
	// has every response held until its commit: a response that reached
	// the client before a COMMIT that then failed would tell the client
	// of a payment that was rolled back.
	for _, tt := range []struct {
		name  string
		write func(w http.ResponseWriter) // after the payment was recorded
		state string                      // with which the first COMMIT fails
		// status is the client's; payments, how many were kept.
		status   int
		payments int
	}{
		{"flush, then the commit is refused", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("paid"))
			http.NewResponseController(w).Flush() //nolint:errcheck // a flush the recorder refuses is no failure
		}, "23505", http.StatusServiceUnavailable, 0},
		{"larger than the limit, then the commit is refused", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("x", 64)))
		}, "23505", http.StatusServiceUnavailable, 0},
		{"serialization failure at the commit is rerun", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("paid"))
		}, "40001", http.StatusCreated, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := &meteredStore{s: db.newStore(t, WithTransactional())}
			failFirst(t, db, "AFTER INSERT ON payments DEFERRABLE INITIALLY DEFERRED", tt.state, 1)
			h := idemserver.Middleware(s, idemserver.WithMaxResponseBytes(16))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, err := Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
				if err != nil {
					Rerun(r.Context(), err)
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				tt.write(w)
			}))
			status, body, _ := post(h, "k")
			assert.Equal(t, tt.status, status, "the client's status; body %q", body)
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			assert.NotZero(t, s.calls.Load())
			assert.Zero(t, db.Stats().InUse, "no transaction left open")
		})
	}
}
