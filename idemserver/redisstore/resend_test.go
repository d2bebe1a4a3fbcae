package redisstore_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// replyDropper is a TCP proxy in front of a Redis server that, when armed,
// lets the next call of a command (SET, for a claim, or EVALSHA, for a
// script) reach Redis, drops Redis's reply and closes the connection, as a
// network failure after the command ran would: go-redis then sends the
// command again on a new connection.
type replyDropper struct {
	t        *testing.T
	upstream string
	l        net.Listener
	wg       sync.WaitGroup

	mu      sync.Mutex
	armed   []byte // the armed command's name as go-redis sends it; nil when not armed
	onDrop  func() // runs before the client sees its connection closed
	dropped int
	conns   []net.Conn
}

func newReplyDropper(t *testing.T, upstream string) *replyDropper {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &replyDropper{t: t, upstream: upstream, l: l}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *replyDropper) addr() string { return p.l.Addr().String() }

// arm makes the proxy drop the reply to the next call of cmd ("set" or
// "evalsha"), running onDrop (if not nil) before it closes the connection.
func (p *replyDropper) arm(cmd string, onDrop func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// go-redis sends the name, lower case, as the first bulk string.
	p.onDrop = onDrop
	p.armed = fmt.Appendf(nil, "$%d\r\n%s\r\n", len(cmd), cmd)
}

// drops returns how many replies the proxy dropped.
func (p *replyDropper) drops() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

func (p *replyDropper) close() {
	_ = p.l.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *replyDropper) accept() {
	for {
		client, err := p.l.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		// dropNext is set by the request side when an armed proxy passes
		// the command it is armed for, and read by the reply side.
		dropNext := make(chan struct{}, 1)
		p.wg.Go(func() {
			defer server.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := client.Read(buf)
				if n > 0 {
					p.mu.Lock()
					if p.armed != nil && bytes.Contains(buf[:n], p.armed) {
						p.armed = nil
						dropNext <- struct{}{}
					}
					p.mu.Unlock()
					if _, werr := server.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		})
		p.wg.Go(func() {
			defer client.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := server.Read(buf)
				if n > 0 {
					select {
					case <-dropNext:
						// Redis ran the command; its answer is lost.
						p.mu.Lock()
						p.dropped++
						onDrop := p.onDrop
						p.mu.Unlock()
						if onDrop != nil {
							onDrop()
						}
						_ = server.Close()
						return
					default:
					}
					if _, werr := client.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
						p.t.Logf("proxy: %v", err)
					}
					return
				}
			}
		})
	}
}

// newResendFixture returns a store whose client reaches the test server
// through a replyDropper, with one connection so that the proxy sees one
// command at a time, and a direct client of the server with the same prefix.
func newResendFixture(t *testing.T) (store *redisstore.Store, direct *redisstore.Store, p *replyDropper, c *redis.Client) {
	c = newClient(t)
	prefix := newPrefix(t, c)
	p = newReplyDropper(t, redisAddr(t))
	proxied := redis.NewClient(&redis.Options{Addr: p.addr(), PoolSize: 1})
	t.Cleanup(func() { _ = proxied.Close() })
	store = redisstore.New(proxied, redisstore.WithPrefix(prefix))
	direct = redisstore.New(c, redisstore.WithPrefix(prefix))
	// Redis has every script, so that a dropped reply is the script's own
	// and not a NOSCRIPT.
	warm(t, store)
	return store, direct, p, c
}

// mustClaim claims c in s, which must grant it.
func mustClaim(t *testing.T, s idemserver.Store, c idemserver.Claim) {
	t.Helper()
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
}

