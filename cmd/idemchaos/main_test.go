package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestMain lets the test binary play the scenario's children: runScenario
// starts its own executable, the test binary, with roleEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) != "" {
		main()
		return
	}
	goleak.VerifyTestMain(m)
}

// chaos runs a scenario with args and returns its exit status and report.
func chaos(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	status := runScenario(context.Background(), args, &stdout, &stderr)
	t.Logf("idemchaos %q: exit %d\n%s%s", args, status, &stdout, &stderr)
	return status, stdout.String() + stderr.String()
}

// count returns the number on the report's line "name: N".
func count(t *testing.T, report, name string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + `: (\d+)$`).FindStringSubmatch(report)
	require.NotNil(t, m, "no line %q in the report", name+": N")
	n, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	return n
}

// TestShortScenario runs a short scenario through faults and client kills:
// every operation executes exactly once.
func TestShortScenario(t *testing.T) {
	dir := t.TempDir()
	status, report := chaos(t, "-ops", "80", "-workers", "4", "-client-kills", "2", "-faults", "0.3",
		"-seed", "7", "-dir", dir)
	assert.Equal(t, 0, status)
	assert.Equal(t, 0, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Equal(t, 80, count(t, report, "operations"))
	assert.Equal(t, 2, count(t, report, "client kills"))
	assert.Equal(t, 0, count(t, report, "server restarts"))
	assert.Equal(t, 7, count(t, report, "seed"))
	assert.GreaterOrEqual(t, count(t, report, "attempts"), 80)
	assert.Equal(t, 80, count(t, report, "replays checked at the end"))
	assert.Equal(t, 0, count(t, report, "wrong answers at the end"))
	assert.Equal(t, 0, count(t, report, "run again at the end"))
	// Every 201 whose body was cut was followed by a call under the same
	// key, answered by a replay.
	assert.Equal(t, 0, count(t, report, "new keys after cut bodies"))
	assert.Equal(t, count(t, report, "cut bodies called again"), count(t, report, "replays after cut bodies"))
	assert.Contains(t, report, "PASS: every operation took effect exactly once")

	// The ledger, kept by the server children, holds each operation once.
	ledger, err := readLines(filepath.Join(dir, "ledger"))
	require.NoError(t, err)
	assert.Len(t, ledger, 80)
}

// TestBrokenServerCaught runs the scenario against a server without the
// middleware: its retries execute again, and idemchaos must say so.
func TestBrokenServerCaught(t *testing.T) {
	status, report := chaos(t, "-"+unsafeFlag, "-ops", "50", "-workers", "4", "-client-kills", "0",
		"-faults", "0.5", "-seed", "3")
	assert.Equal(t, exitFailed, status)
	assert.Positive(t, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Regexp(t, `(?m)^duplicated operations: op-\d\d \(\d executions\)`, report)
	assert.Contains(t, report, "FAIL")
}

// TestForgetfulServerCaught runs the scenario against a server that forgets
// each outcome a moment after storing it. No retry comes after that moment
// during the run, without faults or kills, so only the operations sent
// again at the end can show it: each runs the handler again instead of
// being replayed, and the ledger counts that run as a duplicate.
func TestForgetfulServerCaught(t *testing.T) {
	status, report := chaos(t, "-"+unsafeTTLFlag, "1ms", "-ops", "20", "-workers", "4", "-client-kills", "0",
		"-faults", "0", "-seed", "3")
	assert.Equal(t, exitFailed, status)
	assert.Equal(t, 20, count(t, report, "replays checked at the end"))
	assert.Equal(t, 20, count(t, report, "run again at the end"))
	assert.Equal(t, 0, count(t, report, "wrong answers at the end"), "each run again answered the receipt")
	assert.Equal(t, 20, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Regexp(t, `(?m)^duplicated operations: op-01 \(run 1 more times by one server process\)`, report)
	assert.Regexp(t, `(?m)^operations whose handler ran again when sent again at the end: op-01, op-02, `, report)
	assert.Contains(t, report, "FAIL")
}

// TestEndCheckAnswers checks what the check at the end of a run makes of
// the server's answers: a replay of the receipt is right, a run of the
// handler again is left to the ledger to judge, anything else is wrong, and
// a claim still in progress is waited for.
func TestEndCheckAnswers(t *testing.T) {
	tests := []struct {
		name     string
		answer   func(w http.ResponseWriter, calls int)
		ranAgain bool
		wrong    string
	}{
		{"replay", func(w http.ResponseWriter, _ int) { answer(w, 201, true, receiptOf("op-1")) }, false, ""},
		{"run again", func(w http.ResponseWriter, _ int) { answer(w, 201, false, receiptOf("op-1")) }, true, ""},
		{"in progress, then replay", func(w http.ResponseWriter, calls int) {
			if calls < 3 {
				w.Header().Set("Retry-After", "1")
				answer(w, 409, false, "")
				return
			}
			answer(w, 201, true, receiptOf("op-1"))
		}, false, ""},
		{"another receipt", func(w http.ResponseWriter, _ int) { answer(w, 201, true, receiptOf("op-2")) }, false,
			`op-1 (body "{\"op\":\"op-2\",\"status\":\"paid\"}", want "{\"op\":\"op-1\",\"status\":\"paid\"}")`},
		{"another Content-Type", func(w http.ResponseWriter, _ int) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			answer(w, 201, true, receiptOf("op-1"))
		}, false, `op-1 (Content-Type "text/plain; charset=utf-8", want "application/json")`},
		{"refused", func(w http.ResponseWriter, _ int) { answer(w, 422, false, "") }, false, "op-1 (status 422)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			calls := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls++
				assert.Equal(t, "k1", r.Header.Get(idemserver.DefaultKeyHeader))
				assert.Equal(t, "/pay/op-1", r.URL.Path)
				tt.answer(w, calls)
			}))
			defer srv.Close()
			path := filepath.Join(t.TempDir(), "log")
			require.NoError(t, os.WriteFile(path, []byte("done op-1 201 false k1\ndone op-2 201 false\n"), 0o644))
			res, err := checkRun(t.Context(), path, srv.URL, 2)
			require.NoError(t, err)
			assert.Equal(t, 1, res.checked)
			want := []string{"op-2 (no key recorded)"}
			if tt.wrong != "" {
				want = append([]string{tt.wrong}, want...)
			}
			assert.Equal(t, want, res.wrong)
			assert.Equal(t, tt.ranAgain, len(res.ranAgain) == 1)
		})
	}
}

