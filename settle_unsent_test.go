package idemhttp

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A later call of the operation that ends with nothing sent (its context
// ended before the KeyStore gave it the key, the rate limiter or the
// breaker refused its first attempt) did not send the key again, and its
// caller needs it no more than before: it does not supersede the held
// outcome, whose Settle releases the key. Were it to, Settle would return
// nil and leave the key pending for a call that has no use for it.
func TestSettleAfterALaterCallThatSentNothingReleasesTheKey(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		io.WriteString(w, "paid")
	}))
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		opts []Option
	}{
		{"context ended", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(heldCtx())
			cancel()
			return ctx, cancel
		}, nil},
		{"rate limit refused", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(heldCtx(), time.Hour)
		}, []Option{WithRateLimit(1.0/7200, 1)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := NewMemoryKeyStore()
			opts := append([]Option{WithKeyStore(store), WithMaxAttempts(1)}, tc.opts...)
			tr := NewTransport(newBaseTransport(t), opts...)
			resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "charge"))
			require.NoError(t, err)
			require.Equal(t, "paid", readAll(t, resp))

			ctx, cancel := tc.ctx()
			defer cancel()
			_, err = tr.RoundTrip(post(t, ctx, srv.URL, "charge"))
			require.Error(t, err, "the later call sends nothing")

			require.NoError(t, Settle(context.Background(), resp))
			assert.Empty(t, pendingKeys(t, store))
		})
	}
}
