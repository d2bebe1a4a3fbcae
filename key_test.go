package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// requireUUIDv7s checks that keys are distinct UUIDv7s stamped between
// before and after (Unix milliseconds).
func requireUUIDv7s(t *testing.T, keys []string, before, after int64) {
	t.Helper()
	seen := make(map[string]bool, len(keys))
	for _, s := range keys {
		require.False(t, seen[s], "duplicate key %s", s)
		seen[s] = true
		id, err := uuid.Parse(s)
		require.NoError(t, err)
		require.Equal(t, id.String(), s, "not in canonical form")
		assert.Equal(t, uuid.Version(7), id.Version())
		assert.Equal(t, uuid.RFC4122, id.Variant())
		sec, nsec := id.Time().UnixTime()
		ms := sec*1000 + nsec/1e6
		assert.True(t, ms >= before && ms <= after, "timestamp %d outside [%d, %d]", ms, before, after)
	}
}

func TestKeySource(t *testing.T) {
	var s keySource
	before := time.Now().UnixMilli()
	// Many batches of random bytes, and a key at each offset of a batch.
	keys := make([]string, 0, 10000)
	for range cap(keys) {
		k, err := s.newKey(time.Now())
		require.NoError(t, err)
		keys = append(keys, k)
	}
	requireUUIDv7s(t, keys, before, time.Now().UnixMilli())
}

func TestKeySourceConcurrent(t *testing.T) {
	var s keySource
	before := time.Now().UnixMilli()
	const goroutines, each = 8, 1000
	keys := make([][]string, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for range each {
				k, err := s.newKey(time.Now())
				if err != nil {
					t.Error(err)
					return
				}
				keys[g] = append(keys[g], k)
			}
		})
	}
	wg.Wait()
	var all []string
	for _, k := range keys {
		all = append(all, k...)
	}
	require.Len(t, all, goroutines*each)
	requireUUIDv7s(t, all, before, time.Now().UnixMilli())
}

// Two Transports draw on sources of their own: neither's keys follow from
// the other's.
func TestTransportsHaveTheirOwnKeySource(t *testing.T) {
	a, b := NewTransport(nil), NewTransport(nil)
	before := time.Now().UnixMilli()
	var keys []string
	for range 200 {
		ka, err := a.keys.newKey(time.Now())
		require.NoError(t, err)
		kb, err := b.keys.newKey(time.Now())
		require.NoError(t, err)
		keys = append(keys, ka, kb)
	}
	requireUUIDv7s(t, keys, before, time.Now().UnixMilli())
}

func TestFormatUUIDv7(t *testing.T) {
	for _, fill := range []byte{0x00, 0xff, 0x5a} {
		var id [16]byte
		for i := range id {
			id[i] = fill
		}
		ms := int64(0x0123456789ab)
		got := formatUUIDv7(&id, ms)
		u, err := uuid.Parse(got)
		require.NoError(t, err)
		assert.Equal(t, uuid.UUID(id).String(), got, "same text as the uuid package")
		assert.Equal(t, uuid.Version(7), u.Version())
		assert.Equal(t, uuid.RFC4122, u.Variant())
		sec, nsec := u.Time().UnixTime()
		assert.Equal(t, ms, sec*1000+nsec/1e6)
	}
}

func TestKeySourceAllocatesOnlyTheString(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	var s keySource
	allocs := testing.AllocsPerRun(1000, func() { _, _ = s.newKey(time.Now()) })
	assert.Equal(t, 1.0, allocs)
}

// The keys a Transport sends by default are distinct UUIDv7s stamped with
// the time of their request, operations' keys included.
func TestTransportSendsUUIDv7Keys(t *testing.T) {
	srv := newServer(t, status(200))
	tr := NewTransport(newBaseTransport(t))
	before := time.Now().UnixMilli()
	for i := range 200 {
		ctx := context.Background()
		if i%2 == 1 {
			ctx = WithOperation(ctx, fmt.Sprintf("op-%d", i))
		}
		do(t, tr, post(t, ctx, srv.URL, "body"))
	}
	after := time.Now().UnixMilli()
	var keys []string
	for _, r := range srv.reqs {
		keys = append(keys, r.Key)
	}
	require.Len(t, keys, 200)
	requireUUIDv7s(t, keys, before, after)
}

// A header field's value loses the spaces around it, and a server reads a
// bare value in double quotes as a Structured Fields string, so a key
// generator's "order-7 " or "\"order-7\"" would reach the server as
// order-7: another operation's key, whose outcome the server would replay
// for this one without running it. Such a key stops the request instead;
// inside a Structured Fields string, which carries it whole, it is sent.
func TestKeyTheServerWouldReadAsAnother(t *testing.T) {
	tests := []struct {
		name       string
		second     string
		structured bool
		refused    bool
	}{
		{"trailing space", "order-7 ", false, true},
		{"leading space", " order-7", false, true},
		{"double quotes", `"order-7"`, false, true},
		{"trailing space, structured", "order-7 ", true, false},
		{"double quotes, structured", `"order-7"`, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var executions atomic.Int32
			srv := httptest.NewServer(idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)
			keys := []string{"order-7", tt.second}
			var made atomic.Int32
			opts := []Option{WithKeyGenerator(func() (string, error) { return keys[made.Add(1)-1], nil })}
			if tt.structured {
				opts = append(opts, WithStructuredKey())
			}
			client := &http.Client{Transport: NewTransport(newBaseTransport(t), opts...)}
			for i := range 2 {
				resp, err := client.Post(srv.URL, "text/plain", strings.NewReader("charge"))
				if i == 1 && tt.refused {
					require.ErrorIs(t, err, ErrKeyStore)
					break
				}
				require.NoError(t, err)
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				assert.Empty(t, resp.Header.Get(idemserver.ReplayedHeader), "operation %d was answered with another's outcome", i)
				require.NoError(t, resp.Body.Close())
			}
			want := int32(2)
			if tt.refused {
				want = 1
			}
			assert.Equal(t, want, executions.Load())
		})
	}
}
