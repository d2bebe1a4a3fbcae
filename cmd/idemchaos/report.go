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

	// executions counts the ledger's lines per operation of the scenario.
	executions map[string]int
	// duplicated lists the operations executed more than once, lost those
	// executed never, unfinished those the client never recorded done,
	// refused those whose final status was not 201, and strangers the
	// operations in the ledger that the scenario does not have.
	duplicated, lost, unfinished, refused, strangers []string
	replaysReceived                                  int
}

// read checks the ledger and the client log against the operations.
func (r *report) read(f files) error {
	ops := operations(r.scenario.ops)
	r.executions = make(map[string]int, len(ops))
	for _, op := range ops {
		r.executions[op] = 0
	}
	ledger, err := readLines(f.ledger)
	if err != nil {
		return err
	}
	for _, l := range ledger {
		if l[0] != "executed" || len(l) < 2 {
			return fmt.Errorf("ledger: unexpected line %q", strings.Join(l, " "))
		}
		if _, ok := r.executions[l[1]]; !ok {
			r.strangers = append(r.strangers, l[1])
			continue
		}
		r.executions[l[1]]++
	}
	log, err := readLines(f.clientLog)
	if err != nil {
		return err
	}
	done := make(map[string]bool)
	for _, l := range log {
		if l[0] != "done" || len(l) < 4 {
			return fmt.Errorf("client log: unexpected line %q", strings.Join(l, " "))
		}
		done[l[1]] = true
		if l[2] != "201" {
			r.refused = append(r.refused, l[1]+" ("+l[2]+")")
		}
		if l[3] == "true" {
			r.replaysReceived++
		}
	}
	for _, op := range ops {
		switch n := r.executions[op]; {
		case n == 0:
			r.lost = append(r.lost, op)
		case n > 1:
			r.duplicated = append(r.duplicated, fmt.Sprintf("%s (%d executions)", op, n))
		}
		if !done[op] {
			r.unfinished = append(r.unfinished, op)
		}
	}
	slices.Sort(r.strangers)
	slices.Sort(r.refused)
	return nil
}

// failed reports whether the run broke the promise or did not finish.
func (r *report) failed() bool {
	return len(r.duplicated)+len(r.lost)+len(r.unfinished)+len(r.refused)+len(r.strangers) > 0
}

func (r *report) print(w io.Writer) {
	sc := r.scenario
	p := r.proxy
	fmt.Fprintf(w, "idemchaos: store %s, %d workers, faults %g, seed %d\n", sc.store, sc.workers, sc.faults, sc.seed)
	fmt.Fprintf(w, "operations: %d\n", sc.ops)
	fmt.Fprintf(w, "attempts: %d\n", p.Requests)
	fmt.Fprintf(w, "retries: %d\n", p.Requests-sc.ops)
	fmt.Fprintf(w, "replays served: %d\n", p.Replayed)
	fmt.Fprintf(w, "replays received: %d\n", r.replaysReceived)
	fmt.Fprintf(w, "faults injected: %d resets before the server, %d responses lost, %d 503, %d 429, %d stalls; %d delayed\n",
		p.ResetBefore, p.LostResponses, p.Unavailable, p.TooManyRequests, p.Stalled, p.Delayed)
	fmt.Fprintf(w, "duplicates: %d\n", len(r.duplicated))
	fmt.Fprintf(w, "lost: %d\n", len(r.lost))
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
		{"executed operations not in the scenario", r.strangers},
	} {
		if len(l.ops) > 0 {
			fmt.Fprintf(w, "%s: %s\n", l.what, strings.Join(l.ops, ", "))
		}
	}
	if r.failed() {
		fmt.Fprintln(w, "FAIL")
	} else {
		fmt.Fprintln(w, "PASS: every operation executed exactly once")
	}
}
