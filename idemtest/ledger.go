package idemtest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"hash"
	"maps"
	"net/http"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/idemhttp/idemhttp/idemserver"
)

// ledger counts the executions of the handler behind it, per scoped
// idempotency key: the runs that ended with an outcome the middleware
// keeps. It also remembers those outcomes, so that every replay the
// middleware serves can be checked against an answer the handler gave.
type ledger struct {
	next   http.Handler
	header string
	// hold is set when the store holds responses (idemserver.ResponseHolder,
	// or a claim won that says so in idemserver.ClaimResult.Hold, which a
	// wrapper of the store cannot hide): such a store may discard
	// everything a run did, when it rolls back (idemserver.ErrRolledBack)
	// or asks for the request to run again (idemserver.ErrRetryRequest),
	// and a discarded run does not count (see storeWatcher).
	hold atomic.Bool

	mu   sync.Mutex
	runs map[string]int
	// running counts the runs that have not ended, which runs does not
	// count yet: an assertion made while one goes on is not final.
	running map[string]int
	// kept holds, per entry (scope and key, as runs), the answers of the
	// runs whose outcome the middleware keeps; seen marks the entries the
	// handler ran for at all.
	kept map[string][]answer
	seen map[string]bool
	// wrong describes the replays that matched no kept answer.
	wrong []string
	// unkeyed counts, per method and path, the runs of requests of a
	// method that is not idempotent that carried no key, counted as runs
	// is.
	unkeyed map[string]int
}

// answer is what a handler answered: its status, the SHA-256 of its header
// fields as the middleware keeps them (see fieldsSum), and its body's size
// and SHA-256.
type answer struct {
	status int
	fields [sha256.Size]byte
	size   int
	sum    [sha256.Size]byte
}

func newLedger(next http.Handler, header string, hold bool) *ledger {
	l := &ledger{next: next, header: header, runs: make(map[string]int), running: make(map[string]int),
		kept: make(map[string][]answer), seen: make(map[string]bool), unkeyed: make(map[string]int)}
	l.hold.Store(hold)
	return l
}

// requestRuns is the ledger's note, in the context of a request the fault
// injector passed on, of the entry the middleware claimed for the request
// and of the request's last counted run.
type requestRuns struct {
	claimed string // the entry of the key claimed; empty before a claim
	counted bool
	name    string
	kept    *answer
}

type requestRunsKey struct{}

// withRequestRuns returns r with a note for the ledger in its context.
func withRequestRuns(r *http.Request) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), requestRunsKey{}, new(requestRuns)))
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
	unkeyed := false
	if !ok {
		// The middleware did not claim the request (its method is not
		// covered, say): the key it carries is still what the client
		// meant it to be deduplicated by.
		if k.Key, ok = requestKey(r, l.header); !ok {
			if idempotentMethod(r.Method) {
				l.next.ServeHTTP(w, r)
				return
			}
			// Nothing deduplicates a run without a key: a client that
			// sends an operation's retry without its key runs it again,
			// under no key the ledger counts.
			unkeyed = true
		}
	}
	name := entryName(k)
	if unkeyed {
		name = r.Method + " " + r.URL.Path + " without a key"
	}
	var note *requestRuns
	if l.hold.Load() {
		note, _ = r.Context().Value(requestRunsKey{}).(*requestRuns)
	}
	l.mu.Lock()
	l.running[name]++
	if !unkeyed {
		l.seen[name] = true
	}
	l.mu.Unlock()
	sw := &statusWriter{ResponseWriter: w, body: sha256.New()}
	returned := false
	defer func() {
		// A panic is not an execution, and goes on. A run that returns
		// without a status once its context has ended is counted, though
		// the middleware releases its key: the ledger cannot tell whether
		// it acted, and one that did runs again on the retry, which the
		// ledger must show. It gave no answer, so nothing may be replayed
		// for it. The run is counted as it stops running, so that no
		// assertion sees it both done and in progress.
		silentAfterEnd := sw.status == 0 && r.Context().Err() != nil
		l.mu.Lock()
		if l.running[name]--; l.running[name] == 0 {
			delete(l.running, name)
		}
		if returned && !sw.releases && unkeyed {
			l.unkeyed[name]++
		} else if returned && !sw.releases {
			l.runs[name]++
			var kept *answer
			if !silentAfterEnd {
				a := sw.answer()
				kept = &a
				l.kept[name] = append(l.kept[name], a)
			}
			if note != nil {
				note.counted, note.name, note.kept = true, name, kept
			}
		}
		l.mu.Unlock()
	}()
	l.next.ServeHTTP(sw, r)
	returned = true
}

