package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/idemhttp/idemhttp/idemtest"
)

// report is the outcome of a run.
type report struct {
	scenario                    *scenario
	clientKills, serverRestarts int
	proxy                       idemtest.Stats
	wall                        time.Duration

	// executions counts the payments made per operation of the scenario:
	// the charges in the ledger, or with postgres-tx the rows of the
	// payments table.
	executions map[string]int
	// duplicated lists the operations paid more than once, or whose
	// handler one server process ran more than once (which the middleware
	// must prevent, whatever the provider then did); lost those paid
	// never; unfinished those the client never recorded done; refused
	// those whose final status was not 201; wrong those answered 201
	// with a body other than their receipt (a replay of another answer);
	// and strangers the operations in the ledger that the scenario does
	// not have.
	duplicated, lost, unfinished, refused, wrong, strangers []string
	// reexecuted counts the handler's runs for a payment already charged,
	// each by a later server process than the run before it, no earlier
	// server having kept the outcome: after a server kill between the
	// charge and the stored response, the lease ended and a retry took the
	// claim over. A run after an earlier server kept the outcome found the
	// key forgotten, and is a duplicate. unsettledRuns counts those by
	// the same server process after the middleware reported the claim
	// left in progress (the store failed to keep the outcome, or the lease
	// was lost). The provider deduplicated both by the derived key.
	// Lease-mode stores only.
	reexecuted, unsettledRuns int
	// rolledBack counts, with postgres-tx, the handler's runs whose
	// transaction never committed (the server was killed inside it).
	rolledBack      int
	replaysReceived int
	// cuts counts the 201s whose body the client could not read to its
	// end, each followed by a call of the operation again; cutReplays the
	// answers to those calls marked as replays. newKeyAfterCut lists the
	// operations answered, after a cut, under another key than the cut
	// response's: the client released the key before it had read the body.
	cuts, cutReplays int
	newKeyAfterCut   []string
	// cutUnanswered lists the operations whose last cut response was
	// never followed by an answer: the worker was killed before it called
	// again, and its successor did not drive the operation, so its key was
	// no longer pending though its body had not been read.
	cutUnanswered []string
	// end is the check that sends every operation again at the end of the
	// run, with the key it completed with (see replaycheck.go).
	end endCheck
}

