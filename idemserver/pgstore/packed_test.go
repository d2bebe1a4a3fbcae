package pgstore

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

var _ idemserver.PackedStore = (*Store)(nil)

// modes are the store's two modes, as options of New.
var modes = []struct {
	name string
	opts []Option
}{
	{"lease", nil},
	{"transactional", []Option{WithTransactional()}},
}

// serveOnce sends a POST /pay with key and body "b" to h.
func serveOnce(h http.Handler, key string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", key)
	h.ServeHTTP(w, r)
	return w
}

func TestResponsesKeptPacked(t *testing.T) {
	// Through the middleware the store keeps the packed form the middleware
	// records (format version 2) and replays it as it was sent; Claim reads
	// the same row back as a Response.
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			runs := 0
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				w.Header().Set("Content-Type", "application/json")
				w.Header()["Link"] = []string{"</a>", "</b>"}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"id":1}`))
			}))
			first := serveOnce(h, "k")
			require.Equal(t, http.StatusCreated, first.Code)

			var stored []byte
			require.NoError(t, db.QueryRowContext(t.Context(),
				"SELECT response FROM "+s.table.quoted()+" WHERE key = 'k'").Scan(&stored))
			require.NotEmpty(t, stored)
			assert.Equal(t, byte(respcodec.PackedVersion), stored[0])

			replay := serveOnce(h, "k")
			assert.Equal(t, 1, runs)
			assert.Equal(t, first.Code, replay.Code)
			assert.Equal(t, first.Body.String(), replay.Body.String())
			assert.Equal(t, []string{"</a>", "</b>"}, replay.Header()["Link"])
			assert.Equal(t, "application/json", replay.Header().Get("Content-Type"))
			assert.Equal(t, "true", replay.Header().Get(idemserver.ReplayedHeader))

			c := testClaim("k", time.Hour)
			c.Fingerprint = idemserver.Fingerprint(fingerprintOf("b"))
			res, err := s.Claim(t.Context(), c)
			require.NoError(t, err)
			require.True(t, res.Record.Completed())
			assert.Equal(t, http.StatusCreated, res.Record.Response.Status)
			assert.Equal(t, `{"id":1}`, string(res.Record.Response.Body))
			assert.Equal(t, []string{"</a>", "</b>"}, res.Record.Response.Header["Link"])
		})
	}
}

func TestFirstFormatStillReplays(t *testing.T) {
	// A response stored in format version 1, which the store wrote before
	// it kept the packed form, is still read, by Claim and through the
	// middleware.
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			v1 := respcodec.Encode(&idemserver.Response{Status: http.StatusCreated,
				Header: http.Header{"Location": {"/pay/7"}}, Body: []byte("seven")})
			require.Equal(t, byte(1), v1[0])
			_, err := db.ExecContext(t.Context(), "INSERT INTO "+s.table.quoted()+
				" VALUES ('', 'k', $1, 't', now() + interval '1 hour', $2)", fingerprintOf("b"), v1)
			require.NoError(t, err)

			runs := 0
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++ }))
			w := serveOnce(h, "k")
			assert.Zero(t, runs)
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.Equal(t, "seven", w.Body.String())
			assert.Equal(t, "/pay/7", w.Header().Get("Location"))

			c := testClaim("k", time.Hour)
			c.Fingerprint = idemserver.Fingerprint(fingerprintOf("b"))
			res, err := s.Claim(t.Context(), c)
			require.NoError(t, err)
			require.True(t, res.Record.Completed())
			assert.Equal(t, "seven", string(res.Record.Response.Body))
		})
	}
}
