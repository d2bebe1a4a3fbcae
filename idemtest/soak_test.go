package idemtest_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemtest"
)

// The soak runs soakSeeds seeds by default, enough for go test ./...;
// IDEMTEST_SOAK sets how many for a long run, and IDEMTEST_SOAK_FROM the
// first seed, so that a failing seed can be run again alone.
const (
	soakSeeds     = 1
	soakOps       = 24
	soakEnvSeeds  = "IDEMTEST_SOAK"
	soakEnvFrom   = "IDEMTEST_SOAK_FROM"
	soakMaxRounds = 200
	// soakResumeFor bounds the resume rounds in time too: after a server
	// crash, the claims it left hold their keys until their leases end.
	soakResumeFor = 30 * time.Second
)

// soakFaults harms most requests, with every fault the injector knows.
var soakFaults = idemtest.Faults{
	ResetBefore:     0.1,
	LoseResponse:    0.15,
	Unavailable:     0.1,
	TooManyRequests: 0.1,
	Stall:           0.05,
	CutBody:         0.15,
	Latency:         0.3, MaxLatency: 2 * time.Millisecond,
}

// readMode is how a payer treats the body of the response it gets.
type readMode int

const (
	readAll     readMode = iota // read to the end, then close
	closeUnread                 // close without reading
	readPart                    // read a prefix, then close
	readModes
)

// soakConfig is one shape of the soak.
type soakConfig struct {
	name    string
	workers int      // goroutines paying at once
	mode    readMode // readModes: each payment's mode from its index
	// deadline, if set, bounds each call: the payer gives up on its own.
	deadline time.Duration
	server   []idemserver.Option // the middleware's options
}

// soakLease is the lease of the middleware over a shared store: claims a
// crashed server leaves hold their keys this long, and a live handler's
// renewal, every third of it, has the rest of it to spare on a loaded
// machine.
const soakLease = 2 * time.Second

// soakPayment is what the client saw of one payment, across its calls.
type soakPayment struct {
	final  bool   // a 201 was returned and its key released
	status int    // the last status seen, 0 for an error
	seen   []byte // the body bytes seen with a 201 (all, or a prefix)
	whole  bool   // seen is the whole body
}

// TestSoakExactlyOnce drives many payments through an idemhttp client
// with a FileKeyStore against a server that injects every fault at high
// rates; then, as a restarted client, it resumes every operation its key
// store lists as pending, until none is. Every payment must have
// executed exactly once, every 201 a payer saw (whole or the part it read)
// must be the answer the handler gave, and no operation may be left
// pending or finished without its 201 having reached the payer.
//
// It runs over each store of soakBackends: the MemoryStore behind one
// server, and, two servers sharing it, the MemoryStore, pgstore in lease
// and in transactional mode and redisstore, the last three when
// IDEMHTTP_TEST_POSTGRES_DSN and IDEMHTTP_TEST_REDIS_ADDR name their
// servers. Over a shared store, requests are spread across the servers,
// and one crashes halfway through the first pass, with requests in flight,
// and another starts in its place (see soakInstance for what a crash is
// here). In transactional mode the charge is a row written through
// pgstore.Tx, so that exactly once is checked against the database.
func TestSoakExactlyOnce(t *testing.T) {
	seeds, from := soakSeeds, int64(1)
	if v := os.Getenv(soakEnvSeeds); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, soakEnvSeeds)
		seeds = n
	}
	if v := os.Getenv(soakEnvFrom); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err, soakEnvFrom)
		from = n
	}
	configs := []soakConfig{
		{"sequential/mixed reads", 1, readModes, 0, nil},
		{"concurrent/read all", 8, readAll, 0, nil},
		{"concurrent/close unread", 8, closeUnread, 0, nil},
		{"concurrent/read part", 8, readPart, 0, nil},
		{"concurrent/mixed reads", 8, readModes, 0, nil},
		{"concurrent/caller deadlines", 8, readModes, 30 * time.Millisecond, nil},
	}
	if os.Getenv(soakEnvSeeds) != "" {
		// Retries wait for the slow charge and get its replay, and its
		// lease lasts only by being renewed. Only in long runs: its
		// 100 ms lease survives only if renewal runs within about 67 ms,
		// which a machine loaded by a whole test suite does not promise,
		// and a late renewal is a takeover the soak would report.
		configs = append(configs, soakConfig{"concurrent/wait in flight, short lease", 8, readModes, 0,
			[]idemserver.Option{idemserver.WithWaitInFlight(50 * time.Millisecond), idemserver.WithLease(100 * time.Millisecond)}})
	}
	for _, b := range soakBackends() {
		t.Run(b.name, func(t *testing.T) {
			b.skipUnset(t)
			for seed := from; seed < from+int64(seeds); seed++ {
				for _, cfg := range b.configs(configs) {
					t.Run(fmt.Sprintf("seed=%d/%s", seed, cfg.name), func(t *testing.T) {
						soak(t, seed, cfg, b)
					})
				}
			}
		})
	}
}

