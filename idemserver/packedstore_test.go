package idemserver

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// mapStore is a PackedStore that is not the MemoryStore: it keeps each
// response as the bytes PackedResponse.AppendBinary gives, as a store over
// a network would, and counts the calls of each method.
type mapStore struct {
	mu      sync.Mutex
	records map[Key]*mapRecord
	calls   map[string]int
}

type mapRecord struct {
	rec  Record
	data []byte // the packed response, once completed
}

func newMapStore() *mapStore {
	return &mapStore{records: make(map[Key]*mapRecord), calls: make(map[string]int)}
}

func (s *mapStore) called(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[name]
}

func (s *mapStore) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	res, err := s.claim("Claim", PackedClaim{Claim: c})
	return res.ClaimResult, err
}

func (s *mapStore) TakeOver(ctx context.Context, c Claim, expiredToken string) (ClaimResult, error) {
	res, err := s.claim("TakeOver", PackedClaim{Claim: c, TakeOver: true, ExpiredToken: expiredToken})
	return res.ClaimResult, err
}

func (s *mapStore) ClaimPacked(ctx context.Context, c PackedClaim) (PackedClaimResult, error) {
	return s.claim("ClaimPacked", c)
}

func (s *mapStore) claim(name string, c PackedClaim) (PackedClaimResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls[name]++
	r := s.records[c.Key]
	if r != nil && (r.data == nil || c.Now.Before(r.rec.Expires)) &&
		!(c.TakeOver && r.data == nil && r.rec.Token == c.ExpiredToken && !c.Now.Before(r.rec.LeaseExpires)) {
		res := PackedClaimResult{ClaimResult: ClaimResult{Record: r.rec}}
		if r.data != nil {
			p, err := ParsePackedResponse(string(r.data))
			if err != nil {
				return PackedClaimResult{}, err
			}
			if name == "ClaimPacked" {
				res.Response = p
			} else {
				res.Record.Response = p.Response()
			}
		}
		return res, nil
	}
	if c.NewToken != nil {
		c.Token = c.NewToken()
	}
	s.records[c.Key] = &mapRecord{rec: Record{Fingerprint: c.Fingerprint, Token: c.Token, LeaseExpires: c.LeaseExpires}}
	return PackedClaimResult{ClaimResult: ClaimResult{Claimed: true}, Token: c.Token}, nil
}

func (s *mapStore) Complete(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error {
	return s.complete("Complete", PackedCompletion{Key: key, Token: token, Response: PackResponse(resp), Expires: expires})
}

func (s *mapStore) CompletePacked(ctx context.Context, c PackedCompletion) error {
	return s.complete("CompletePacked", c)
}

func (s *mapStore) complete(name string, c PackedCompletion) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls[name]++
	r := s.records[c.Key]
	if r == nil || r.data != nil || r.rec.Token != c.Token {
		return ErrLeaseLost
	}
	data, err := c.Response.AppendBinary(nil)
	if err != nil {
		return err
	}
	r.data, r.rec.Expires, r.rec.Token = data, c.Expires, ""
	return nil
}

func (s *mapStore) Release(ctx context.Context, key Key, token string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.records[key]; r == nil || r.data != nil || r.rec.Token != token {
		return ErrLeaseLost
	}
	delete(s.records, key)
	return nil
}

func (s *mapStore) Extend(ctx context.Context, key Key, token string, leaseExpires time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[key]
	if r == nil || r.data != nil || r.rec.Token != token {
		return ErrLeaseLost
	}
	r.rec.LeaseExpires = leaseExpires
	return nil
}

// The middleware takes the packed path of any store that offers it, and
// the plain one of any store that does not; both replay the same bytes.
func TestMiddlewareUsesPackedStoreOfAnyStore(t *testing.T) {
	var _ PackedStore = (*MemoryStore)(nil)
	_, ok := Store(newStubStore()).(PackedStore)
	require.False(t, ok, "stubStore must not pick up the MemoryStore's packed path")

	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header()["X-Multi"] = []string{"a", "b", ""}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})
	serveTwice := func(store Store) (first, replay *httptest.ResponseRecorder) {
		mw := Middleware(store)(h)
		first = serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		replay = serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		require.Equal(t, "true", replay.Header().Get(ReplayedHeader))
		return first, replay
	}

	packed := newMapStore()
	first, replay := serveTwice(packed)
	assert.Equal(t, 2, packed.called("ClaimPacked"))
	assert.Equal(t, 1, packed.called("CompletePacked"))
	assert.Zero(t, packed.called("Claim")+packed.called("TakeOver")+packed.called("Complete"), "plain methods")

	// The same store without its packed methods: the plain path.
	plain := newMapStore()
	plainFirst, plainReplay := serveTwice(struct{ Store }{plain})
	assert.Equal(t, 2, plain.called("Claim"))
	assert.Equal(t, 1, plain.called("Complete"))
	assert.Zero(t, plain.called("ClaimPacked")+plain.called("CompletePacked"), "packed methods")

	for _, w := range []*httptest.ResponseRecorder{replay, plainFirst, plainReplay} {
		assert.Equal(t, first.Code, w.Code)
		assert.Equal(t, first.Body.String(), w.Body.String())
	}
	assert.Equal(t, replay.Header(), plainReplay.Header())
}

