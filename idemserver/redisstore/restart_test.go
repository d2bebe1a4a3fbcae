package redisstore_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// serverEnv names the redis-server binary for tests that start servers of
// their own; scripts/with-redis.sh sets it.
const serverEnv = "IDEMHTTP_TEST_REDIS_SERVER"

// redisServer is a redis-server process of a test's own, on a loopback
// port and in a directory that outlive each process.
type redisServer struct {
	t    *testing.T
	bin  string
	dir  string
	args []string
	addr string
	cmd  *exec.Cmd
	done chan struct{}
}

// startRedis starts a redis-server for t, with the append-only file
// synced on every write if aof is set, and without persistence otherwise.
// It runs only beside the shared test server: without one, t is skipped.
func startRedis(t *testing.T, aof bool) *redisServer {
	if aof {
		return startRedisWith(t, "--appendonly", "yes", "--appendfsync", "always")
	}
	return startRedisWith(t, "--appendonly", "no")
}

// startRedisWith starts a redis-server for t with the options extra, and
// without snapshots. It runs only beside the shared test server: without
// one, t is skipped.
func startRedisWith(t *testing.T, extra ...string) *redisServer {
	redisAddr(t)
	bin := os.Getenv(serverEnv)
	if bin == "" {
		var err error
		bin, err = exec.LookPath("redis-server")
		require.NoError(t, err, "no redis-server: set %s", serverEnv)
	}
	s := &redisServer{t: t, bin: bin, dir: t.TempDir()}
	s.args = []string{"--bind", "127.0.0.1", "--dir", s.dir, "--save", "", "--logfile", filepath.Join(s.dir, "log")}
	s.args = append(s.args, extra...)
	t.Cleanup(s.kill)
	// A port free now may be taken before the server binds it.
	for range 3 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		s.addr = l.Addr().String()
		require.NoError(t, l.Close())
		if s.start() == nil {
			return s
		}
	}
	log, _ := os.ReadFile(filepath.Join(s.dir, "log"))
	t.Fatalf("redis-server did not start:\n%s", log)
	return nil
}

// start starts the server process and waits until it answers.
func (s *redisServer) start() error {
	_, port, _ := net.SplitHostPort(s.addr)
	s.cmd = exec.Command(s.bin, append([]string{"--port", port}, s.args...)...)
	if err := s.cmd.Start(); err != nil {
		return err
	}
	s.done = make(chan struct{})
	go func() {
		_ = s.cmd.Wait()
		close(s.done)
	}()
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := c.Ping(context.Background()).Err()
		if err == nil {
			return nil
		}
		select {
		case <-s.done:
			return errors.New("redis-server exited")
		default:
		}
		if time.Now().After(deadline) {
			s.kill()
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// kill stops the server as a crash would, with SIGKILL.
func (s *redisServer) kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.done
	s.cmd = nil
}

// newRestartClient returns a client of server that dials once per attempt
// rather than go-redis's five, so that a request fails sooner while Redis is
// down.
func newRestartClient(t *testing.T, server *redisServer) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: server.addr, DialerRetries: 1})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// waitAnswers waits until c reaches its restarted server. Once as many
// dials as its pool holds connections have failed, a go-redis client
// answers the last dial error without dialing, until a probe it sends once
// a second gets through; how many fail first depends on the machine's
// cores, the default pool size being ten per core.
func waitAnswers(t *testing.T, c *redis.Client) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(t.Context()).Err() != nil {
		require.True(t, time.Now().Before(deadline), "the client does not reach the restarted server")
		time.Sleep(10 * time.Millisecond)
	}
}

// events collects what the middleware observes.
type events struct {
	mu sync.Mutex
	e  []idemserver.Event
}

func (e *events) add(ev idemserver.Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.e = append(e.e, ev)
}

func (e *events) of(key string) []idemserver.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []idemserver.Event
	for _, ev := range e.e {
		if ev.Key.Key == key {
			out = append(out, ev)
		}
	}
	return out
}

