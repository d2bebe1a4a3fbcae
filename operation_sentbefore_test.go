package idemhttp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// chargeBehindAuth is a payment server: authentication in front of the
// idempotency middleware (where it must be, for keys are scoped by the
// principal it finds), which answers 401 to a token that is no longer
// valid without looking at the key, and a handler that charges.
type chargeBehindAuth struct {
	*httptest.Server
	executions atomic.Int32
	token      atomic.Value // the Authorization value accepted
}

func newChargeBehindAuth(t *testing.T) *chargeBehindAuth {
	s := &chargeBehindAuth{}
	s.token.Store("Bearer t1")
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.executions.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":"pay_%d"}`, n)
	})
	mw := idemserver.Middleware(idemserver.NewMemoryStore(),
		idemserver.WithScope(func(r *http.Request) string { return "tenant-1" }))(charge)
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != s.token.Load().(string) {
			http.Error(w, "token expired", http.StatusUnauthorized)
			return
		}
		mw.ServeHTTP(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// charge sends the operation's charge with token.
func (s *chargeBehindAuth) charge(t *testing.T, tr http.RoundTripper, token string) (int, string) {
	t.Helper()
	code, body, err := sendCharge(t, tr.RoundTrip, s.URL, token)
	require.NoError(t, err)
	return code, body
}

// sendCharge sends the charge of operation charge-7 to url with token
// through send (a RoundTrip, or an http.Client's Do), and reads the
// response.
func sendCharge(t *testing.T, send func(*http.Request) (*http.Response, error), url, token string) (int, string, error) {
	t.Helper()
	req := post(t, WithOperation(context.Background(), "charge-7"), url, `{"amount":100}`)
	req.Header.Set("Authorization", token)
	resp, err := send(req)
	if err != nil {
		return 0, "", err
	}
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	return resp.StatusCode, string(body), nil
}

// losingFirstResponse sends through base but loses the first response on
// the way back, after the server acted, as a connection reset would; the
// caller's token expires meanwhile.
func (s *chargeBehindAuth) losingFirstResponse(t *testing.T) http.RoundTripper {
	base := newBaseTransport(t)
	var attempts atomic.Int32
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := base.RoundTrip(r)
		if attempts.Add(1) == 1 && err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			s.token.Store("Bearer t2")
			return nil, fmt.Errorf("read: %w", syscall.ECONNRESET)
		}
		return resp, err
	})
}

// refusedThenReplayed charges with the expired token, which keeps the
// operation's key pending, then with a fresh one, which gets the first
// charge replayed.
func (s *chargeBehindAuth) refusedThenReplayed(t *testing.T, tr http.RoundTripper, store KeyStore) {
	t.Helper()
	code, _ := s.charge(t, tr, "Bearer t1")
	require.Equal(t, http.StatusUnauthorized, code)
	assert.Len(t, pendingKeys(t, store), 1, "the 401 answered a key that may have charged")

	code, body := s.charge(t, tr, "Bearer t2")
	assert.Equal(t, http.StatusCreated, code)
	assert.Equal(t, `{"payment":"pay_1"}`, body)
	assert.Equal(t, int32(1), s.executions.Load(), "the charge ran twice")
	assert.Empty(t, pendingKeys(t, store), "released once the replay was read")
}

// A 4xx that answers a key the server may already have acted on, and that
// is not the server's replay of the key's outcome, leaves the key pending:
// the call the caller makes with a fresh token sends it again and gets the
// charge replayed instead of made a second time.
func TestFourXXAfterTheKeyWasSentKeepsItPending(t *testing.T) {
	t.Run("retry within the call", func(t *testing.T) {
		srv := newChargeBehindAuth(t)
		store := NewMemoryKeyStore()
		tr := NewTransport(srv.losingFirstResponse(t), WithKeyStore(store), WithBackoff(noWait))

		srv.refusedThenReplayed(t, tr, store)
	})
	t.Run("next call of the operation", func(t *testing.T) {
		srv := newChargeBehindAuth(t)
		store := NewMemoryKeyStore()
		tr := NewTransport(srv.losingFirstResponse(t), WithKeyStore(store), WithMaxAttempts(1))

		_, err := tr.RoundTrip(post(t, WithOperation(context.Background(), "charge-7"), srv.URL, `{"amount":100}`))
		require.Error(t, err, "the response was lost")
		require.Len(t, pendingKeys(t, store), 1)

		// Resumed with the token it had: refused, without a look at the key.
		srv.refusedThenReplayed(t, tr, store)
	})
	t.Run("in-progress 409 without Retry-After", func(t *testing.T) {
		// A server that says "still in progress" with a bare 409, as the
		// IETF draft allows, to the retry of an attempt that timed out.
		var attempts atomic.Int32
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if attempts.Add(1) == 1 {
				return nil, fmt.Errorf("read: %w", syscall.ECONNRESET)
			}
			return okResponse(r, http.StatusConflict), nil
		})
		store := NewMemoryKeyStore()
		tr := NewTransport(base, WithKeyStore(store), WithBackoff(noWait))

		resp := do(t, tr, post(t, WithOperation(context.Background(), "charge-9"), "http://pay.example", "x"))

		assert.Equal(t, http.StatusConflict, resp.StatusCode)
		assert.Len(t, pendingKeys(t, store), 1, "the first attempt may still be charging")
	})
	t.Run("a replayed 4xx is final", func(t *testing.T) {
		var executions atomic.Int32
		refuse := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			executions.Add(1)
			http.Error(w, "card declined", http.StatusPaymentRequired)
		})
		srv := newFirstAnswerLost(t, idemserver.Middleware(idemserver.NewMemoryStore())(refuse))
		store := NewMemoryKeyStore()
		tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait))

		resp := do(t, tr, post(t, WithOperation(context.Background(), "charge-8"), srv.URL, `{"amount":100}`))

		assert.Equal(t, http.StatusPaymentRequired, resp.StatusCode)
		assert.Equal(t, "true", resp.Header.Get(idemserver.ReplayedHeader))
		assert.Equal(t, int32(1), executions.Load())
		assert.Empty(t, pendingKeys(t, store), "the server replayed the key's outcome")
	})
}

