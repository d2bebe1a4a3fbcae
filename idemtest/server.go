package idemtest

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// A Server is an httptest server that serves a handler behind
// idemserver.Middleware, a ledger of the handler's executions and a fault
// injector; see the package documentation for the model.
type Server struct {
	// URL is the base URL of the server, of the form http://ipaddr:port,
	// with no trailing slash.
	URL string

	ts       *httptest.Server
	injector *injector
	ledger   *ledger
	seed     int64
	header   string
	ownStore *idemserver.MemoryStore // made here, closed by Close

	done      chan struct{}
	closeOnce sync.Once
}

// NewServer starts and returns a Server that serves h behind the
// middleware, the ledger and the fault injector. The caller must Close it.
// NewServer panics, like httptest.NewServer, if it cannot listen, if the
// faults set by [WithFaults] are invalid ([ErrInvalidFaults]), and, as
// idemserver.WithKeyHeader does, if the name set by [WithKeyHeader] is not
// a header field name.
func NewServer(h http.Handler, opts ...Option) *Server {
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	if err := cfg.faults.validate(); err != nil {
		panic(err)
	}
	if !cfg.seeded {
		cfg.seed = rand.Int64()
	}
	if cfg.header == "" {
		cfg.header = idemserver.DefaultKeyHeader
	}
	s := &Server{seed: cfg.seed, header: cfg.header, done: make(chan struct{})}
	store := cfg.store
	if store == nil {
		s.ownStore = idemserver.NewMemoryStore()
		store = s.ownStore
	}
	holder, ok := store.(idemserver.ResponseHolder)
	s.ledger = newLedger(h, cfg.header, ok && holder.HoldResponses())
	mw := idemserver.Middleware(watchStore(store, s.ledger), append(cfg.middleware, idemserver.WithKeyHeader(cfg.header))...)
	s.injector = newInjector(mw(s.ledger), cfg.faults, cfg.seed, cfg.header, s.done, s.ledger.checkReplay)
	s.ts = httptest.NewServer(s.injector)
	s.URL = s.ts.URL
	return s
}

// Seed returns the seed the server's faults are drawn from.
func (s *Server) Seed() int64 { return s.seed }

// Client returns an http.Client whose Transport is an idemhttp.Transport,
// configured by opts, over a base transport that reaches the server. The
// server closes the base transport's idle connections when it closes.
//
// The client has idemhttp's defaults, with their retry budget and circuit
// breaker; a test that injects many faults may want more attempts, and one
// that injects stalls needs idemhttp.WithAttemptTimeout, or a stalled
// attempt lasts as long as the request's context.
func (s *Server) Client(opts ...idemhttp.Option) *http.Client {
	opts = append([]idemhttp.Option{idemhttp.WithKeyHeader(s.header)}, opts...)
	return &http.Client{Transport: idemhttp.NewTransport(s.ts.Client().Transport, opts...)}
}

// Executions returns how many times the handler executed, per idempotency
// key: the runs that ended with an outcome the middleware keeps (see the
// package documentation). With a scope (idemserver.WithScope) the entries
// are per scope and key, named by the quoted scope, a space and the key,
// since the same key in two scopes names two operations. Requests without
// a key are not counted, nor are runs that have not ended yet. The map is
// a copy.
func (s *Server) Executions() map[string]int { return s.ledger.executions() }

// Duplicates returns the entries of [Server.Executions] that the handler
// executed more than once, sorted. It is empty when the server kept its
// promise.
func (s *Server) Duplicates() []string { return s.ledger.duplicates() }

// WrongReplays describes the responses the middleware replayed that are
// not an answer the handler gave for their key and the middleware keeps: a
// replay of a stored 200 for a run that answered nothing once its client
// had gone, or one whose status, body or header fields (those the
// middleware keeps, but Set-Cookie) differ from the first answer. It
// is empty when every retry got the first answer. Replays for keys the
// handler never ran for here (records made by another server that shares
// the store) are not checked.
func (s *Server) WrongReplays() []string { return s.ledger.wrongReplays() }

// Stats returns the counts of what the fault injector did.
func (s *Server) Stats() Stats { return s.injector.snapshot() }

// AssertExactlyOnce checks that the handler executed exactly operations
// keys, each once: no key twice (a duplicate execution), and no more keys
// than operations (an operation sent with a second key) nor fewer (an
// operation never executed); and that every replay was the first answer
// (see [Server.WrongReplays]), so that no client was told of an outcome
// the handler never gave; and that the handler ran for no request of a
// method that is not idempotent (POST, PATCH, ...) without a key, since
// such a run, which no key counts, may be an operation's retry sent
// without its key. On failure it reports, through t.Errorf, the
// offending keys and the seed, and returns false.
//
// The ledger knows keys, not operations: an operation sent with two keys
// and another never executed leave as many keys as operations, and pass.
// A test that can fail an operation (one whose errors it does not stop on)
// should also check that every operation succeeded, or compare
// [Server.Executions] with the keys its client sent.
//
// A run of the handler is counted when it ends, so the assertion also
// fails while a run is still going (a run whose client gave up, say): it
// could yet be a duplicate. Close waits for such runs.
func (s *Server) AssertExactlyOnce(t testing.TB, operations int) bool {
	t.Helper()
	// One reading of the ledger: a run that ends between two readings
	// would be in progress in neither and a duplicate in neither.
	v := s.ledger.view()
	runs := v.runs
	var problems []string
	if dups := v.duplicates; len(dups) > 0 {
		parts := make([]string, len(dups))
		for i, k := range dups {
			parts[i] = fmt.Sprintf("%s (%d executions)", k, runs[k])
		}
		problems = append(problems, fmt.Sprintf("%d keys executed more than once: %s",
			len(dups), strings.Join(parts, ", ")))
	}
	if wrong := v.wrong; len(wrong) > 0 {
		problems = append(problems, fmt.Sprintf("%d replays were not the handler's answer: %s",
			len(wrong), strings.Join(wrong, ", ")))
	}
	// A run without a key is no key's execution, and nothing deduplicates
	// it: it may be an operation's retry sent without the operation's key.
	if n := v.unkeyedRuns; n > 0 {
		problems = append(problems, fmt.Sprintf("%d runs of the handler for requests without an idempotency key, which nothing deduplicates: %s",
			n, strings.Join(v.unkeyed, ", ")))
	}
	// A run is counted when it ends. One still going, such as a run whose
	// client gave up, may yet be a duplicate or a key too many: until it
	// ends the ledger proves nothing.
	if keys, n := v.running, v.runningRuns; n > 0 {
		what := "runs"
		if n == 1 {
			what = "run"
		}
		problems = append(problems, fmt.Sprintf("%d %s of the handler still in progress: %s (their executions are not counted yet; let them end, as Close does, before asserting)",
			n, what, strings.Join(keys, ", ")))
	}
	if len(runs) != operations {
		problems = append(problems, fmt.Sprintf("%d keys executed, want one for each of %d operations",
			len(runs), operations))
	}
	if len(problems) == 0 {
		return true
	}
	t.Errorf("idemtest: not exactly once (seed %d): %s", s.seed, strings.Join(problems, "; "))
	return false
}

// Close ends the injected stalls and delays, waits for the requests being
// served to finish, shuts the server down and closes the store it made.
// Close is idempotent.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.done)
		s.ts.Close()
		s.injector.close()
		if s.ownStore != nil {
			_ = s.ownStore.Close()
		}
	})
}