// runCounter counts the handler's runs per key.
type runCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *runCounter) add(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[key]++
	return c.n[key]
}

func (c *runCounter) get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

func TestRestart(t *testing.T) {
	// Redis crashes and comes back while the middleware serves. While it is
	// down every keyed request gets 503 and no handler runs; afterwards
	// service resumes. With the append-only file synced on every write, the
	// records survive: a completed key replays, and one claimed when Redis
	// went down is still in progress. Without persistence they are lost,
	// and a retry of the completed key runs its handler again.
	for _, tt := range []struct {
		name string
		aof  bool
	}{
		{"appendfsync always", true},
		{"no persistence", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			server := startRedis(t, tt.aof)
			client := newRestartClient(t, server)
			store := redisstore.New(client)
			var seen events
			var runs runCounter
			entered, release := make(chan struct{}), make(chan struct{})
			srv := httptest.NewServer(idemserver.Middleware(store, idemserver.WithObserver(seen.add))(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					key := r.Header.Get(idemserver.DefaultKeyHeader)
					run := runs.add(key)
					if key == "in-flight" && run == 1 {
						close(entered)
						<-release
					}
					created(int64(run), w)
				})))
			defer srv.Close()

			done := mustPost(t, srv, "done", "b")
			require.Equal(t, http.StatusCreated, done.status)
			var inFlight reply
			var inFlightErr error
			inFlightDone := make(chan struct{})
			go func() {
				defer close(inFlightDone)
				inFlight, inFlightErr = post(srv.Client(), srv.URL, "in-flight", "b")
			}()
			<-entered

			server.kill()
			for _, key := range []string{"new", "done", "new"} {
				r := mustPost(t, srv, key, "b")
				assert.Equal(t, http.StatusServiceUnavailable, r.status, "%s while Redis is down", key)
				assert.NotEmpty(t, r.header.Get("Retry-After"))
				var problem struct{ Type string }
				require.NoError(t, json.Unmarshal(r.body, &problem))
				assert.Equal(t, idemserver.ProblemStoreUnavailable, problem.Type)
			}
			assert.Zero(t, runs.get("new"), "no handler runs without a claim")
			assert.Equal(t, 1, runs.get("done"))
			// The handler that was running finishes: its client gets its
			// response, but the record could not be completed.
			close(release)
			<-inFlightDone
			require.NoError(t, inFlightErr)
			assert.Equal(t, http.StatusCreated, inFlight.status)
			ev := seen.of("in-flight")
			require.Len(t, ev, 1)
			assert.Equal(t, idemserver.OutcomeExecuted, ev[0].Outcome)
			assert.Error(t, ev[0].Err, "the failure to complete is observed")

			require.NoError(t, server.start())
			waitAnswers(t, client)
			r := mustPost(t, srv, "new", "b")
			assert.Equal(t, http.StatusCreated, r.status, "service resumes")
			assert.Equal(t, 1, runs.get("new"))
			r = mustPost(t, srv, "done", "b")
			inProgress := mustPost(t, srv, "in-flight", "b")
			if tt.aof {
				assert.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader), "the completed record survived")
				assert.True(t, bytes.Equal(done.body, r.body))
				assert.Equal(t, 1, runs.get("done"))
				assert.Equal(t, http.StatusConflict, inProgress.status, "the claim survived, until its lease ends")
				assert.Equal(t, 1, runs.get("in-flight"))
			} else {
				assert.Equal(t, http.StatusCreated, r.status, "the completed record was lost")
				assert.Equal(t, "run 2", string(r.body))
				assert.Equal(t, 2, runs.get("done"), "the handler ran again")
				assert.Equal(t, http.StatusCreated, inProgress.status)
				assert.Equal(t, 2, runs.get("in-flight"), "the handler ran again")
			}
		})
	}
}