// read checks the ledger and the client log against the operations. With
// postgres-tx, payments are the payments table's rows, which are the
// ledger, and the ledger file only notes the handler's runs.
func (r *report) read(f files, payments []entry) error {
	ops := operations(r.scenario.ops)
	r.executions = make(map[string]int, len(ops))
	for _, op := range ops {
		r.executions[op] = 0
	}
	lines, err := readLines(f.ledger)
	if err != nil {
		return err
	}
	effects := payments
	runs := 0
	for _, l := range lines {
		e, err := parseEntry(l)
		if err != nil {
			return err
		}
		switch tx := r.scenario.spec.transactional(); {
		case tx && e.kind == kindRan:
			runs++
		case !tx && e.kind != kindRan:
			effects = append(effects, e)
		default:
			return fmt.Errorf("ledger: line %q does not belong to store %s", strings.Join(l, " "), r.scenario.spec.name)
		}
	}
	r.rolledBack = max(runs-len(payments), 0)
	kept, err := readLines(keptPath(f.ledger))
	if err != nil {
		return err
	}
	keptBy := make(map[string]int) // the first server that kept each charge key's outcome
	for _, l := range kept {
		e, err := parseEntry(l)
		if err != nil || e.kind != kindKept {
			return fmt.Errorf("ledger: unexpected kept line %q", strings.Join(l, " "))
		}
		if s, ok := keptBy[e.key]; !ok || e.server < s {
			keptBy[e.key] = e.server
		}
	}
	lastServer := make(map[string]int) // of each operation's last run
	unsettled := make(map[string]bool) // since the operation's last run
	againByOne := make(map[string]int) // runs again by the same process
	forgotten := make(map[string]int)  // runs again after an earlier server kept the outcome
	for _, e := range effects {
		if _, ok := r.executions[e.op]; !ok {
			r.strangers = append(r.strangers, e.op)
			continue
		}
		switch e.kind {
		case kindUnsettled:
			unsettled[e.op] = true
			continue
		case kindCharged:
			r.executions[e.op]++
		case kindRepeated:
			switch last, ok := lastServer[e.op]; {
			case ok && e.server > last:
				if s, kept := keptBy[e.key]; kept && s < e.server {
					forgotten[e.op]++
					break
				}
				r.reexecuted++
			case unsettled[e.op]:
				r.unsettledRuns++
			default:
				againByOne[e.op]++
			}
		}
		lastServer[e.op] = e.server
		unsettled[e.op] = false
	}
	log, err := readLines(f.clientLog)
	if err != nil {
		return err
	}
	done := make(map[string]bool)
	cutKey := make(map[string]string) // of each operation's last cut response
	for _, l := range log {
		switch {
		case l[0] == "wrong" && len(l) == 2:
			r.wrong = append(r.wrong, l[1])
			continue
		case l[0] == "cut" && len(l) == 3:
			r.cuts++
			cutKey[l[1]] = l[2]
			continue
		case l[0] != "done" || len(l) < 4:
			return fmt.Errorf("client log: unexpected line %q", strings.Join(l, " "))
		}
		if k, ok := cutKey[l[1]]; ok {
			delete(cutKey, l[1])
			if l[3] == "true" {
				r.cutReplays++
			}
			if len(l) < 5 || l[4] != k {
				r.newKeyAfterCut = append(r.newKeyAfterCut, l[1])
			}
		}
		done[l[1]] = true
		if l[2] != "201" {
			r.refused = append(r.refused, l[1]+" ("+l[2]+")")
		}
		if l[3] == "true" {
			r.replaysReceived++
		}
	}
	for op := range cutKey {
		r.cutUnanswered = append(r.cutUnanswered, op)
	}
	for _, op := range ops {
		var why []string
		switch n := r.executions[op]; {
		case n == 0:
			r.lost = append(r.lost, op)
		case n > 1:
			why = append(why, fmt.Sprintf("%d executions", n))
		}
		if n := againByOne[op]; n > 0 {
			why = append(why, fmt.Sprintf("run %d more times by one server process", n))
		}
		if n := forgotten[op]; n > 0 {
			why = append(why, fmt.Sprintf("run %d more times by a later server after its outcome was kept", n))
		}
		if len(why) > 0 {
			r.duplicated = append(r.duplicated, op+" ("+strings.Join(why, ", ")+")")
		}
		if !done[op] {
			r.unfinished = append(r.unfinished, op)
		}
	}
	slices.Sort(r.strangers)
	slices.Sort(r.refused)
	slices.Sort(r.wrong)
	r.wrong = slices.Compact(r.wrong)
	slices.Sort(r.newKeyAfterCut)
	r.newKeyAfterCut = slices.Compact(r.newKeyAfterCut)
	slices.Sort(r.cutUnanswered)
	return nil
}

// failed reports whether the run broke the promise or did not finish.
func (r *report) failed() bool {
	return len(r.duplicated)+len(r.lost)+len(r.unfinished)+len(r.refused)+len(r.wrong)+len(r.strangers)+
		len(r.end.wrong)+len(r.newKeyAfterCut)+len(r.cutUnanswered) > 0
}

// incomplete reports whether the run made fewer client kills or server
// restarts than asked: it then proves nothing about the ones it did not
// make, whatever its ledger shows.
func (r *report) incomplete() bool {
	return r.clientKills < r.scenario.clientKills || r.serverRestarts < r.scenario.serverRestarts
}

// status returns the run's exit status: a failure first, since a run cut
// short does not excuse a duplicate, then a run that fell short.
func (r *report) status() int {
	switch {
	case r.failed():
		return exitFailed
	case r.incomplete():
		return exitIncomplete
	}
	return 0
}