// discarded takes back the counted run of the request whose context is
// ctx: the store discarded all that it did, which is no execution.
func (l *ledger) discarded(ctx context.Context) {
	note, _ := ctx.Value(requestRunsKey{}).(*requestRuns)
	if note == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if note.counted {
		l.uncount(note)
	}
}

// uncount takes back the run note counted. l.mu must be held.
func (l *ledger) uncount(note *requestRuns) {
	if l.runs[note.name]--; l.runs[note.name] == 0 {
		delete(l.runs, note.name)
	}
	if note.kept != nil {
		kept := l.kept[note.name]
		if i := slices.Index(kept, *note.kept); i >= 0 {
			l.kept[note.name] = slices.Delete(kept, i, i+1)
		}
	}
	note.counted = false
}

// claiming notes, in the note in ctx, that the middleware claims key for
// the request: a replay it then serves is one of key's, in key's scope.
func (l *ledger) claiming(ctx context.Context, key idemserver.Key) {
	if note, _ := ctx.Value(requestRunsKey{}).(*requestRuns); note != nil {
		l.mu.Lock()
		note.claimed = entryName(key)
		l.mu.Unlock()
	}
}

// checkReplay checks a response the middleware replayed for the request
// whose context is ctx and whose bare key is key: it must be an answer the
// handler gave for the entry the middleware claimed (the key in its
// scope), and kept. An entry the handler never ran for here (its record
// was made by another server sharing the store) cannot be checked. A
// replay of a response whose body was not kept (too large, or its stream
// to the first client broke) carries the status and a problem document of
// type idemserver.ProblemResponseNotStored.
func (l *ledger) checkReplay(ctx context.Context, key string, status int, header http.Header, body []byte) {
	got := answer{status: status, fields: fieldsSum(header), size: len(body), sum: sha256.Sum256(body)}
	omitted := strings.HasPrefix(header.Get("Content-Type"), "application/problem+json") &&
		bytes.Contains(body, []byte(strconv.Quote(idemserver.ProblemResponseNotStored)))
	l.mu.Lock()
	defer l.mu.Unlock()
	if note, _ := ctx.Value(requestRunsKey{}).(*requestRuns); note != nil && note.claimed != "" {
		key = note.claimed
	}
	if !l.seen[key] {
		return
	}
	kept := l.kept[key]
	for _, a := range kept {
		// A response too large to keep is replayed with a problem
		// document in place of its body and its body's fields.
		if a.status == got.status && (omitted || a.fields == got.fields && (!bodyAllowed(status) || a == got)) {
			return
		}
	}
	what := "the handler gave no answer to keep"
	if len(kept) > 0 {
		parts := make([]string, len(kept))
		for i, a := range kept {
			parts[i] = a.String()
		}
		what = "the handler answered " + strings.Join(parts, " or ")
	}
	l.wrong = append(l.wrong, fmt.Sprintf("%s (replayed %v; %s)", key, got, what))
}

func (a answer) String() string {
	return fmt.Sprintf("%d with a %d-byte body %x and header fields %x", a.status, a.size, a.sum[:4], a.fields[:4])
}

// fieldsSum returns the SHA-256 of the fields of h that a replay must
// carry as the first response did: all but those the middleware does not
// keep (hop-by-hop fields, those named in Connection, trailers, invalid
// names, and Set-Cookie, which it keeps only when allowed) and those it
// sets itself (Idempotent-Replayed, and Content-Length, which it may add).
func fieldsSum(h http.Header) [sha256.Size]byte {
	named := make(map[string]bool)
	for _, v := range h.Values("Connection") {
		for tok := range strings.SplitSeq(v, ",") {
			named[textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(tok))] = true
		}
	}
	names := make([]string, 0, len(h))
	for k := range h {
		ck := textproto.CanonicalMIMEHeaderKey(k)
		switch {
		case !fieldName(k), named[ck], strings.HasPrefix(k, http.TrailerPrefix), strings.HasPrefix(ck, "Proxy-"):
			continue
		}
		switch ck {
		case "Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
			"Set-Cookie", "Content-Length", idemserver.ReplayedHeader:
			continue
		}
		names = append(names, k)
	}
	slices.Sort(names)
	sum := sha256.New()
	for _, k := range names {
		fmt.Fprintf(sum, "%s:%q\n", k, h[k])
	}
	var out [sha256.Size]byte
	sum.Sum(out[:0])
	return out
}