func TestPackedResponseRoundTrip(t *testing.T) {
	for _, resp := range []*Response{
		{Status: 204},
		{Status: 201, Body: []byte(`{"id":1}`)},
		{Status: 200, Header: http.Header{"Vary": {"Accept", "Origin"}, "X-Empty": {""}}, Body: []byte("ok")},
		{Status: 201, Header: http.Header{"Location": {"/a"}}, BodyOmitted: true},
	} {
		p := PackResponse(resp)
		data, err := p.AppendBinary([]byte("prefix"))
		require.NoError(t, err)
		require.Equal(t, "prefix", string(data[:6]))
		assert.Equal(t, p.Len(), len(data)-6)
		back, err := ParsePackedResponse(string(data[6:]))
		require.NoError(t, err)
		assert.Equal(t, resp, back.Response())

		// Parts, as the recorder hands them over, pack to the same response.
		fromParts, err := packedOf(partsOf(resp)).AppendBinary(nil)
		require.NoError(t, err)
		assert.Equal(t, packedOf(partsOf(resp)).Len(), len(fromParts))
		back, err = ParsePackedResponse(string(fromParts))
		require.NoError(t, err)
		assert.Equal(t, resp, back.Response())
	}
	assert.True(t, PackResponse(nil).IsZero())
	assert.Nil(t, PackedResponse{}.Response())
}

func TestParsePackedResponseRefusesDamage(t *testing.T) {
	valid, err := PackResponse(&Response{Status: 200, Header: http.Header{"A": {"b"}}, Body: []byte("body")}).AppendBinary(nil)
	require.NoError(t, err)
	// Every cut that ends within the status, flags or fields is refused.
	bodyStart := len(valid) - len("body")
	for n := range bodyStart {
		_, err := ParsePackedResponse(string(valid[:n]))
		assert.Error(t, err, "cut at %d", n)
	}
	for _, tt := range []struct {
		name string
		data string
	}{
		{"status below 100", "\x63\x00\x00"},
		{"status above 999", "\xe8\x07\x00\x00"},
		{"interim status", "\x64\x00\x00"},
		{"unknown flag", "\xc8\x01\x02\x00"},
		{"fields longer than the rest", "\xc8\x01\x00\x05ab"},
		{"empty field name", "\xc8\x01\x00\x02\x00\x00"},
		{"more values than bytes", "\xc8\x01\x00\x04\x01A\x09\x00"},
		{"value longer than the fields", "\xc8\x01\x00\x05\x01A\x01\x05b"},
		{"unterminated uvarint", "\xc8\x81"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParsePackedResponse(tt.data)
			assert.ErrorContains(t, err, "malformed packed response")
		})
	}
}

// FuzzParsePackedResponse feeds ParsePackedResponse arbitrary bytes, as a
// store with damaged data would: it refuses them or returns a response that
// can be decoded and replayed, without panicking.
func FuzzParsePackedResponse(f *testing.F) {
	for _, resp := range []*Response{
		{Status: 204},
		{Status: 200, Header: http.Header{"Vary": {"Accept", "Origin"}, "X-Empty": {""}}, Body: []byte("ok")},
		{Status: 201, Header: http.Header{"Location": {"/a"}, "Content-Type": {"text/plain"}}, BodyOmitted: true},
	} {
		data, err := PackResponse(resp).AppendBinary(nil)
		require.NoError(f, err)
		f.Add(string(data))
	}
	f.Fuzz(func(t *testing.T, data string) {
		p, err := ParsePackedResponse(data)
		if err != nil {
			return
		}
		resp := p.Response()
		require.NotNil(t, resp)
		again, err := PackResponse(resp).AppendBinary(nil)
		require.NoError(t, err)
		_, err = ParsePackedResponse(string(again))
		require.NoError(t, err, "a parsed response packs again")
		w := httptest.NewRecorder()
		p.view().replay(w)
		assert.Equal(t, resp.Status, w.Code)
	})
}