// plural returns "n what", with an s when n is not 1.
func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func (r *report) print(w io.Writer) {
	sc := r.scenario
	p := r.proxy
	store := sc.spec.name
	switch {
	case sc.spec.name == "redis":
		store += " (key prefix " + sc.spec.redisPrefix() + ", deleted)"
	case sc.spec.persistent():
		store += " (schema " + sc.spec.space + ", dropped)"
	}
	fmt.Fprintf(w, "idemchaos: store %s, %d workers, faults %g, seed %d\n", store, sc.workers, sc.faults, sc.seed)
	fmt.Fprintf(w, "operations: %d\n", sc.ops)
	fmt.Fprintf(w, "attempts: %d\n", p.Requests)
	fmt.Fprintf(w, "retries: %d\n", p.Requests-sc.ops)
	fmt.Fprintf(w, "replays served: %d\n", p.Replayed)
	fmt.Fprintf(w, "replays received: %d\n", r.replaysReceived)
	fmt.Fprintf(w, "faults injected: %d resets before the server, %d responses lost, %d bodies cut, %d 503, %d 429, "+
		"%d stalls; %d delayed\n",
		p.ResetBefore, p.LostResponses, p.CutBodies, p.Unavailable, p.TooManyRequests, p.Stalled, p.Delayed)
	fmt.Fprintf(w, "cut bodies called again: %d\n", r.cuts)
	fmt.Fprintf(w, "replays after cut bodies: %d\n", r.cutReplays)
	fmt.Fprintf(w, "new keys after cut bodies: %d\n", len(r.newKeyAfterCut))
	fmt.Fprintf(w, "cut bodies never answered again: %d\n", len(r.cutUnanswered))
	fmt.Fprintf(w, "duplicates: %d\n", len(r.duplicated))
	fmt.Fprintf(w, "lost: %d\n", len(r.lost))
	fmt.Fprintf(w, "wrong answers: %d\n", len(r.wrong))
	fmt.Fprintf(w, "replays checked at the end: %d\n", r.end.checked)
	fmt.Fprintf(w, "wrong answers at the end: %d\n", len(r.end.wrong))
	fmt.Fprintf(w, "run again at the end: %d\n", len(r.end.ranAgain))
	if sc.spec.transactional() {
		fmt.Fprintf(w, "handler runs rolled back: %d\n", r.rolledBack)
	} else {
		fmt.Fprintf(w, "re-executions after server kills: %d\n", r.reexecuted)
		if r.unsettledRuns > 0 {
			fmt.Fprintf(w, "re-executions after claims left in progress: %d\n", r.unsettledRuns)
		}
	}
	if len(r.unfinished) > 0 {
		fmt.Fprintf(w, "unfinished: %d\n", len(r.unfinished))
	}
	fmt.Fprintf(w, "client kills: %d\n", r.clientKills)
	fmt.Fprintf(w, "server restarts: %d\n", r.serverRestarts)
	fmt.Fprintf(w, "seed: %d\n", sc.seed)
	fmt.Fprintf(w, "wall time: %v\n", r.wall.Round(time.Millisecond))
	for _, l := range []struct {
		what string
		ops  []string
	}{
		{"duplicated operations", r.duplicated},
		{"lost operations (never executed)", r.lost},
		{"unfinished operations (never recorded done by the client)", r.unfinished},
		{"operations refused (final status other than 201)", r.refused},
		{"operations answered 201 with a body other than their receipt", r.wrong},
		{"operations called again with a new key after a cut body (the key was released before the body was read)",
			r.newKeyAfterCut},
		{"operations never answered again after a cut body (the key was released before the body was read)",
			r.cutUnanswered},
		{"executed operations not in the scenario", r.strangers},
		{"operations answered other than 201 with their receipt when sent again at the end", r.end.wrong},
		{"operations whose handler ran again when sent again at the end", r.end.ranAgain},
	} {
		if len(l.ops) > 0 {
			fmt.Fprintf(w, "%s: %s\n", l.what, strings.Join(l.ops, ", "))
		}
	}
	if r.reexecuted > 0 {
		fmt.Fprintf(w, "note: %d handler runs came for payments already charged, by a server started after "+
			"the one that charged was killed before storing the response and the claim's lease ended; "+
			"the provider found each charge under the forwarded key (idemserver.KeyFrom, Key.Derive) "+
			"and did not charge again\n", r.reexecuted)
	}
	if r.unsettledRuns > 0 {
		fmt.Fprintf(w, "note: %d handler runs came for payments already charged, after the store failed to "+
			"keep the outcome or the claim's lease was lost; lease mode allows them, and the provider "+
			"did not charge again\n", r.unsettledRuns)
	}
	if r.incomplete() {
		fmt.Fprintf(w, "INCOMPLETE: asked for %s and %s, made %s and %s (no proof through the kills "+
			"asked for)\n",
			plural(sc.clientKills, "client kill"), plural(sc.serverRestarts, "server restart"),
			plural(r.clientKills, "client kill"), plural(r.serverRestarts, "server restart"))
	}
	switch {
	case r.failed():
		fmt.Fprintln(w, "FAIL")
	case !r.incomplete():
		fmt.Fprintln(w, "PASS: every operation took effect exactly once")
	}
}