// bodyAllowed reports whether a response with status carries a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
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
	return l.inProgressLocked()
}

func (l *ledger) inProgressLocked() (keys []string, runs int) {
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
	return l.duplicatesLocked()
}

func (l *ledger) duplicatesLocked() []string {
	var dups []string
	for key, n := range l.runs {
		if n > 1 {
			dups = append(dups, key)
		}
	}
	slices.Sort(dups)
	return dups
}

// unkeyedRunsLocked describes the counted runs of requests without a key
// whose method is not idempotent, sorted, with their number. l.mu must be
// held.
func (l *ledger) unkeyedRunsLocked() (what []string, runs int) {
	for name, n := range l.unkeyed {
		what = append(what, fmt.Sprintf("%s (%d)", name, n))
		runs += n
	}
	slices.Sort(what)
	return what, runs
}

// ledgerView is the whole ledger at one instant, as an assertion reads it.
type ledgerView struct {
	runs                     map[string]int
	duplicates, wrong        []string
	unkeyed, running         []string
	unkeyedRuns, runningRuns int
}

// view reads the whole ledger under one lock, so that a run that ends
// meanwhile is either in progress or counted, never neither.
func (l *ledger) view() ledgerView {
	l.mu.Lock()
	defer l.mu.Unlock()
	v := ledgerView{runs: maps.Clone(l.runs), duplicates: l.duplicatesLocked(), wrong: slices.Clone(l.wrong)}
	v.unkeyed, v.unkeyedRuns = l.unkeyedRunsLocked()
	v.running, v.runningRuns = l.inProgressLocked()
	return v
}

// idempotentMethod reports whether HTTP defines method as idempotent
// (RFC 9110, section 9.2.2), so that a client may send it again without a
// key.
func idempotentMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

func (l *ledger) wrongReplays() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.wrong)
}

// fieldName reports whether name is a token (RFC 9110, section 5.1), a
// field name net/http writes: visible ASCII characters other than the
// delimiters.
func fieldName(name string) bool {
	return name != "" && strings.IndexFunc(name, func(c rune) bool {
		return c <= ' ' || c > '~' || strings.ContainsRune(`"(),/:;<=>?@[\]{}`, c)
	}) < 0
}

// statusWriter notes the status a handler answers with, and whether the
// middleware releases the key after it: judged, as the middleware judges
// it, by the header fields when the status is written. It hashes the
// header fields as they are then, which are those the client gets, and
// the body the handler writes.
type statusWriter struct {
	http.ResponseWriter
	status   int
	releases bool
	fields   *[sha256.Size]byte // fieldsSum of the header when the status was written
	body     hash.Hash
	size     int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
		w.releases = idemserver.ReleasesResponse(code, w.Header())
		w.noteFields()
	}
	w.ResponseWriter.WriteHeader(code)
}

// noteFields keeps the sum of the header fields, once: the header is
// written.
func (w *statusWriter) noteFields() {
	if w.fields == nil {
		sum := fieldsSum(w.Header())
		w.fields = &sum
	}
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
		w.noteFields()
	}
	n, err := w.ResponseWriter.Write(p)
	w.body.Write(p[:n])
	w.size += n
	return n, err
}

// FlushError lets a streaming handler flush through the ledger, and tells
// it when the flush failed (its client went away, say), as the writer
// underneath does: a handler that stops streaming on that error must see
// it here as it would without the ledger.
func (w *statusWriter) FlushError() error {
	if w.status == 0 {
		w.status = http.StatusOK
		w.noteFields()
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Flush implements [http.Flusher]; see FlushError.
func (w *statusWriter) Flush() { _ = w.FlushError() }

// Unwrap gives http.ResponseController the writer underneath.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// answer returns what the handler answered; a handler that wrote nothing
// answered the implicit 200.
func (w *statusWriter) answer() answer {
	a := answer{status: w.status, size: w.size}
	if a.status == 0 {
		a.status = http.StatusOK
	}
	w.noteFields() // a handler that wrote nothing: its fields as it left them
	a.fields = *w.fields
	w.body.Sum(a.sum[:0])
	return a
}