func answer(w http.ResponseWriter, status int, replayed bool, body string) {
	if w.Header().Get("Content-Type") == "" {
		w.Header().Set("Content-Type", receiptType)
	}
	if replayed {
		w.Header().Set(idemserver.ReplayedHeader, "true")
	}
	w.WriteHeader(status)
	_, _ = io.WriteString(w, body)
}

// TestLastKeys checks which key the end-of-run check sends for each
// operation: the one it was last answered 201 with.
func TestLastKeys(t *testing.T) {
	log := [][]string{
		{"done", "op-1", "201", "false", "k1"},
		{"done", "op-1", "201", "true", "k1b"}, // driven again after a kill
		{"done", "op-2", "409", "false", "k2"}, // refused: reported as such
		{"done", "op-3", "201", "false"},       // no key recorded
		{"done", "op-4", "201", "false", noKey},
		{"done", "op-5", "201", "false", noKey},
		{"done", "op-5", "201", "true", "k5"},
		{"wrong", "op-1"},
	}
	keys, keyless := lastKeys(log)
	assert.Equal(t, map[string]string{"op-1": "k1b", "op-5": "k5"}, keys)
	assert.Equal(t, []string{"op-3", "op-4"}, keyless)
}

func TestBadFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"-server-restarts", "1"}, "-server-restarts 1 needs a persistent store: the memory store"},
		{[]string{"-store", "postgres", "-dsn", ""}, "-store postgres needs a database: pass -dsn or set IDEMHTTP_POSTGRES_DSN"},
		{[]string{"-store", "postgres-tx", "-dsn", ""}, "-store postgres-tx needs a database"},
		{[]string{"-store", "redis", "-redis", ""}, "-store redis needs a server: pass -redis host:port or set IDEMHTTP_TEST_REDIS_ADDR"},
		{[]string{"-store", "postgres-tx", "-dsn", "postgres://x", "-" + unsafeFlag}, "-unsafe-no-middleware: the postgres-tx handler writes in the claim's transaction"},
		{[]string{"-store", "postgres", "-dsn", "postgres://127.0.0.1:1/x", "-ops", "1"}, "PostgreSQL at 127.0.0.1:1"},
		{[]string{"-store", "redis", "-redis", "127.0.0.1:1", "-ops", "1"}, "no answer from Redis at 127.0.0.1:1"},
		{[]string{"-store", "sqlite"}, `unknown -store "sqlite": want memory, postgres, postgres-tx or redis`},
		{[]string{"-ops", "0"}, "-ops 0: need at least one operation"},
		{[]string{"-workers", "0"}, "-workers 0: need at least one"},
		{[]string{"-client-kills", "-1"}, "cannot be negative"},
		{[]string{"-faults", "1.5"}, "-faults 1.5: want a share in [0, 1]"},
		{[]string{"-timeout", "0s"}, "-timeout 0s: want a positive duration"},
		{[]string{"extra"}, `unexpected arguments: ["extra"]`},
		{[]string{"-nope"}, "flag provided but not defined: -nope"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.args), func(t *testing.T) {
			status, out := chaos(t, tt.args...)
			assert.Equal(t, exitError, status)
			assert.Contains(t, out, tt.want)
			assert.NotContains(t, out, "duplicates:", "nothing ran")
		})
	}
}

