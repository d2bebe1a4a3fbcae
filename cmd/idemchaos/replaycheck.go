package main

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// The promise has two halves: a key's effect happens once, and every retry
// within the retention window gets the same answer. The ledger checks the
// first; the answers the client accepts during the run check the second
// only for the retries that faults and kills happened to cause, most of
// them within a second of the first answer. A server that forgot an
// outcome soon after storing it, or lost it when it was killed, would go
// unseen whenever no retry came after. So once the client is done, the
// scenario sends every operation again, straight to the server, with the
// key the client last completed it with. Each must be answered 201 with
// its receipt. One that is not marked as a replay ran the handler again,
// and the ledger judges that run like any other: lease mode allows it
// after a claim that a killed server, or a store that failed to keep the
// outcome, left in progress (the client can have had its 201 from the
// latter), and nothing allows it after the outcome was kept, so a
// forgotten key shows as a duplicate.

// replayWait bounds how long the check waits for a claim still in progress
// (a request of the run that reached the server after the client moved on)
// before it counts the operation's answer as wrong.
const replayWait = 15 * time.Second

// lastKeys returns the key the client log records each operation last
// answered 201 with, and the operations answered 201 with no key recorded.
func lastKeys(log [][]string) (keys map[string]string, keyless []string) {
	keys = make(map[string]string)
	for _, l := range log {
		if l[0] != "done" || len(l) < 4 || l[2] != "201" {
			continue
		}
		if len(l) >= 5 && l[4] != noKey {
			keys[l[1]] = l[4]
		} else {
			keyless = append(keyless, l[1])
		}
	}
	return keys, slices.DeleteFunc(keyless, func(op string) bool { return keys[op] != "" })
}

// endCheck is the outcome of the check at the end of a run.
type endCheck struct {
	checked  int      // operations sent again
	ranAgain []string // answered by a run of the handler, not a replay
	wrong    []string // not answered 201 with their receipt, each with why
}

// checkRun checks the replays of the operations of a run whose client log
// is at path, at the server at url, n at a time. An operation recorded
// done without a key cannot be checked, and is counted wrong.
func checkRun(ctx context.Context, path, url string, n int) (endCheck, error) {
	log, err := readLines(path)
	if err != nil {
		return endCheck{}, err
	}
	keys, keyless := lastKeys(log)
	tr := &http.Transport{MaxIdleConnsPerHost: n}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	var (
		mu  sync.Mutex
		res = endCheck{checked: len(keys)}
	)
	err = forEach(ctx, slices.Sorted(maps.Keys(keys)), n, func(op string) {
		ranAgain, why := checkReplay(ctx, client, url, op, keys[op])
		mu.Lock()
		defer mu.Unlock()
		if ranAgain {
			res.ranAgain = append(res.ranAgain, op)
		}
		if why != "" {
			res.wrong = append(res.wrong, op+" ("+why+")")
		}
	})
	if err != nil {
		return endCheck{}, fmt.Errorf("checking the replays: %w", err)
	}
	for _, op := range slices.Compact(slices.Sorted(slices.Values(keyless))) {
		res.wrong = append(res.wrong, op+" (no key recorded)")
	}
	slices.Sort(res.ranAgain)
	slices.Sort(res.wrong)
	return res, nil
}

// checkReplay sends op with key and reports whether the answer was a run of
// the handler rather than a replay, and what was wrong with it ("" if it
// was 201 with op's receipt).
func checkReplay(ctx context.Context, client *http.Client, url, op, key string) (ranAgain bool, why string) {
	deadline := time.Now().Add(replayWait)
	for {
		req, err := payment(ctx, url, op)
		if err != nil {
			return false, err.Error()
		}
		req.Header.Set(idemserver.DefaultKeyHeader, key)
		resp, err := client.Do(req)
		if err != nil {
			return false, err.Error()
		}
		switch {
		case resp.StatusCode == http.StatusConflict && resp.Header.Get("Retry-After") != "" &&
			time.Now().Before(deadline) && ctx.Err() == nil:
			drain(resp)
			sleep(ctx, 100*time.Millisecond)
			continue
		case resp.StatusCode != http.StatusCreated:
			drain(resp)
			return false, "status " + strconv.Itoa(resp.StatusCode)
		}
		switch wrong, err := checkReceipt(resp, op); {
		case err != nil:
			return false, "body: " + err.Error()
		case wrong != "":
			return false, wrong
		}
		return resp.Header.Get(idemserver.ReplayedHeader) != "true", ""
	}
}
