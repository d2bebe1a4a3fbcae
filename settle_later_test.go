package idemhttp

import (
	"context"
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// While the caller of an operation made with HoldKey saves the outcome it
// read, its key stays pending and the operation is no longer in flight, so
// another call of it may send the key, as HoldKey means it to (it gets the
// server's replay). When that call's outcome does not reach its caller
// (the body cut), the key must stay pending for that caller's next call
// even once the first caller settles: released, the next call would go out
// under a new key, and the server would charge a second time.
func TestSettleKeepsAKeyALaterCallLeftPending(t *testing.T) {
	for _, hold := range []bool{true, false} {
		name := "the later call without HoldKey"
		if hold {
			name = "the later call with HoldKey"
		}
		t.Run(name, func(t *testing.T) {
			srv := newChargeServer(t)
			real := newBaseTransport(t)
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				resp, err := real.RoundTrip(r)
				if err == nil && r.Header.Get(faultHeader) != "" {
					resp.Body = lostBody{resp.Body}
				}
				return resp, err
			})
			store := NewMemoryKeyStore()
			tr := NewTransport(base, WithKeyStore(store))
			later := func() context.Context {
				if hold {
					return heldCtx()
				}
				return WithOperation(context.Background(), "order-1")
			}

			first := do(t, tr, post(t, heldCtx(), srv.URL, "x")) // read; now saving

			req := post(t, later(), srv.URL, "x")
			req.Header.Set(faultHeader, "cut")
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			_, err = io.ReadAll(resp.Body)
			require.Error(t, err, "the later call's body was cut")
			resp.Body.Close()

			require.NoError(t, Settle(context.Background(), first), "the first caller saved its outcome")

			// The later call's caller calls again, and gets the replay.
			again := do(t, tr, post(t, later(), srv.URL, "x"))
			if hold {
				require.NoError(t, Settle(context.Background(), again))
			}
			keys := srv.keys.all()
			assert.Equal(t, []string{keys[0], keys[0], keys[0]}, keys, "every call sent the key")
			assert.Equal(t, int32(1), srv.executions.Load(), "charged once")
			assert.Empty(t, pendingKeys(t, store))
		})
	}
}