func TestUsageHidesUnsafeFlag(t *testing.T) {
	status, out := chaos(t, "-h")
	assert.Equal(t, 0, status)
	assert.Contains(t, out, "-client-kills")
	assert.NotContains(t, out, unsafeFlag)
}

// TestReportReadsLedger checks the verdict on ledgers and client logs
// written by hand, a line torn by a crash included.
func TestReportReadsLedger(t *testing.T) {
	dir := t.TempDir()
	f := files{ledger: filepath.Join(dir, "ledger"), clientLog: filepath.Join(dir, "log")}
	require.NoError(t, os.WriteFile(f.ledger, []byte(
		"charged op-1 d1 0\n"+
			"charged op-2 d2 0\ncharged op-2 d3 1\n"+ // two keys for one operation
			"charged op-9 d9 0\n"+
			"charged op-6 d6 0\nrepeated op-6 d6 1\nrepeated op-6 d6 3\n"+ // again after two kills
			"charged op-7 d7 2\nrepeated op-7 d7 2\n"+ // again by the same server
			"charged op-8 d8 1\nunsettled op-8 d8 1\nrepeated op-8 d8 1\n"+ // again after its claim was left in progress
			"charged op-3 d4 0"), 0o644))
	require.NoError(t, os.WriteFile(f.clientLog, []byte(
		"done op-1 201 false\ndone op-2 201 true\ndone op-3 201 false\ndone op-4 409 false\n"+
			"done op-6 201 false\ndone op-7 201 false\ndone op-8 201 false\ndone op-1 201 true\nwrong op-1\n"+
			"wrong op-1\ndone op-5 201"), 0o644))
	r := &report{scenario: &scenario{ops: 8, spec: storeSpec{name: "postgres"}}}
	require.NoError(t, r.read(f, nil))
	assert.Equal(t, map[string]int{"op-1": 1, "op-2": 2, "op-3": 0, "op-4": 0, "op-5": 0, "op-6": 1, "op-7": 1, "op-8": 1},
		r.executions)
	assert.Equal(t, []string{"op-2 (2 executions)", "op-7 (run 1 more times by one server process)"}, r.duplicated)
	assert.Equal(t, 2, r.reexecuted)                          // op-6's, each by a later server
	assert.Equal(t, 1, r.unsettledRuns)                       // op-8's
	assert.Equal(t, []string{"op-3", "op-4", "op-5"}, r.lost) // op-3's line was torn
	assert.Equal(t, []string{"op-5"}, r.unfinished)           // so was op-5's
	assert.Equal(t, []string{"op-4 (409)"}, r.refused)
	assert.Equal(t, []string{"op-9"}, r.strangers)
	assert.Equal(t, []string{"op-1"}, r.wrong)
	assert.Equal(t, 2, r.replaysReceived)
	assert.True(t, r.failed())

	var out bytes.Buffer
	r.print(&out)
	assert.Contains(t, out.String(), "\nduplicates: 2\n")
	assert.Contains(t, out.String(), "\nlost: 3\n")
	assert.Contains(t, out.String(), "\nwrong answers: 1\n")
	assert.Contains(t, out.String(), "\noperations answered 201 with a body other than their receipt: op-1\n")
	assert.Contains(t, out.String(), "\nre-executions after server kills: 2\n")
	assert.Contains(t, out.String(), "\nre-executions after claims left in progress: 1\n")
	assert.Contains(t, out.String(), "\nduplicated operations: op-2 (2 executions), op-7 (run 1 more times by one server process)\n")
	assert.Contains(t, out.String(), "\nlost operations (never executed): op-3, op-4, op-5\n")
}

