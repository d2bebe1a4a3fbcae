package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// cutOnce is a server that stands in for the middleware behind a proxy that
// cuts bodies: it answers the first request with a key with a 201 whose
// body is cut in the middle, and every later one with that key with the
// replay of the receipt; a request with a key it has not seen is answered
// as a first one, not cut, and counted as a run of the handler.
type cutOnce struct {
	mu   sync.Mutex
	seen map[string]bool
	runs int
}

func (c *cutOnce) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemserver.DefaultKeyHeader)
	c.mu.Lock()
	seen := c.seen[key]
	first := len(c.seen) == 0
	if !seen {
		c.seen[key] = true
		c.runs++
	}
	c.mu.Unlock()
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", receiptType)
	if seen {
		w.Header().Set(idemserver.ReplayedHeader, "true")
	}
	if !first || seen {
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, receiptOf("op-1"))
		return
	}
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	defer conn.Close()
	half := receiptOf("op-1")[:len(receiptOf("op-1"))/2]
	fmt.Fprintf(buf, "HTTP/1.1 201 Created\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n",
		receiptType, len(half), half)
	_ = buf.Flush()
}

// TestWorkerCallsAgainAfterCutBody checks what the worker does with a 201
// whose body is cut: it notes the cut and the key, calls the operation
// again at once and records the answer. With the key still pending (the
// Transport releases it only once the body was read to its end) the call
// is answered by a replay under the same key; a client that released the
// key on the header sends a new one, runs the handler again, and the
// report names the operation.
func TestWorkerCallsAgainAfterCutBody(t *testing.T) {
	for _, tt := range []struct {
		name         string
		releaseEarly bool
	}{
		{"key kept until the body is read", false},
		{"key released on the header", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &cutOnce{seen: make(map[string]bool)}
			srv := httptest.NewServer(h)
			defer srv.Close()
			keys := idemhttp.NewMemoryKeyStore()
			path := filepath.Join(t.TempDir(), "log")
			log, err := openLineLog(path)
			require.NoError(t, err)
			defer log.Close()
			w := &worker{log: log, url: srv.URL, client: idemhttp.NewClient(idemhttp.WithKeyStore(keys),
				idemhttp.WithBudget(nil), idemhttp.WithoutBreaker())}
			defer w.client.CloseIdleConnections()
			if tt.releaseEarly {
				w.releaseEarly = keys.Release
			}
			require.NoError(t, w.complete(t.Context(), "op-1"))

			lines, err := readLines(path)
			require.NoError(t, err)
			require.Len(t, lines, 3)
			assert.Equal(t, []string{"done", "op-1", "201", "false"}, lines[0][:4])
			first := lines[0][4]
			assert.Equal(t, []string{"cut", "op-1", first}, lines[1])
			assert.Equal(t, "done", lines[2][0])
			pending, err := keys.Pending(context.Background())
			require.NoError(t, err)
			assert.Empty(t, pending, "the whole answer released the key")

			r := &report{scenario: &scenario{ops: 1, spec: storeSpec{name: "memory"}}}
			require.NoError(t, r.read(files{ledger: filepath.Join(t.TempDir(), "none"), clientLog: path}, nil))
			assert.Equal(t, 1, r.cuts)
			if !tt.releaseEarly {
				assert.Equal(t, []string{"done", "op-1", "201", "true", first}, lines[2])
				assert.Equal(t, 1, h.runs)
				assert.Equal(t, 1, r.cutReplays)
				assert.Empty(t, r.newKeyAfterCut)
				return
			}
			assert.NotEqual(t, first, lines[2][4], "a new key")
			assert.Equal(t, 2, h.runs, "the handler ran again")
			assert.Equal(t, 0, r.cutReplays)
			assert.Equal(t, []string{"op-1"}, r.newKeyAfterCut)
			assert.True(t, r.failed())
			var out strings.Builder
			r.print(&out)
			assert.Contains(t, out.String(), "new keys after cut bodies: 1\n")
			assert.Contains(t, out.String(), "operations called again with a new key after a cut body "+
				"(the key was released before the body was read): op-1\n")
		})
	}
}

// TestReportCutNeverAnswered checks the verdict on a cut body after which
// the operation was never answered again: the worker was killed between
// the cut and the call again, and its successor did not drive the
// operation, so its key was no longer pending (it had been released on
// the header). No run of the handler shows it; only the missing answer
// does.
func TestReportCutNeverAnswered(t *testing.T) {
	dir := t.TempDir()
	f := files{ledger: filepath.Join(dir, "ledger"), clientLog: filepath.Join(dir, "log")}
	require.NoError(t, os.WriteFile(f.ledger, []byte("charged op-1 d1 0\ncharged op-2 d2 0\n"), 0o644))
	require.NoError(t, os.WriteFile(f.clientLog, []byte(
		"done op-1 201 false k1\ncut op-1 k1\n"+ // killed here; k1 was released
			"done op-2 201 false k2\ncut op-2 k2\ndone op-2 201 true k2\n"), 0o644))
	r := &report{scenario: &scenario{ops: 2, spec: storeSpec{name: "postgres"}}}
	require.NoError(t, r.read(f, nil))
	assert.Equal(t, 2, r.cuts)
	assert.Equal(t, []string{"op-1"}, r.cutUnanswered)
	assert.True(t, r.failed())
	var out strings.Builder
	r.print(&out)
	assert.Contains(t, out.String(), "\ncut bodies never answered again: 1\n")
	assert.NotContains(t, out.String(), "PASS")
}