func TestCommandSentAgain(t *testing.T) {
	// Each store call whose reply is lost after Redis ran it is sent again
	// by go-redis. The call sent again must report what the first did.
	ok := &idemserver.Response{Status: http.StatusCreated, Body: []byte("done")}
	t.Run("Claim", func(t *testing.T) {
		store, direct, p, _ := newResendFixture(t)
		c := claim("k", "winner", time.Minute)
		p.arm("set", nil)
		res, err := store.Claim(t.Context(), c)
		require.NoError(t, err)
		require.Equal(t, 1, p.drops(), "the reply was dropped")
		assert.True(t, res.Claimed, "the claim that won still wins")
		res, err = direct.Claim(t.Context(), claim("k", "other", time.Minute))
		require.NoError(t, err)
		assert.False(t, res.Claimed)
		assert.Equal(t, "winner", res.Record.Token)
	})
	t.Run("Claim, sent again after its lease ended", func(t *testing.T) {
		// Redis ran the claim, but its reply was lost and the claim was
		// sent again only once the lease had ended (after a read timeout,
		// with a short lease). The claim sent again finds its own token and
		// wins, with the lease it asked for, which has ended: the store
		// does not start it again, so the middleware, which compares the
		// lease's end with its clock, does not run the handler (see
		// TestClaimSentAgainAfterLeaseEndedThroughMiddleware), and a
		// takeover may take the key.
		store, direct, p, _ := newResendFixture(t)
		c := claim("k", "winner", 50*time.Millisecond)
		p.arm("set", func() { waitLeaseEnded(t, direct, c) })
		res, err := store.Claim(t.Context(), c)
		require.NoError(t, err)
		require.Equal(t, 1, p.drops())
		require.True(t, res.Claimed, "the claim sent again finds its own token")
		assert.False(t, time.Now().Before(c.LeaseExpires), "its lease has ended")
		probe := claim("k", "probe", time.Minute)
		res, err = direct.Claim(t.Context(), probe)
		require.NoError(t, err)
		assert.Equal(t, c.Token, res.Record.Token)
		assert.WithinDuration(t, c.LeaseExpires, res.Record.LeaseExpires, time.Microsecond, "the lease the claim asked for")
		assert.False(t, probe.Now.Before(res.Record.LeaseExpires), "ended")
	})
	t.Run("TakeOver", func(t *testing.T) {
		store, direct, p, _ := newResendFixture(t)
		old := claim("k", "old", time.Millisecond)
		mustClaim(t, direct, old)
		waitLeaseEnded(t, direct, old)
		p.arm("evalsha", nil)
		res, err := store.TakeOver(t.Context(), claim("k", "taker", time.Minute), "old")
		require.NoError(t, err)
		require.Equal(t, 1, p.drops())
		assert.True(t, res.Claimed, "the takeover that won still wins")
	})
	t.Run("Complete", func(t *testing.T) {
		store, direct, p, _ := newResendFixture(t)
		c := claim("k", "holder", time.Minute)
		mustClaim(t, direct, c)
		p.arm("evalsha", nil)
		err := store.Complete(t.Context(), c.Key, c.Token, ok, time.Now().Add(time.Hour))
		require.Equal(t, 1, p.drops())
		assert.NoError(t, err, "the response was stored, by this very lease")
		res, err := direct.Claim(t.Context(), claim("k", "later", time.Minute))
		require.NoError(t, err)
		require.True(t, res.Record.Completed())
		assert.Equal(t, ok.Body, res.Record.Response.Body)
	})
	t.Run("Complete after a takeover", func(t *testing.T) {
		// A completion of a lease taken over fails, the first time and
		// when it is sent again.
		store, direct, p, _ := newResendFixture(t)
		c := claim("k", "holder", time.Millisecond)
		mustClaim(t, direct, c)
		waitLeaseEnded(t, direct, c)
		res, err := direct.TakeOver(t.Context(), claim("k", "taker", time.Minute), c.Token)
		require.NoError(t, err)
		require.True(t, res.Claimed)
		p.arm("evalsha", nil)
		err = store.Complete(t.Context(), c.Key, c.Token, ok, time.Now().Add(time.Hour))
		require.Equal(t, 1, p.drops())
		assert.ErrorIs(t, err, idemserver.ErrLeaseLost)
		res, err = direct.Claim(t.Context(), claim("k", "later", time.Minute))
		require.NoError(t, err)
		assert.Equal(t, "taker", res.Record.Token, "the taker keeps the key")
	})
	t.Run("Release, then another claims", func(t *testing.T) {
		// The key is claimed by another request between the release and
		// the release sent again: the second must not delete that claim.
		store, direct, p, _ := newResendFixture(t)
		c := claim("k", "first", time.Minute)
		mustClaim(t, direct, c)
		p.arm("evalsha", func() {
			res, err := direct.Claim(t.Context(), claim("k", "second", time.Minute))
			assert.NoError(t, err)
			assert.True(t, res.Claimed, "the released key is free")
		})
		err := store.Release(t.Context(), c.Key, c.Token)
		require.Equal(t, 1, p.drops())
		// Redis has no trace of the release that ran, so the one sent
		// again reports the lease lost; either answer is harmless here.
		if err != nil {
			assert.ErrorIs(t, err, idemserver.ErrLeaseLost)
		}
		res, err := direct.Claim(t.Context(), claim("k", "third", time.Minute))
		require.NoError(t, err)
		assert.False(t, res.Claimed)
		assert.Equal(t, "second", res.Record.Token, "the second claim survives")
	})
	t.Run("Extend", func(t *testing.T) {
		store, direct, p, c := newResendFixture(t)
		cl := claim("k", "holder", time.Minute)
		mustClaim(t, direct, cl)
		p.arm("evalsha", nil)
		require.NoError(t, store.Extend(t.Context(), cl.Key, cl.Token, time.Now().Add(time.Hour)))
		require.Equal(t, 1, p.drops())
		keys, err := c.Keys(t.Context(), "*{:k}").Result()
		require.NoError(t, err)
		require.Len(t, keys, 1)
		pttl, err := c.PTTL(t.Context(), keys[0]).Result()
		require.NoError(t, err)
		assert.Greater(t, pttl, time.Hour, "the key lives past the extended lease")
	})
}

