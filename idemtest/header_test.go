package idemtest

import (
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestReplayedHeaderFieldsChecked checks that a replay must carry the
// header fields the handler answered with, as the middleware keeps them: a
// store that loses or changes one (the Location of the payment made, say)
// tells the retry something else than the first answer. The fields the
// middleware does not keep on purpose (Set-Cookie, hop-by-hop fields) and
// those it adds (Content-Length, Idempotent-Replayed) change nothing.
func TestReplayedHeaderFieldsChecked(t *testing.T) {
	for _, tt := range []struct {
		name   string
		change func(*idemserver.Response)
		opts   []Option
		wrong  string // in the wrong replay; empty when there is none
	}{
		{name: "fields kept"},
		{name: "Set-Cookie replayed as allowed", opts: []Option{WithMiddleware(idemserver.WithReplayedHeaders("Set-Cookie"))}},
		{name: "field lost", change: func(r *idemserver.Response) { r.Header = r.Header.Clone(); r.Header.Del("Location") },
			wrong: "k (replayed 201 with a 7-byte body"},
		{name: "field changed", change: func(r *idemserver.Response) {
			r.Header = r.Header.Clone()
			r.Header.Set("Location", "/charges/2")
		}, wrong: "k (replayed 201 with a 7-byte body"},
		{name: "all fields lost", change: func(r *idemserver.Response) { r.Header = nil },
			wrong: "k (replayed 201 with a 7-byte body"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var wrap func(idemserver.Store) idemserver.Store
			if tt.change != nil {
				wrap = func(s idemserver.Store) idemserver.Store { return tamperingStore{s, tt.change} }
			}
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Location", "/charges/1")
				w.Header().Set("Content-Type", "text/plain")
				w.Header().Set("Set-Cookie", "session=1")
				w.Header().Set("Keep-Alive", "timeout=5")
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "created")
			})
			srv := NewServer(h, append(tt.opts, WithStore(memoryStore(t, wrap)))...)
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			require.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "k"))
			require.Equal(t, outcome{status: http.StatusCreated, replayed: true}, post(t.Context(), client, srv.URL, "k"))

			rec := &recordingTB{TB: t}
			ok := srv.AssertExactlyOnce(rec, 1)
			if tt.wrong == "" {
				assert.True(t, ok, "%v", rec.errors)
				return
			}
			assert.False(t, ok)
			wrong := srv.WrongReplays()
			require.Len(t, wrong, 1)
			assert.Contains(t, wrong[0], tt.wrong)
		})
	}
}
