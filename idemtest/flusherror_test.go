package idemtest

import (
	"crypto/sha256"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
)

// failingFlusher is a ResponseWriter whose flushes fail, as net/http's do
// once the client has gone.
type failingFlusher struct {
	*httptest.ResponseRecorder
	err error
}

func (f *failingFlusher) FlushError() error { return f.err }

// TestFlushErrorReachesHandler checks that the kit's writers pass a failed
// flush back to the handler: a streaming handler that stops when its client
// has gone must behave under the kit as it does in production.
func TestFlushErrorReachesHandler(t *testing.T) {
	gone := errors.New("client gone")
	writers := map[string]func(http.ResponseWriter) http.ResponseWriter{
		"ledger": func(w http.ResponseWriter) http.ResponseWriter {
			return &statusWriter{ResponseWriter: w, body: sha256.New()}
		},
		"injector": func(w http.ResponseWriter) http.ResponseWriter {
			return &replayWriter{ResponseWriter: w}
		},
	}
	for name, wrap := range writers {
		t.Run(name, func(t *testing.T) {
			under := &failingFlusher{ResponseRecorder: httptest.NewRecorder(), err: gone}
			w := wrap(under)
			err := http.NewResponseController(w).Flush()
			require.ErrorIs(t, err, gone)

			under.err = nil
			require.NoError(t, http.NewResponseController(w).Flush())
		})
	}
}