func TestCompletionSentAgainThroughMiddleware(t *testing.T) {
	// The handler ran and its response was stored, but the reply to the
	// completion was lost and go-redis sent it again: the client gets the
	// handler's response, the same that every retry replays.
	store, _, p, _ := newResendFixture(t)
	var runs runCounter
	var seen events
	srv := httptest.NewServer(idemserver.Middleware(store, idemserver.WithObserver(seen.add))(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			run := runs.add("k")
			p.arm("evalsha", nil) // the next script call is the completion
			created(int64(run), w)
		})))
	defer srv.Close()

	first := mustPost(t, srv, "k", "b")
	require.Equal(t, 1, p.drops())
	assert.Equal(t, http.StatusCreated, first.status, "the handler's response: %s", first.body)
	ev := seen.of("k")
	require.Len(t, ev, 1)
	assert.Equal(t, idemserver.OutcomeExecuted, ev[0].Outcome)
	assert.NoError(t, ev[0].Err)

	retry := mustPost(t, srv, "k", "b")
	assert.Equal(t, "true", retry.header.Get(idemserver.ReplayedHeader))
	assert.Equal(t, http.StatusCreated, retry.status)
	assert.Equal(t, first.body, retry.body)
	assert.Equal(t, 1, runs.get("k"))
}

func TestClaimSentAgainAfterLeaseEndedThroughMiddleware(t *testing.T) {
	// The reply to a claim is lost, and go-redis sends the claim again
	// only after the lease it asked for has ended. The claim wins, but the
	// middleware sees its lease over and does not run the handler: another
	// request could take the key over as it starts. The key is released,
	// and the retry runs the handler once.
	const lease = 50 * time.Millisecond
	store, direct, p, _ := newResendFixture(t)
	var runs runCounter
	srv := httptest.NewServer(idemserver.Middleware(store, idemserver.WithLease(lease))(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) { created(int64(runs.add("k")), w) })))
	defer srv.Close()

	p.arm("set", func() {
		// Until a claim finds the record's lease ended.
		deadline := time.Now().Add(10 * time.Second)
		for {
			probe := claim("k", "probe", time.Minute)
			res, err := direct.Claim(t.Context(), probe)
			if !assert.NoError(t, err) || !assert.False(t, res.Claimed) {
				return
			}
			if !probe.Now.Before(res.Record.LeaseExpires) {
				return
			}
			if !assert.True(t, time.Now().Before(deadline), "lease not ended") {
				return
			}
			time.Sleep(time.Millisecond)
		}
	})
	first := mustPost(t, srv, "k", "b")
	require.Equal(t, 1, p.drops())
	assert.Equal(t, http.StatusServiceUnavailable, first.status, "%s", first.body)
	assert.Zero(t, runs.get("k"), "no handler runs on a lease that ended")

	retry := mustPost(t, srv, "k", "b")
	assert.Equal(t, http.StatusCreated, retry.status)
	assert.Equal(t, 1, runs.get("k"))
}
