package main

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The ledger records the effect of every payment the server's handler
// executes, outside the server process, so that it outlives the server's
// kills. With the memory, postgres and redis stores it is a file that plays
// the payment provider the handler charges; with postgres-tx it is the
// payments table, written in the claim's transaction.
//
// A payment provider that is called by a server which can die after its
// call deduplicates the calls by an idempotency key, as real ones do, and
// the handler forwards one, derived from its own claimed key with
// [idemserver.Key.Derive]. In lease mode that is what makes a payment
// happen once: a server killed after its handler charged and before the
// claim was completed leaves the claim in progress, and once its lease has
// ended a retry takes it over and runs the handler again. The provider
// then finds the charge it already made and replays it, and the ledger
// records the run as repeated rather than charged.

// Kinds of ledger entry.
const (
	// kindCharged: the handler made the payment; its effect.
	kindCharged = "charged"
	// kindRepeated: the handler ran again for a payment the provider had
	// made under the same derived key, and the provider did not charge
	// again.
	kindRepeated = "repeated"
	// kindRan: with postgres-tx, the handler inserted the payment in its
	// transaction; whether it committed, the payments table says.
	kindRan = "ran"
	// kindUnsettled: in lease mode, the handler ran and its claim was
	// neither completed nor released: the store failed to keep the outcome,
	// or the lease was lost. The claim is taken over once its lease ends,
	// and the handler runs again, in the same server process.
	kindUnsettled = "unsettled"
	// kindKept: in lease mode, the store kept the outcome of the handler's
	// run (the middleware completed the claim). No later run may follow
	// for the key within its retention, by any server: one that does
	// found the key forgotten. Kept entries go to a file of their own
	// (keptPath), so that the scenario, which watches the ledger grow to
	// time its server kills between a charge and its stored response, is
	// not misled by them.
	kindKept = "kept"
)

// keptPath is the file of the kindKept entries of the ledger at path.
func keptPath(ledger string) string { return ledger + ".kept" }

// noKey stands for the derived key of a request the middleware did not
// claim: the handler has no key to forward, and the provider charges it
// every time.
const noKey = "-"

// entry is one line of the ledger: a run of the handler for op, under key,
// by the server process numbered server (0 for the first, n after the
// n-th restart).
type entry struct {
	kind   string
	op     string
	key    string
	server int
}

// parseEntry parses a ledger file's line.
func parseEntry(fields []string) (entry, error) {
	if len(fields) == 4 && slices.Contains([]string{kindCharged, kindRepeated, kindRan, kindUnsettled, kindKept}, fields[0]) {
		if n, err := strconv.Atoi(fields[3]); err == nil && n >= 0 {
			return entry{kind: fields[0], op: fields[1], key: fields[2], server: n}, nil
		}
	}
	return entry{}, fmt.Errorf("ledger: unexpected line %q", strings.Join(fields, " "))
}

// provider is the payment provider of the memory, postgres and redis
// stores' handler: it appends each charge to the ledger file, durably, and
// deduplicates charges by their idempotency key. Only one server process
// runs at a time, so the keys it read from the file when it started and
// those it charged since are all the keys charged.
type provider struct {
	server string
	mu     sync.Mutex
	log    *lineLog
	kept   *lineLog        // the kindKept entries
	keys   map[string]bool // the keys charged
}

// openProvider opens the ledger at path for the server process numbered
// server.
func openProvider(path string, server int) (*provider, error) {
	lines, err := readLines(path)
	if err != nil {
		return nil, err
	}
	p := &provider{server: strconv.Itoa(server), keys: make(map[string]bool)}
	for _, l := range lines {
		e, err := parseEntry(l)
		if err != nil {
			return nil, err
		}
		if e.key != noKey {
			p.keys[e.key] = true
		}
	}
	if p.log, err = openLineLog(path); err != nil {
		return nil, err
	}
	if p.kept, err = openLineLog(keptPath(path)); err != nil {
		p.log.Close()
		return nil, err
	}
	return p, nil
}

// charge makes the payment of op under key (noKey for none) unless key was
// charged already, and records the run in the ledger either way.
func (p *provider) charge(op, key string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	kind := kindCharged
	if key != noKey && p.keys[key] {
		kind = kindRepeated
	}
	if err := p.log.append(true, kind, op, key, p.server); err != nil {
		return err
	}
	p.keys[key] = true
	return nil
}

// unsettled records that the claim of op, whose charge key is key, was
// left in progress by a server that goes on running.
func (p *provider) unsettled(op, key string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.append(true, kindUnsettled, op, key, p.server)
}

// stored records that the outcome of op's run, whose charge key is key,
// was kept by the store. The entry need not be durable: only a kill of the
// process can interrupt it, and an entry lost with the process makes the
// check weaker, never wrong.
func (p *provider) stored(op, key string) error {
	return p.kept.append(false, kindKept, op, key, p.server)
}

func (p *provider) Close() error { return errors.Join(p.log.Close(), p.kept.Close()) }
