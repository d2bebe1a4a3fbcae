package idemserver

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// TestRequestAllocs bounds the allocations of the middleware for a request
// with a new key and for a replay, with a MemoryStore in its steady state
// (full, evicting the oldest record for each new one, so that none of its
// arrays grows), counting nothing that the request or the handler
// allocate. The request's context can be cancelled, as a net/http
// server's is, so that a handler context that followed it at once would
// allocate.
//
// A new key costs six: the run's one allocation, the lease token, the
// lease keeper's timer and the function it calls, and the store's record,
// once claimed and once completed. A replay costs two, for the header
// field values it sets.
func TestRequestAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const runs, filled = 100, 1000
	keys := make([][]string, filled+runs+1) // AllocsPerRun runs once more first
	for i := range keys {
		keys[i] = []string{"key-" + strconv.Itoa(i)}
	}
	evictions := 0
	store := NewMemoryStore(WithMaxEntries(100), WithShards(4), WithEvictOldest(),
		WithEvictionReport(func(Eviction) { evictions++ }))
	h := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	}))
	w := &discardWriter{h: http.Header{}}
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/charges", nil)
	body := strings.NewReader(benchBody)
	rc := io.NopCloser(body)
	r.ContentLength = int64(len(benchBody))
	serveKey := func(key []string) {
		body.Reset(benchBody)
		r.Body = rc
		r.Header[DefaultKeyHeader] = key
		clear(w.h)
		h.ServeHTTP(w, r)
	}

	for _, key := range keys[:filled] {
		serveKey(key)
	}
	n := filled
	newKey := testing.AllocsPerRun(runs, func() {
		serveKey(keys[n])
		n++
	})
	assert.LessOrEqual(t, newKey, 6.0, "a new key")
	assert.Equal(t, n-100, evictions, "each new key past the store's bound evicts one")
	replay := testing.AllocsPerRun(runs, func() { serveKey(keys[n-1]) })
	assert.LessOrEqual(t, replay, 2.0, "a replay")
}

// TestClaimedRequestSize keeps a claimed request's one allocation in the
// 768-byte size class: over 512 bytes, an object that holds pointers
// carries an 8-byte header, and 769 to 896 bytes cost 128 more per request.
func TestClaimedRequestSize(t *testing.T) {
	if unsafe.Sizeof(uintptr(0)) != 8 {
		t.Skip("sizes are for 64-bit platforms")
	}
	assert.LessOrEqual(t, unsafe.Sizeof(claimedRequest{}), uintptr(760))
}