// TestReportReadsPaymentsTable checks the verdict of a postgres-tx run,
// whose ledger is the payments table and whose ledger file notes the
// handler's runs.
func TestReportReadsPaymentsTable(t *testing.T) {
	dir := t.TempDir()
	f := files{ledger: filepath.Join(dir, "ledger"), clientLog: filepath.Join(dir, "log")}
	require.NoError(t, os.WriteFile(f.ledger, []byte(
		"ran op-1 k1 0\nran op-2 k2 0\nran op-2 k2 1\nran op-3 k3 1\nran op-3 k3 1\n"), 0o644))
	require.NoError(t, os.WriteFile(f.clientLog, []byte(
		"done op-1 201 false\ndone op-2 201 false\ndone op-3 201 true\n"), 0o644))
	payments := []entry{
		{kind: kindCharged, op: "op-1", key: "k1"},
		{kind: kindCharged, op: "op-2", key: "k2", server: 1}, // the run by server 0 rolled back
		{kind: kindCharged, op: "op-3", key: "k3", server: 1},
		{kind: kindCharged, op: "op-3", key: "k3", server: 1},
	}
	r := &report{scenario: &scenario{ops: 3, spec: storeSpec{name: "postgres-tx"}}}
	require.NoError(t, r.read(f, payments))
	assert.Equal(t, map[string]int{"op-1": 1, "op-2": 1, "op-3": 2}, r.executions)
	assert.Equal(t, []string{"op-3 (2 executions)"}, r.duplicated)
	assert.Empty(t, r.lost)
	assert.Equal(t, 1, r.rolledBack)
	var out bytes.Buffer
	r.print(&out)
	assert.Contains(t, out.String(), "\nhandler runs rolled back: 1\n")
	assert.NotContains(t, out.String(), "re-executions")

	// A ledger line of the other kind of store is refused.
	require.NoError(t, os.WriteFile(f.ledger, []byte("charged op-1 d1 0\n"), 0o644))
	r = &report{scenario: &scenario{ops: 3, spec: storeSpec{name: "postgres-tx"}}}
	assert.ErrorContains(t, r.read(f, payments), `ledger: line "charged op-1 d1 0" does not belong to store postgres-tx`)
}

// TestObserver checks which of the middleware's events the server records
// as claims left in progress (those after which a retry runs the handler
// again in the same server process), and which as outcomes the store kept
// (after which no server may run it again).
func TestObserver(t *testing.T) {
	key := idemserver.Key{Key: "k1"}
	tests := []struct {
		name string
		ev   idemserver.Event
		want string // the kind of entry recorded; empty for none
	}{
		{"executed and stored", idemserver.Event{Outcome: idemserver.OutcomeExecuted, Status: 201}, kindKept},
		{"executed, not stored", idemserver.Event{Outcome: idemserver.OutcomeExecuted, Status: 201,
			Err: errors.New("store down")}, kindUnsettled},
		{"lease lost at completion", idemserver.Event{Outcome: idemserver.OutcomeUnavailable, Status: 503,
			Err: fmt.Errorf("complete: %w", idemserver.ErrLeaseLost)}, kindUnsettled},
		{"released", idemserver.Event{Outcome: idemserver.OutcomeReleased, Status: 500}, ""},
		{"store unavailable", idemserver.Event{Outcome: idemserver.OutcomeUnavailable, Status: 503,
			Err: errors.New("store down")}, ""},
		{"replayed", idemserver.Event{Outcome: idemserver.OutcomeReplayed, Status: 201}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ledger")
			p, err := openProvider(path, 3)
			require.NoError(t, err)
			r := httptest.NewRequest(http.MethodPost, "/pay/op-1", nil)
			r.SetPathValue("op", "op-1")
			tt.ev.Request, tt.ev.Key = r, key
			observe(p)(tt.ev)
			require.NoError(t, p.Close())
			lines, err := readLines(path)
			require.NoError(t, err)
			kept, err := readLines(keptPath(path))
			require.NoError(t, err)
			want := [][]string{{tt.want, "op-1", key.Derive("charge"), "3"}}
			switch tt.want {
			case "":
				assert.Empty(t, lines)
				assert.Empty(t, kept)
			case kindKept:
				assert.Empty(t, lines, "kept entries stay out of the ledger the scenario watches")
				assert.Equal(t, want, kept)
			default:
				assert.Equal(t, want, lines)
				assert.Empty(t, kept)
			}
		})
	}
}