func soak(t testing.TB, seed int64, cfg soakConfig, b soakBackend) {
	store, effects := b.open(t)
	if b.wrap != nil {
		store = b.wrap(store)
	}
	// The handler charges, and answers with a receipt no other run gives,
	// so that a second run or a wrong replay shows in the body.
	var runs atomic.Int64
	charge := func(inst *soakInstance) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			defer inst.handling()()
			body, err := io.ReadAll(r.Body)
			if err != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			op := string(body)
			run := runs.Add(1)
			if run%7 == 0 {
				// A slow charge outlasts the client's attempt timeout: its
				// retries meet the key in progress, and it answers once its
				// client has gone.
				time.Sleep(150 * time.Millisecond)
			}
			// Long enough that a cut body and a partial read both bite. A
			// crashed server does not act (see soakInstance).
			receipt := fmt.Sprintf("receipt %d for %s;%s", run, op, strings.Repeat("x", 512))
			if err := inst.act(r, func() error { return effects.charge(r, op, receipt) }); err != nil {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, receipt)
		})
	}
	cluster := newSoakCluster(t, store, b.instances(), func(inst *soakInstance) *idemtest.Server {
		return idemtest.NewServer(charge(inst), idemtest.WithSeed(seed), idemtest.WithFaults(soakFaults),
			idemtest.WithStore(inst.store), idemtest.WithMiddleware(append(b.server(), cfg.server...)...))
	})
	defer cluster.close()

	var statusMu sync.Mutex
	statuses := map[int]int{} // attempts per status, 0 for errors
	sent := map[string]bool{} // operations with an attempt made
	countAttempt := func(a idemhttp.Attempt) {
		statusMu.Lock()
		statuses[a.StatusCode]++
		sent[a.Operation] = true
		statusMu.Unlock()
	}

	path := filepath.Join(t.TempDir(), "keys")
	var generation atomic.Int64
	newClient := func(ks idemhttp.KeyStore) *http.Client {
		gen := generation.Add(1)
		var n atomic.Int64
		return cluster.client(
			idemhttp.WithKeyStore(ks),
			idemhttp.WithMaxAttempts(3),
			idemhttp.WithBackoff(idemhttp.FullJitter(100*time.Microsecond, time.Millisecond)),
			idemhttp.WithBudget(nil),
			idemhttp.WithAttemptHook(countAttempt),
			idemhttp.WithoutBreaker(),
			idemhttp.WithAttemptTimeout(100*time.Millisecond),
			idemhttp.WithMaxRetryAfter(time.Millisecond),
			// Repeatable keys, so that a seed repeats its faults; the
			// generation keeps a restarted client's keys new.
			idemhttp.WithKeyGenerator(func() (string, error) {
				return fmt.Sprintf("s%d-g%d-%d", seed, gen, n.Add(1)), nil
			}),
		)
	}

	payments := make([]soakPayment, soakOps)
	opName := func(i int) string { return fmt.Sprintf("pay-%03d", i) }
	pay := func(client *http.Client, i int, mode readMode) {
		p := &payments[i]
		op := opName(i)
		if mode == readModes {
			mode = readMode(i % int(readModes))
		}
		ctx := t.Context()
		if cfg.deadline > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, cfg.deadline)
			defer cancel()
		}
		req, err := http.NewRequestWithContext(idemhttp.WithOperation(ctx, op),
			http.MethodPost, cluster.url+"/payments", strings.NewReader(op))
		if err != nil { // pay runs on a worker goroutine: no FailNow
			t.Error(err)
			return
		}
		resp, err := client.Do(req)
		if err != nil {
			p.status = 0
			return
		}
		p.status = resp.StatusCode
		var (
			got     []byte
			readErr error
		)
		switch mode {
		case readAll:
			got, readErr = io.ReadAll(resp.Body)
		case readPart:
			// Some prefixes end before the half a cut body brings, some
			// after, and some are the whole body.
			got, readErr = io.ReadAll(io.LimitReader(resp.Body, int64(16+(i*97)%600)))
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			return
		}
		p.seen = append(p.seen[:0], got...)
		p.whole = mode == readAll && readErr == nil
		p.final = readErr == nil
	}
	// runPass pays ops on cfg.workers goroutines; midway, if set, runs
	// once half of them have been handed out, with the rest in flight.
	runPass := func(client *http.Client, ops []int, mode readMode, midway func()) {
		work := make(chan int)
		var wg sync.WaitGroup
		for range cfg.workers {
			wg.Go(func() {
				for i := range work {
					pay(client, i, mode)
				}
			})
		}
		for n, i := range ops {
			if n == len(ops)/2 && midway != nil {
				midway()
			}
			work <- i
		}
		close(work)
		wg.Wait()
	}

	// The first client pays every payment once; with a restart, one
	// server crashes halfway through and another takes its place.
	ks, err := idemhttp.OpenFileKeyStore(path)
	require.NoError(t, err)
	client := newClient(ks)
	all := make([]int, soakOps)
	for i := range all {
		all[i] = i
	}
	var midway func()
	if b.shared {
		midway = cluster.restart
	}
	runPass(client, all, cfg.mode, midway)
	client.CloseIdleConnections()
	require.NoError(t, ks.Close())

	// Restarted clients resume what their key store lists as pending. A
	// call whose deadline came before its key was recorded sent nothing
	// and failed, and left nothing pending: its payer pays again.
	index := make(map[string]int, soakOps)
	for i := range soakOps {
		index[opName(i)] = i
	}
	rounds, resumed, last := 0, time.Now(), soakOps
	for ; ; rounds++ {
		ks, err := idemhttp.OpenFileKeyStore(path)
		require.NoError(t, err)
		pending, err := ks.Pending(t.Context())
		require.NoError(t, err)
		ops := make([]int, 0, len(pending))
		isPending := make(map[int]bool, len(pending))
		for _, p := range pending {
			i, ok := index[p.Operation]
			require.True(t, ok, "pending operation %q was never paid", p.Operation)
			ops = append(ops, i)
			isPending[i] = true
		}
		statusMu.Lock()
		for i := range soakOps {
			// A key is released only on an outcome, which takes an
			// attempt; one pending may have had none yet.
			if !payments[i].final && !sent[opName(i)] && !isPending[i] {
				ops = append(ops, i)
			}
		}
		statusMu.Unlock()
		if len(ops) == 0 || (rounds >= soakMaxRounds && time.Since(resumed) > soakResumeFor) {
			require.NoError(t, ks.Close())
			require.Empty(t, pending, "operations still pending after %d rounds", rounds)
			break
		}
		if len(ops) == last {
			// Nothing settled last round: the keys may be held by claims
			// of a crashed server until their leases end.
			time.Sleep(10 * time.Millisecond)
		}
		last = len(ops)
		client := newClient(ks)
		runPass(client, ops, cfg.mode, nil)
		client.CloseIdleConnections()
		require.NoError(t, ks.Close())
	}
	cluster.close() // lets every run end before the ledgers are read

	ok := cluster.assertExactlyOnce(t, soakOps)
	receipts := effects.receipts(t)
	for i := range soakOps {
		op, p := opName(i), payments[i]
		got := receipts[op]
		if !assert.Len(t, got, 1, "%s: receipts given (last status %d, 201 reached the payer: %t)", op, p.status, p.final) {
			ok = false
			continue
		}
		// Nothing is pending, so every payment's key was released: that
		// must have been on a 201 that reached the payer.
		if !assert.True(t, p.final, "%s: released without a 201 reaching the payer (last status %d)", op, p.status) {
			ok = false
			continue
		}
		if p.whole {
			ok = assert.Equal(t, got[0], string(p.seen), "%s: answer seen", op) && ok
		} else {
			ok = assert.True(t, bytes.HasPrefix([]byte(got[0]), p.seen), "%s: part seen %q is not a prefix of %q", op, p.seen, got[0]) && ok
		}
	}
	if !ok || testing.Verbose() {
		t.Logf("seed %d, %s over %s: %d resume rounds, %d claims lost in a crash, stats %+v, attempts by status %v",
			seed, cfg.name, b.name, rounds, cluster.lost(), cluster.stats(), statuses)
	}
}
