package pgstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// commitCutter is a TCP proxy in front of PostgreSQL that, once armed,
// loses the connection that sends a COMMIT (or, with cutAt, another simple
// query that begins so): before the COMMIT reaches the
// server (nothing is committed), or after the server answered it
// (everything is), before the answer reaches the client. Either way the
// client cannot tell which. In place of the server's answer it may send one
// of its own, as a connection pooler in front of the server does when it
// loses its server connection.
type commitCutter struct {
	ln       net.Listener
	target   string
	deliver  bool   // forward the COMMIT before cutting
	answer   []byte // sent to the client in place of the server's answer
	cutAt    string // the lower-case start of the query to cut at; "commit" if empty
	silent   bool   // go silent at the cut, as a connection whose peer vanished, rather than close it
	armed    atomic.Bool
	cut      atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
	cutError error
}

func newCommitCutter(t *testing.T, target string, deliver bool) *commitCutter {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &commitCutter{ln: ln, target: target, deliver: deliver}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *commitCutter) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns = append(p.conns, c)
}

func (p *commitCutter) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.track(client)
		p.track(server)
		var dropReplies atomic.Bool
		p.wg.Go(func() {
			// Server to client, until a reply is to be dropped.
			buf := make([]byte, 32<<10)
			for {
				n, err := server.Read(buf)
				if dropReplies.Load() {
					if p.silent {
						if err != nil {
							return
						}
						continue
					}
					if p.answer != nil {
						_, _ = client.Write(p.answer)
					}
					_ = client.Close()
					_ = server.Close()
					return
				}
				if n > 0 {
					if _, werr := client.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					_ = client.Close()
					return
				}
			}
		})
		p.wg.Go(func() {
			defer server.Close()
			if err := p.relay(client, server, &dropReplies); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				p.mu.Lock()
				p.cutError = err
				p.mu.Unlock()
			}
		})
	}
}

// relay copies the client's messages to the server, message by message,
// and cuts the connection at an armed COMMIT.
func (p *commitCutter) relay(client, server net.Conn, dropReplies *atomic.Bool) error {
	// Untyped messages first: SSL or GSS encryption requests, then the
	// startup message (protocol 3.0).
	for {
		var hdr [8]byte
		if _, err := io.ReadFull(client, hdr[:]); err != nil {
			return err
		}
		n := binary.BigEndian.Uint32(hdr[:4])
		rest := make([]byte, n-8)
		if _, err := io.ReadFull(client, rest); err != nil {
			return err
		}
		if _, err := server.Write(append(hdr[:], rest...)); err != nil {
			return err
		}
		if binary.BigEndian.Uint32(hdr[4:]) == 196608 {
			break
		}
	}
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(client, hdr[:]); err != nil {
			return err
		}
		body := make([]byte, binary.BigEndian.Uint32(hdr[1:])-4)
		if _, err := io.ReadFull(client, body); err != nil {
			return err
		}
		msg := append(hdr[:], body...)
		cutAt := p.cutAt
		if cutAt == "" {
			cutAt = "commit"
		}
		if hdr[0] == 'Q' && bytes.HasPrefix(bytes.ToLower(body), []byte(cutAt)) && p.armed.CompareAndSwap(true, false) {
			p.cut.Store(true)
			if !p.deliver {
				_ = client.Close()
				return nil
			}
			dropReplies.Store(true)
		}
		if _, err := server.Write(msg); err != nil {
			return err
		}
	}
}

// releaseCounter counts the Releases of a Store, and keeps their errors.
type releaseCounter struct {
	*Store
	releases atomic.Int64
	mu       sync.Mutex
	errs     []error
}

func (r *releaseCounter) Release(ctx context.Context, key idemserver.Key, token string) error {
	r.releases.Add(1)
	err := r.Store.Release(ctx, key, token)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
	return err
}

// releaseErrs returns the errors of the Releases so far, nil for a success.
func (r *releaseCounter) releaseErrs() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

// errorResponse returns a PostgreSQL ErrorResponse message of severity
// FATAL with the SQLSTATE code and message.
func errorResponse(code, message string) []byte {
	var fields []byte
	for _, f := range []struct {
		typ byte
		val string
	}{{'S', "FATAL"}, {'V', "FATAL"}, {'C', code}, {'M', message}} {
		fields = append(append(append(fields, f.typ), f.val...), 0)
	}
	fields = append(fields, 0)
	msg := []byte{'E', 0, 0, 0, 0}
	binary.BigEndian.PutUint32(msg[1:], uint32(4+len(fields)))
	return append(msg, fields...)
}