// TestReportForgottenKey checks that a run by a later server for a charge
// whose outcome an earlier server had kept is a duplicate: the store forgot
// a completed key. A run after a server that was killed before it kept the
// outcome is the takeover lease mode allows.
func TestReportForgottenKey(t *testing.T) {
	dir := t.TempDir()
	f := files{ledger: filepath.Join(dir, "ledger"), clientLog: filepath.Join(dir, "log")}
	require.NoError(t, os.WriteFile(f.ledger, []byte(
		"charged op-1 d1 0\nrepeated op-1 d1 1\n"+ // server 0 was killed before keeping the outcome
			"charged op-2 d2 0\nrepeated op-2 d2 1\nrepeated op-2 d2 2\n"), 0o644)) // server 1 kept it
	require.NoError(t, os.WriteFile(keptPath(f.ledger), []byte(
		"kept op-1 d1 1\nkept op-2 d2 1\nkept op-2 d2 2\n"), 0o644))
	require.NoError(t, os.WriteFile(f.clientLog, []byte("done op-1 201 false\ndone op-2 201 true\n"), 0o644))
	r := &report{scenario: &scenario{ops: 2, spec: storeSpec{name: "redis"}}}
	require.NoError(t, r.read(f, nil))
	assert.Equal(t, 2, r.reexecuted) // op-1's by server 1, op-2's by server 1
	assert.Equal(t, []string{"op-2 (run 1 more times by a later server after its outcome was kept)"}, r.duplicated)
	assert.True(t, r.failed())

	require.NoError(t, os.WriteFile(keptPath(f.ledger), []byte("kept op-2 d2 x\n"), 0o644))
	assert.ErrorContains(t, (&report{scenario: r.scenario}).read(f, nil), `unexpected kept line "kept op-2 d2 x"`)
}

// TestWorkerChecksTheAnswer checks that the client worker records an
// operation answered 201 with a body other than its receipt, such as a
// replay of another answer, which the report then counts as wrong.
func TestWorkerChecksTheAnswer(t *testing.T) {
	for _, tt := range []struct {
		name, body, contentType string // no Content-Type: net/http sniffs one
		wrong                   bool
	}{
		{"receipt", receiptOf("op-1"), receiptType, false},
		{"another operation's receipt", receiptOf("op-2"), receiptType, true},
		{"empty", "", receiptType, true},
		{"receipt and more", receiptOf("op-1") + " ", receiptType, true},
		{"receipt without its Content-Type", receiptOf("op-1"), "", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tt.contentType != "" {
					w.Header().Set("Content-Type", tt.contentType)
				}
				w.Header().Set(idemserver.ReplayedHeader, "true")
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, tt.body)
			}))
			defer srv.Close()
			path := filepath.Join(t.TempDir(), "log")
			log, err := openLineLog(path)
			require.NoError(t, err)
			defer log.Close()
			w := &worker{client: srv.Client(), log: log, url: srv.URL}
			require.NoError(t, w.complete(t.Context(), "op-1"))

			lines, err := readLines(path)
			require.NoError(t, err)
			want := [][]string{{"done", "op-1", "201", "true", noKey}} // a client without idemhttp sends no key
			if tt.wrong {
				want = append(want, []string{"wrong", "op-1"})
			}
			assert.Equal(t, want, lines)
			r := &report{scenario: &scenario{ops: 1, spec: storeSpec{name: "memory"}}}
			require.NoError(t, r.read(files{ledger: filepath.Join(t.TempDir(), "none"), clientLog: path}, nil))
			assert.Equal(t, tt.wrong, len(r.wrong) == 1)
		})
	}
}