func TestRestartUnderLoad(t *testing.T) {
	// Clients keep sending new keys while Redis crashes and comes back. A
	// handler ran for exactly the keys whose client got its 201; every other
	// request got 503 and ran nothing. After the restart each key that got
	// 503 runs once when retried, or is in progress if Redis kept its claim
	// but died before answering; each that got 201 replays, or is still in
	// progress when Redis went down before its record was completed.
	const workers = 8
	server := startRedis(t, true)
	store := redisstore.New(newRestartClient(t, server))
	var seen events
	var runs runCounter
	srv := httptest.NewServer(idemserver.Middleware(store, idemserver.WithObserver(seen.add))(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			created(int64(runs.add(r.Header.Get(idemserver.DefaultKeyHeader))), w)
		})))
	defer srv.Close()

	var mu sync.Mutex
	statuses := map[string]int{}
	counts := map[int]int{}
	// waitFor waits until n more requests have had status.
	waitFor := func(status, n int) {
		t.Helper()
		mu.Lock()
		want := counts[status] + n
		mu.Unlock()
		deadline := time.Now().Add(time.Minute)
		for {
			mu.Lock()
			got := counts[status]
			mu.Unlock()
			if got >= want {
				return
			}
			require.True(t, time.Now().Before(deadline), "%d more responses of %d", n, status)
			time.Sleep(5 * time.Millisecond)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := "w" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				r, err := post(srv.Client(), srv.URL, key, "b")
				if !assert.NoError(t, err) {
					return
				}
				mu.Lock()
				statuses[key] = r.status
				counts[r.status]++
				mu.Unlock()
			}
		})
	}
	waitFor(http.StatusCreated, 20)
	server.kill()
	waitFor(http.StatusServiceUnavailable, 20)
	require.NoError(t, server.start())
	waitFor(http.StatusCreated, 20)
	close(stop)
	wg.Wait()

	require.Equal(t, map[int]bool{http.StatusCreated: true, http.StatusServiceUnavailable: true}, keysOf(counts), "statuses")
	for key, status := range statuses {
		if status == http.StatusServiceUnavailable {
			require.Zero(t, runs.get(key), "%s: 503, and its handler ran", key)
			continue
		}
		require.Equal(t, 1, runs.get(key), "%s: 201, and its handler runs", key)
	}
	// Retries after the restart.
	var unanswered, uncompleted int
	for key, status := range statuses {
		r := mustPost(t, srv, key, "b")
		switch {
		case status == http.StatusServiceUnavailable && r.status == http.StatusConflict:
			// Redis kept the claim but went down before it answered: the
			// key waits for the lease to end, and nothing ran.
			unanswered++
			assert.Zero(t, runs.get(key), "%s: 503, then in progress", key)
		case status == http.StatusServiceUnavailable:
			assert.Equal(t, http.StatusCreated, r.status, "%s: retry of a 503", key)
			assert.NotEqual(t, "true", r.header.Get(idemserver.ReplayedHeader), key)
			assert.Equal(t, 1, runs.get(key), "%s runs once", key)
		case r.status == http.StatusConflict:
			// Redis went down between the claim and the completion.
			uncompleted++
			ev := seen.of(key)
			require.NotEmpty(t, ev, key)
			assert.Error(t, ev[0].Err, "%s: in progress, so its completion failed", key)
			assert.Equal(t, 1, runs.get(key), "%s runs once", key)
		default:
			assert.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader), "%s: retry of a 201", key)
			assert.Equal(t, "run 1", string(r.body), key)
			assert.Equal(t, 1, runs.get(key), "%s runs once", key)
		}
	}
	t.Logf("%d keys: %v; in progress after the restart: %d claimed without an answer, %d not completed",
		len(statuses), counts, unanswered, uncompleted)
}

func keysOf[K comparable, V any](m map[K]V) map[K]bool {
	out := make(map[K]bool, len(m))
	for k := range m {
		out[k] = true
	}
	return out
}