func TestConnectionLostAtCommit(t *testing.T) {
	for _, tt := range []struct {
		name      string
		committed bool
		answer    []byte // the client's answer to the COMMIT, if any
	}{
		{"before the server got the COMMIT", false, nil},
		{"after the server committed", true, nil},
		// A pooler (PgBouncer) that loses its server connection while a
		// query is out answers with an error of its own: an SQLSTATE that
		// does not say the server rolled back.
		{"after the server committed, answered by a pooler", true, errorResponse("08P01", "server conn crashed?")},
		{"after the server committed, answered by a shutdown", true, errorResponse("57P01", "terminating connection due to administrator command")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			table := db.newStore(t, WithTransactional()).table.name

			cfg, err := pgx.ParseConfig(db.dsn)
			require.NoError(t, err)
			proxy := newCommitCutter(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), tt.committed)
			proxy.answer = tt.answer
			cfg.Host, cfg.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
			cfg.RuntimeParams["search_path"] = db.schema
			pool := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { _ = pool.Close() })
			s, err := New(pool, WithTable(table), WithTransactional())
			require.NoError(t, err)
			store := &releaseCounter{Store: s}

			var events []idemserver.Event
			h := idemserver.Middleware(store, idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					proxy.armed.Store(true) // this request's COMMIT is lost
					txPaymentsHandler().ServeHTTP(w, r)
				}))
			status, body, _ := post(h, "k")
			require.True(t, proxy.cut.Load(), "the COMMIT went through the proxy")
			assert.Equal(t, http.StatusServiceUnavailable, status, body)
			assert.Contains(t, body, idemserver.ProblemStoreUnavailable)
			assert.NotContains(t, body, "payment", "none of the handler's response")
			assert.Zero(t, store.releases.Load(), "a COMMIT of unknown outcome is never followed by a release")
			assert.Zero(t, pool.Stats().InUse, "the claim's connection is back in the pool")
			require.Len(t, events, 1)
			assert.ErrorIs(t, events[0].Err, idemserver.ErrOutcomeUnknown)
			assert.NotErrorIs(t, events[0].Err, idemserver.ErrRolledBack, "a COMMIT of unknown outcome is not reported rolled back")
			assert.NotContains(t, body, "rolled back")

			// The retry learns from the table what committed. Until the
			// server sees the lost connection and rolls it back, the
			// claim is in progress: the retry waits.
			direct, err := New(db.DB, WithTable(table), WithTransactional())
			require.NoError(t, err)
			retry := idemserver.Middleware(direct, idemserver.WithWaitInFlight(20*time.Second))(txPaymentsHandler())
			status, body, replayed := post(retry, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.Equal(t, tt.committed, replayed, "replayed what committed, or ran what did not")
			assert.Equal(t, 1, countPayments(t, db.DB, "k"))
		})
	}
}

func TestBackendTerminatedDuringCommit(t *testing.T) {
	// The server ends the claim's session while its COMMIT runs (here in a
	// deferred trigger, before the commit record): the client cannot tell
	// whether it committed. It gets 503 with Retry-After, the claim is not
	// released, and its retry learns from the table that nothing was kept,
	// and runs the payment once.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	for _, q := range []string{
		"CREATE SEQUENCE slow_commits",
		`CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('slow_commits') = 1 THEN
		PERFORM pg_sleep(60);
	END IF;
	RETURN NEW;
END $$`,
		"CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON payments DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err, q)
	}
	s := db.newStore(t, WithTransactional())
	var events []idemserver.Event
	var mu sync.Mutex
	var runs atomic.Int64
	pids := make(chan int, 3)
	h := idemserver.Middleware(s, idemserver.WithObserver(func(e idemserver.Event) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	}))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var pid int
		if !assert.NoError(t, Tx(r.Context()).QueryRowContext(r.Context(), "SELECT pg_backend_pid()").Scan(&pid)) {
			http.Error(w, "no pid", http.StatusInternalServerError)
			return
		}
		pids <- pid
		txPaymentsHandler().ServeHTTP(w, r)
	}))

	type answer struct {
		status int
		retry  string
	}
	first := make(chan answer, 1)
	go func() {
		w := serveOnce(h, "k")
		first <- answer{w.Code, w.Header().Get("Retry-After")}
	}()
	pid := <-pids
	require.Eventually(t, func() bool {
		var sleeping bool
		require.NoError(t, db.QueryRowContext(t.Context(),
			"SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep')", pid).Scan(&sleeping))
		return sleeping
	}, 30*time.Second, 10*time.Millisecond, "the COMMIT runs its deferred trigger")
	var terminated bool
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1)", pid).Scan(&terminated))
	require.True(t, terminated)

	got := <-first
	assert.Equal(t, http.StatusServiceUnavailable, got.status)
	assert.NotEmpty(t, got.retry, "Retry-After")
	mu.Lock()
	require.Len(t, events, 1)
	assert.ErrorIs(t, events[0].Err, idemserver.ErrOutcomeUnknown)
	mu.Unlock()
	assert.Zero(t, countPayments(t, db.DB, "k"), "the terminated COMMIT kept nothing")

	// The retry runs the payment, once the server has let the ended
	// session's locks go (until then the key is in progress).
	var status int
	var body string
	require.Eventually(t, func() bool {
		status, body, _ = post(h, "k")
		return status != http.StatusConflict
	}, 30*time.Second, 10*time.Millisecond)
	assert.Equal(t, http.StatusCreated, status, body)
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
	assert.Equal(t, int64(2), runs.Load())
	status, replay, replayed := post(h, "k")
	assert.Equal(t, http.StatusCreated, status)
	assert.True(t, replayed)
	assert.Equal(t, body, replay)
	assert.Zero(t, db.Stats().InUse, "no transaction left open")
}