// TestForgetfulClientCaught runs the scenario with a client that keeps its
// pending keys in memory: the worker started after a kill sends the
// payments its predecessor had in flight again, with new keys, and those
// the server had already charged are charged twice. idemchaos must say so,
// which shows that the client kills land between a payment the server
// made and the client's record of it.
func TestForgetfulClientCaught(t *testing.T) {
	status, report := chaos(t, "-"+unsafeForgetKeysFlag, "-ops", "60", "-workers", "4", "-client-kills", "2",
		"-faults", "0", "-seed", "5")
	assert.Equal(t, exitFailed, status)
	assert.Equal(t, 2, count(t, report, "client kills"))
	assert.Positive(t, count(t, report, "duplicates"))
	assert.Regexp(t, `(?m)^duplicated operations: op-\d\d \([2-9] executions\)`, report)
	assert.Contains(t, report, "FAIL")
}

// TestTooFewKillsIncomplete runs a scenario that cannot make the client
// kills it asks for: one operation is done before the second kill could
// land on a worker that has made progress since the first. The run proves
// nothing about kills it did not make, so it must not pass: it reports
// INCOMPLETE, naming what was asked and what was done, and exits with
// exitIncomplete rather than 0 (or exitFailed, which is for duplicates and
// lost payments).
func TestTooFewKillsIncomplete(t *testing.T) {
	status, report := chaos(t, "-ops", "1", "-workers", "1", "-client-kills", "2", "-faults", "0", "-seed", "9")
	assert.Equal(t, exitIncomplete, status)
	assert.Less(t, count(t, report, "client kills"), 2)
	assert.Equal(t, 0, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	assert.Regexp(t, `(?m)^INCOMPLETE: asked for 2 client kills and 0 server restarts, made [01] client kills? and 0 server restarts`, report)
	assert.NotContains(t, report, "PASS")
}

// TestReportIncomplete checks the verdict on runs that made fewer kills or
// restarts than asked: INCOMPLETE with exitIncomplete, unless the run
// failed, which a shortfall does not hide.
func TestReportIncomplete(t *testing.T) {
	for _, tt := range []struct {
		name                       string
		kills, restarts, made, ran int
		lost                       []string
		status                     int
		line                       string
	}{
		{"all made", 2, 2, 2, 2, nil, 0, "PASS: every operation took effect exactly once"},
		{"more made", 1, 0, 3, 0, nil, 0, "PASS: every operation took effect exactly once"},
		{"kills short", 2, 2, 1, 2, nil, exitIncomplete,
			"INCOMPLETE: asked for 2 client kills and 2 server restarts, made 1 client kill and 2 server restarts"},
		{"restarts short", 2, 2, 2, 0, nil, exitIncomplete,
			"INCOMPLETE: asked for 2 client kills and 2 server restarts, made 2 client kills and 0 server restarts"},
		{"short and failed", 2, 2, 0, 0, []string{"op-1"}, exitFailed, "FAIL"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := &report{scenario: &scenario{ops: 1, clientKills: tt.kills, serverRestarts: tt.restarts},
				clientKills: tt.made, serverRestarts: tt.ran, lost: tt.lost}
			var out bytes.Buffer
			r.print(&out)
			assert.Equal(t, tt.status, r.status())
			assert.Contains(t, out.String(), tt.line)
			if tt.status == exitFailed {
				assert.Contains(t, out.String(), "INCOMPLETE: asked for 2 client kills and 2 server restarts, made 0 client kills and 0 server restarts")
			}
		})
	}
}

// TestEarlyReleaseCaught runs the scenario with a client that releases an
// operation's key as soon as the header of a 2xx has arrived, before the
// body was read to its end. Only a response whose body is cut in transit,
// after the server stored its outcome, shows that: the client must call
// the operation again, and its key must still be pending so that the call
// is answered by a replay. With the key released the call goes out with a
// new key and pays again, and idemchaos must say so.
func TestEarlyReleaseCaught(t *testing.T) {
	status, report := chaos(t, "-"+unsafeReleaseOnHeadersFlag, "-ops", "150", "-workers", "8",
		"-client-kills", "0", "-faults", "0.5", "-seed", "13")
	assert.Equal(t, exitFailed, status)
	assert.Positive(t, count(t, report, "duplicates"))
	assert.Equal(t, 0, count(t, report, "lost"))
	// An operation whose second answer was cut too is paid a third time.
	assert.Regexp(t, `(?m)^duplicated operations: op-\d+ \([2-9] executions\)`, report)
	assert.Positive(t, count(t, report, "new keys after cut bodies"))
	assert.Regexp(t, `(?m)^operations called again with a new key after a cut body .*: op-\d+`, report)
	assert.Contains(t, report, "FAIL")
}