// A followed redirect does not make the key's next send its first: a 4xx
// answering the request that follows keeps the operation's key pending
// when the key may already have acted. Authentication in front of the
// charge refuses a token that expired meanwhile; the call made with a
// fresh token gets the first charge replayed.
func TestFourXXAfterAFollowedRedirectOfAKeySentBeforeKeepsItPending(t *testing.T) {
	t.Run("308 answering a resumed key", func(t *testing.T) {
		// The charge moved: /pay redirects to /v2/pay, the same request
		// with the same key. The first call's charge went through, and
		// its response was lost.
		srv := newChargeBehindAuth(t)
		moved := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, srv.URL+"/v2/pay", http.StatusPermanentRedirect)
		}))
		t.Cleanup(moved.Close)
		store := NewMemoryKeyStore()
		lossy, base := srv.losingFirstResponse(t), newBaseTransport(t)
		client := &http.Client{Transport: NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.URL.Path == "/v2/pay" {
				return lossy.RoundTrip(r)
			}
			return base.RoundTrip(r)
		}), WithKeyStore(store), WithMaxAttempts(1))}
		charge := func(token string) (int, string, error) {
			return sendCharge(t, client.Do, moved.URL+"/pay", token)
		}
		// http.Client keeps Authorization only on a redirect to the same
		// host or a subdomain; both servers are 127.0.0.1.
		_, _, err := charge("Bearer t1")
		require.Error(t, err, "the response was lost")
		require.Len(t, pendingKeys(t, store), 1)

		code, _, err := charge("Bearer t1")
		require.NoError(t, err)
		require.Equal(t, http.StatusUnauthorized, code)
		assert.Len(t, pendingKeys(t, store), 1, "the 401 answered a key that may have charged")

		code, body, err := charge("Bearer t2")
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, code)
		assert.Equal(t, `{"payment":"pay_1"}`, body)
		assert.Equal(t, int32(1), srv.executions.Load(), "the charge ran twice")
		assert.Empty(t, pendingKeys(t, store), "released once the replay was read")
	})
	t.Run("303 whose GET is refused", func(t *testing.T) {
		// The charge answers 303 See Other to its receipt; the token
		// expires before http.Client fetches it. The key's outcome is the
		// 303, which charged: the GET's 401 says nothing of it.
		var executions atomic.Int32
		var token atomic.Value
		token.Store("Bearer t1")
		charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := executions.Add(1)
			token.Store("Bearer t2")
			http.Redirect(w, r, fmt.Sprintf("/receipts/%d", n), http.StatusSeeOther)
		}))
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != token.Load().(string) {
				http.Error(w, "token expired", http.StatusUnauthorized)
				return
			}
			if r.Method == http.MethodPost {
				charge.ServeHTTP(w, r)
				return
			}
			io.WriteString(w, "receipt for "+r.URL.Path)
		}))
		t.Cleanup(srv.Close)
		store := NewMemoryKeyStore()
		client := &http.Client{Transport: NewTransport(newBaseTransport(t), WithKeyStore(store))}
		pay := func(token string) (int, string) {
			code, body, err := sendCharge(t, client.Do, srv.URL+"/pay", token)
			require.NoError(t, err)
			return code, body
		}

		code, _ := pay("Bearer t1")
		require.Equal(t, http.StatusUnauthorized, code)
		assert.Len(t, pendingKeys(t, store), 1, "the 401 answered the GET, not the charge")

		code, body := pay("Bearer t2")
		assert.Equal(t, http.StatusOK, code)
		assert.Equal(t, "receipt for /receipts/1", body)
		assert.Equal(t, int32(1), executions.Load(), "the charge ran twice")
		assert.Empty(t, pendingKeys(t, store), "released once the receipt was read")
	})
}

// A key field the caller left blank under a spelling of the name other
// than the canonical one is no key either, and the Transport's own key
// replaces it instead of going out beside it: a server reads two key
// fields as a malformed key (idemserver answers 400) or takes either one.
func TestBlankCallerKeyInAnotherSpellingIsReplaced(t *testing.T) {
	for _, name := range []string{"idempotency-key", "IDEMPOTENCY-KEY"} {
		t.Run(name, func(t *testing.T) {
			var executions atomic.Int32
			var fields recorder[[]string]
			charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				w.WriteHeader(http.StatusCreated)
			}))
			srv := newFirstAnswerLost(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fields.add(r.Header.Values("Idempotency-Key"))
				charge.ServeHTTP(w, r)
			}))
			req := post(t, context.Background(), srv.URL, `{"amount":100}`)
			req.Header[name] = []string{" "}

			resp := do(t, NewTransport(newBaseTransport(t), WithBackoff(noWait)), req)

			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			assert.Equal(t, int32(1), executions.Load())
			sent := fields.all()
			require.Len(t, sent, 2)
			require.Len(t, sent[0], 1, "one key field")
			assert.Equal(t, sent[0], sent[1])
			assert.Equal(t, []string{" "}, req.Header[name], "caller's header changed")
		})
	}
}

// newFirstAnswerLost serves h, but loses its answer to the first request:
// h runs, and the connection is closed without a response.
func newFirstAnswerLost(t *testing.T, h http.Handler) *httptest.Server {
	var seen atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if seen.Add(1) == 1 {
			h.ServeHTTP(httptest.NewRecorder(), r)
			hangUp(w, r)
			return
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}
