package idemtest

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// payOnce makes operation op through client, as an application does that
// needs the body of the answer: until it has read a whole 201, it calls
// again, with the operation's id (so an idemhttp Transport with a key
// store sends its pending key) and, when newKey is set, a key of its own
// for each call. It returns how many calls it made.
func payOnce(t *testing.T, client *http.Client, url, op string, newKey bool) int {
	t.Helper()
	for call := 1; call <= 20; call++ {
		req, err := http.NewRequestWithContext(idemhttp.WithOperation(t.Context(), op),
			http.MethodPost, url+"/charges", strings.NewReader(`{"op":"`+op+`"}`))
		require.NoError(t, err)
		if newKey {
			req.Header.Set(idemserver.DefaultKeyHeader, fmt.Sprintf("%s-call-%d", op, call))
		}
		resp, err := client.Do(req)
		if err != nil {
			continue
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil && resp.StatusCode == http.StatusCreated {
			return call
		}
	}
	t.Fatalf("%s: no whole 201 in 20 calls", op)
	return 0
}

// TestCutBodyCaught checks that the cut body reaches the dangerous path: a
// 201 whose body is cut comes from a handler that acted, so an application
// that calls again with a new key for it pays twice, which the assertion
// must show, while one that calls again with its operation's pending key
// (idemhttp.WithOperation) gets the first answer replayed.
func TestCutBodyCaught(t *testing.T) {
	const operations = 12
	for _, tt := range []struct {
		name   string
		newKey bool
	}{
		{"pending key", false},
		{"new key per call", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := NewServer(created, WithSeed(3), WithFaults(Faults{CutBody: .4}))
			defer srv.Close()
			client := srv.Client(idemhttp.WithBudget(nil), idemhttp.WithoutBreaker(),
				idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)))
			defer client.CloseIdleConnections()
			calls := 0
			for i := range operations {
				calls += payOnce(t, client, srv.URL, fmt.Sprint("op-", i), tt.newKey)
			}
			st := srv.Stats()
			require.Positive(t, st.CutBodies)
			require.Greater(t, calls, operations, "some operation was called again")
			rec := &recordingTB{TB: t}
			ok := srv.AssertExactlyOnce(rec, operations)
			if !tt.newKey {
				assert.True(t, ok, "%v", rec.errors)
				assert.Positive(t, st.Replayed, "the calls again were replayed")
				return
			}
			assert.False(t, ok)
			require.Len(t, rec.errors, 1)
			assert.Contains(t, rec.errors[0], "keys executed, want one for each of 12 operations")
		})
	}
}
