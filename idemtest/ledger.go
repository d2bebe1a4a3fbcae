package idemtest

import (
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/idemhttp/idemhttp/idemserver"
)

// ledger counts the executions of the handler behind it, per scoped
// idempotency key: the runs that ended with an outcome the middleware keeps.
type ledger struct {
	next   http.Handler
	header string

	mu   sync.Mutex
	runs map[string]int
	// running counts the runs that have not ended, which runs does not
	// count yet: an assertion made while one goes on is not final.
	running map[string]int
}

func newLedger(next http.Handler, header string) *ledger {
	return &ledger{next: next, header: header, runs: make(map[string]int), running: make(map[string]int)}
}

// entryName names the ledger's entry of k: the bare key, or with a scope
// (idemserver.WithScope) the quoted scope, a space and the key, so that
// the keys of two scopes never share an entry.
func entryName(k idemserver.Key) string {
	if k.Scope == "" {
		return k.Key
	}
	return strconv.Quote(k.Scope) + " " + k.Key
}

func (l *ledger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k, ok := idemserver.KeyFrom(r.Context())
	if !ok {
		// The middleware did not claim the request (its method is not
		// covered, say): the key it carries is still what the client
		// meant it to be deduplicated by.
		if k.Key, ok = requestKey(r, l.header); !ok {
			l.next.ServeHTTP(w, r)
			return
		}
	}
	key := entryName(k)
	l.mu.Lock()
	l.running[key]++
	l.mu.Unlock()
	sw := &statusWriter{ResponseWriter: w}
	returned := false
	defer func() {
		// A panic is not an execution, and goes on. A run that returns
		// without a status once its context has ended is counted, though
		// the middleware releases its key: the ledger cannot tell whether
		// it acted, and one that did runs again on the retry, which the
		// ledger must show. The run is counted as it stops running, so
		// that no assertion sees it both done and in progress.
		l.mu.Lock()
		if l.running[key]--; l.running[key] == 0 {
			delete(l.running, key)
		}
		if returned && !sw.releases {
			l.runs[key]++
		}
		l.mu.Unlock()
	}()
	l.next.ServeHTTP(sw, r)
	returned = true
}

func (l *ledger) executions() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.runs)
}

// inProgress returns the keys whose handler is running, sorted, with the
// number of runs.
func (l *ledger) inProgress() (keys []string, runs int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for key, n := range l.running {
		keys = append(keys, key)
		runs += n
	}
	slices.Sort(keys)
	return keys, runs
}

func (l *ledger) duplicates() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var dups []string
	for key, n := range l.runs {
		if n > 1 {
			dups = append(dups, key)
		}
	}
	slices.Sort(dups)
	return dups
}

// statusWriter notes the status a handler answers with, and whether the
// middleware releases the key after it: judged, as the middleware judges
// it, by the header fields when the status is written.
type statusWriter struct {
	http.ResponseWriter
	status   int
	releases bool
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
		w.releases = idemserver.ReleasesResponse(code, w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

// Flush lets a streaming handler flush through the ledger.
func (w *statusWriter) Flush() {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap gives http.ResponseController the writer underneath.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
