package idemhttp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemhttp/idemhttp/internal/sfv"
)

// Transport is an [http.RoundTripper] that retries safely. Each call to
// RoundTrip is one logical operation: it gets one idempotency key (when its
// method is keyed), and every attempt it makes carries that key.
//
// Transport honours the RoundTripper contract exactly. It never modifies the
// caller's request: each attempt is sent as a copy of it. The copy has a
// header of its own, so that nothing a base transport writes to it can
// reach the caller or a later attempt, unless the base transport is
// net/http's own [http.Transport], which only reads a request's header
// (on every platform but js, where it deletes the fields that carry Fetch
// options): then an attempt's header shares the caller's values, and is the
// caller's map itself when the Transport adds no key to it. Code that
// http.Transport hands the attempt's request to (a Proxy function, a
// RoundTripper registered with RegisterProtocol) must not write to its
// header either, as the RoundTripper contract already asks of the latter.
// It closes the caller's request body exactly once on every path, including
// refusals before any attempt. It returns either a response or an error,
// never both; a response with a failing status after the last attempt is a
// response, not an error. The context of the attempt that produced the
// returned response stays alive until the caller closes the response body.
//
// A request whose context names an operation ([WithOperation]) takes its
// key from the [KeyStore], and the key is released only once the
// operation's final outcome has reached the caller in full: when the
// response body has been read to its end, or closed with no read of it
// failed or in progress (a Close that interrupts a blocked Read keeps the
// key, as the caller has not seen the outcome). A response without a body
// (to HEAD, a 204, a 304, or one whose Body is [http.NoBody], as net/http's
// HTTP/1 gives an empty one) releases it before RoundTrip returns. A body whose read fails (the
// connection cut, the attempt timeout ending the read) leaves the key
// pending even once it is closed, so that calling again with the same
// operation id sends the same key and gets the server's replay of the
// outcome the caller missed. A body neither read to its end nor closed
// keeps the key pending. The release happens once, in the Read that
// returns [io.EOF] or in Close after the connection has been handed back;
// a durable KeyStore's write for it delays that call, not the response. A
// response returned because retries ran out, or any other outcome that is
// not final, leaves the key pending as it is. For an operation made with
// [HoldKey], the key stays pending in every case, and [Settle] releases it
// later by these same rules.
//
// Only one call of an operation is in flight at a time among the
// Transports over one KeyStore: a call with the id of an operation that
// another call is sending, or whose final response another caller has
// not yet read, fails at once with [ErrOperationInFlight] and sends
// nothing (see [WithOperation]). A key is released only by the call in
// flight, before its flight ends, so no caller is left holding an outcome
// that is not final for a key another call released.
//
// A 4xx that is not retried is final only for a key the server cannot have
// acted on before: one sent for the first time, by the first attempt of
// the call that recorded it, and sent once: net/http sends a request that
// carries an idempotency key again by itself, on a new connection, when a
// reused one fails before the response, and the first send may have
// reached the server. (Nothing tells that resend from one made because not
// a byte of the first send could be written, so a 4xx answering either
// keeps the key pending; the next call gets the server's replay of it.)
// Once the key may have reached the server (an
// earlier attempt of the call, or an earlier call that left it pending), a
// 4xx keeps it pending unless the server marks the response as the replay
// of the outcome it stored for the key (Idempotent-Replayed: true): a layer
// in front of the server's idempotency, such as authentication refusing a
// token that expired since the first attempt, answers without looking at
// the key, while the first attempt may have acted. The next call with the
// operation's id sends the key again and gets that replay. The request
// that follows a 307 or 308 sends the key again, so its 4xx is final only
// when the send the redirect answered was the key's first; the GET that
// follows a 301, 302 or 303 carries none of the key, and a 4xx answering it
// is never the key's outcome (the redirect was, and the server acted), so
// the key stays pending and the next call gets the redirect replayed and
// follows it again. A 2xx or a final 3xx is final whenever it comes.
//
// A 307 or 308 asks for the same request to be sent to another URL, so it
// does not end the request's operation: when [http.Client] follows it, the
// request it sends carries the key of the request redirected, and an
// operation's key stays pending until that request's outcome is final.
// http.Client builds the redirected request from the caller's, which has
// no key the Transport added, and points its Response field at the 307 or
// 308; the Transport takes the key from that response's Request, the
// attempt that was sent (set by the Transport when the base transport
// leaves it nil). A 307 or 308 that is not followed, for want of a
// Location, a CheckRedirect that stops it, or a request body without
// GetBody, is returned with its operation's key still pending.
//
// A 301, 302 or 303 with a Location is the server's outcome, but
// http.Client does not return it: it closes it and follows it with a GET,
// and the caller gets that GET's outcome, or its error. So an operation's
// key stays pending through it too, and is released only once the
// outcome of the GET (or of the last of the redirects it leads to) is
// final and has reached the caller; a GET that fails leaves it pending,
// and the next call with the operation's id gets the server's replay of
// the redirect. The GET is another request: it carries no key of the
// operation's (a key of its own if GET is a keyed method).
//
// The request that follows a redirect of an operation takes the operation
// from the redirect, through its Response field, whose Request's context
// the Transport marks, provided its own context names the same operation,
// as http.Client's does. When it is sent through another Transport of this
// package (a RoundTripper that routes hosts to Transports of their own),
// the key is released in the KeyStore of the Transport that holds it. Sent
// through a RoundTripper of another kind, it releases nothing, and the key
// stays pending.
//
// A 301, 302 or 303 that is not followed (CheckRedirect returns
// [http.ErrUseLastResponse], or the caller calls RoundTrip itself) is
// returned with the key still pending, as a 307 or 308 is: the Transport
// cannot tell whether http.Client will follow a redirect, and releasing
// the key of one it follows would lose the key if the GET then failed. A
// caller that acts on such redirects itself releases the key once it has,
// with [KeyStore.Release] and the key [KeyStore.Pending] lists for the
// operation; until then the next call with the operation's id sends it
// again and gets the server's replay of the redirect. A 301, 302 or 303
// without a Location is final.
//
// Each host (scheme, host and port) is guarded by a retry budget and a
// circuit breaker, and optionally by a rate limit; see [Budget],
// [BreakerSettings] and [WithRateLimit].
//
// A Transport is safe for concurrent use by multiple goroutines. Configure
// it with options when it is made; it has no setters.
type Transport struct {
	base http.RoundTripper
	// baseReadsOnly: base is an *http.Transport, which never writes to a
	// request's header, so an attempt that adds nothing to the caller's
	// header may send the caller's map itself.
	baseReadsOnly bool
	cfg           config
	breakers      *breakers // nil: no circuit breakers
	limiters      *limiters // nil: no rate limit
	hostKeys      *hostKeys
	keys          keySource // makes keys, unless cfg.newKey does
	flights       *flights  // the KeyStore's operations in flight
}

// readsHeaderOnly reports whether base, on the platform goos, never writes
// to a request's header: net/http's own Transport, except on js, where it
// deletes the js.fetch:* fields it reads.
func readsHeaderOnly(goos string, base http.RoundTripper) bool {
	_, ok := base.(*http.Transport)
	return ok && goos != "js"
}

// NewTransport returns a Transport that sends attempts through base, or
// through [http.DefaultTransport] if base is nil.
func NewTransport(base http.RoundTripper, opts ...Option) *Transport {
	if base == nil {
		base = http.DefaultTransport
	}
	t := &Transport{base: base, cfg: newConfig(opts)}
	t.baseReadsOnly = readsHeaderOnly(runtime.GOOS, base)
	t.hostKeys = newHostKeys(t.cfg.maxHosts)
	t.flights = flightsOf(t.cfg.keyStore)
	if s := t.cfg.breaker; s != nil {
		t.breakers = newBreakers(*s, t.cfg.maxHosts, t.cfg.idleHost)
	}
	if t.cfg.rateLimit > 0 {
		t.limiters = newLimiters(t.cfg.rateLimit, t.cfg.rateBurst, t.cfg.maxHosts, t.cfg.idleHost)
	}
	return t
}

// CloseIdleConnections closes the idle connections of the base transport,
// if it has that method, so that [http.Client.CloseIdleConnections] reaches
// through the Transport.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// RoundTrip implements [http.RoundTripper]. See [Transport] for what it
// does with keys, retries and the request.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL == nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, errNilURL
	}
	body, err := newRequestBody(req, t.cfg.bodyLimit)
	if err != nil {
		return nil, err
	}
	c := call{t: t, req: req, method: req.Method, ctx: req.Context(), body: body, host: t.hostKeys.get(req.URL)}
	if c.method == "" {
		c.method = http.MethodGet // as net/http sends it
	}
	// Deferred, so that a panic in the caller's code that the call runs
	// (a key generator, a KeyStore, a hook, the base transport) still
	// closes the body and ends the operation's flight.
	defer c.finish()
	return c.run()
}

// finish closes the request body and ends the operation's flight, unless
// the body of the response returned holds it, or hands it on to the
// request that follows the redirect returned.
func (c *call) finish() {
	c.body.close()
	switch {
	case c.flight == nil:
	case c.handed:
		c.flight.hand(c.operation)
	default:
		c.flight.end(c.operation)
	}
}

// errNilURL reports a request without a URL, which cannot be sent.
var errNilURL = errors.New("idemhttp: nil Request.URL")

// errNilResponse reports a base transport that returned neither a response
// nor an error.
var errNilResponse = errors.New("idemhttp: base transport returned a nil response and a nil error")

// call is the state of one RoundTrip.
type call struct {
	t      *Transport
	req    *http.Request
	method string // req.Method, or GET for an empty one
	ctx    context.Context
	body   requestBody

	key       string // the idempotency key sent, or "" if none
	keyValue  string // the key header's value to add, or "" to add none
	operation string // from WithOperation, or ""
	// flight holds the marks in which this call has started operation's
	// flight, or is nil (see flights); flightN is the flight's number.
	flight  *flights
	flightN uint64
	// handed: the call returns a redirect that hands its flight on to the
	// request that follows it (see linkRedirect).
	handed bool
	// shared: another call of the operation sent its key after a redirect
	// this request follows was returned, and its caller may need the key
	// still: this request's outcome must not release it (see flights).
	shared bool
	// superseded lists the outcomes awaiting Settle of the calls that
	// shared the key, which this request took over (see flights.follow).
	superseded []*heldKey
	pending    bool // opKey is pending in the KeyStore under operation
	resend     bool // the request may be sent again after it reached the server
	// watchBody: the request may be sent again only if nothing reached the
	// server, so each attempt notes whether its body was read.
	watchBody bool
	// dropBlankKey: the caller's header holds a blank field of the key's
	// name, which is no key, and no key is added; attempts leave it out,
	// for net/http resends a request carrying an Idempotency-Key field of
	// any value after it may have reached the server.
	dropBlankKey bool
	// opKey is the operation's pending key: key, or, for a request that
	// follows a 301, 302 or 303, the key of the request redirected, which
	// this one does not carry.
	opKey string
	// owner is the Transport whose KeyStore holds opKey, when it is not
	// this one: a redirect's request may be followed through another.
	owner *Transport
	// carried: opKey may have reached the server before this call's first
	// attempt: it was pending before the call, or the redirect this call
	// follows answered a send of it that was not its first.
	carried bool
	// resent: the base transport sent an attempt that carried opKey more
	// than once (net/http sends a request with an idempotency key again by
	// itself, on a new connection, when a reused one fails before the
	// response), so the key may have reached the server before the send
	// that was answered.
	resent bool
	// hold: the operation was made with HoldKey, and its key is released
	// by Settle, not by the call; held is the key as the response
	// returned holds it for Settle.
	hold bool
	held *heldKey

	host     string          // scheme://host:port, for per-host state
	admitted time.Time       // when the attempt in flight was admitted, or the call began
	changes  []BreakerChange // breaker changes not yet reported
}

func (c *call) run() (*http.Response, error) {
	if err := c.assignKey(); err != nil {
		if errors.Is(err, ErrOperationInFlight) {
			// The first attempt is refused before it is sent, as an open
			// breaker refuses it, and is reported so: a program that
			// drives one operation from two places learns of it in its
			// logs and metrics, not only from the error.
			return c.refused(1, outcome{}, ReasonOperationInFlight, err)
		}
		if l := c.t.cfg.logger; l != nil {
			l.LogAttrs(c.ctx, slog.LevelWarn, "idemhttp: no idempotency key, nothing sent",
				slog.String("method", c.method), slog.String("host", c.req.URL.Host),
				slog.String("error", err.Error()))
		}
		return nil, c.giveUp(0, ReasonKeyStore, err)
	}
	var last outcome // the previous attempt, its response body held in memory
	for n := 1; ; n++ {
		o, reason, err := c.send(n)
		if err != nil {
			return c.refused(n, last, reason, err)
		}
		if o.unsent {
			return c.refused(n, last, ReasonBodyNotReplayable, o.err)
		}
		reason, wait := c.decide(n, o)
		if reason == ReasonBackoff || reason == ReasonRetryAfter {
			if veto := c.vetoRetry(); veto != "" {
				reason, wait = veto, 0
			}
		}
		c.report(n, o, reason, wait)

		if reason == ReasonBackoff || reason == ReasonRetryAfter {
			last = hold(o)
			if err := sleep(c.ctx, wait); err != nil {
				return nil, c.giveUp(n, ReasonCanceled, err)
			}
			continue
		}
		if o.err != nil {
			o.cancel()
			return nil, c.giveUp(n, reason, o.err)
		}
		return c.deliver(n, o), nil
	}
}

// deliver readies the response RoundTrip returns, that of attempt n. An
// operation whose outcome it is keeps its key pending until the caller has
// the response in full: the key is released when the body is read to its
// end or closed without a read error, not when the header arrives, for a
// body lost in transit leaves the caller as ignorant of the outcome as a
// lost response. A response without a body is delivered whole, so its key
// is released at once.
func (c *call) deliver(n int, o outcome) *http.Response {
	resp := o.resp
	final := c.pending && finalStatus(resp.StatusCode, resp.Header)
	if final && resp.StatusCode >= 400 && !c.fourXXSettles(n, resp.Header) {
		final = false
	}
	if c.pending && !final && followedRedirect(resp.StatusCode, resp.Header) {
		c.linkRedirect(resp, c.keySentBefore(n))
	}
	// A call that shares the key with another releases nothing: the key
	// is the other call's (see flights).
	release := final && !c.shared
	switch {
	case c.hold && c.pending:
		// A shared outcome is final all the same, and Settle must learn
		// when it has been delivered, though it releases nothing then.
		c.held = c.holdKey(resp, final)
		release = final
	case final && len(c.superseded) > 0:
		// Releases nothing either, but gives back, once delivered, the
		// outcomes it superseded (see flights.restore).
		c.held = &heldKey{owner: c.keyOwner(), operation: c.operation, key: c.opKey, shared: true, superseded: c.superseded}
		release = true
	}
	if release && (resp.Body == http.NoBody || !bodyAllowed(c.method, resp.StatusCode)) {
		// A 1xx here is 101 Switching Protocols: the body is the
		// connection, no longer the outcome.
		c.release()
		release = false
	}
	switch {
	case release:
		b := &responseBody{ReadCloser: resp.Body, cancel: o.cancel,
			t: c.keyOwner(), ctx: c.ctx, operation: c.operation, key: c.opKey, held: c.held}
		// The body ends the flight once it has decided the key's fate.
		b.flight, c.flight = c.flight, nil
		resp.Body = b
	case c.t.cfg.attemptTimeout > 0:
		// Only the attempt's context to end: a body of a quarter of the
		// size. A 101 is never released (above), so it is always here.
		b := &cancelBody{ReadCloser: resp.Body, cancel: o.cancel}
		resp.Body = b
		if w, ok := b.ReadCloser.(io.Writer); ok && resp.StatusCode == http.StatusSwitchingProtocols {
			resp.Body = upgradedBody{b, w}
		}
	}
	return resp
}

// upgradedBody is the body of a 101 Switching Protocols response: the
// connection itself, which net/http hands over as an io.ReadWriteCloser
// for the caller to speak the new protocol on. Its wrapper keeps Write.
type upgradedBody struct {
	*cancelBody
	w io.Writer
}

func (b upgradedBody) Write(p []byte) (int, error) { return b.w.Write(p) }

// fourXXSettles reports whether a 4xx that is not retried, answering
// attempt n with header fields h, is the final outcome of the operation's
// key: the answer to the key's first send, or the server's replay of the
// outcome it stored for the key (see replayed).
//
// Once the key may have reached the server before, a layer in front of the
// server's idempotency may have answered without looking at the key
// (authentication refusing a token that expired since the first attempt, a
// gateway) while the earlier send acted: forgetting the key then would let
// the next call act again under a new one. Kept pending, the key goes with
// the next call, and the server replays its outcome. A request that
// follows a 301, 302 or 303 carries none of the operation's key: the key's
// outcome was the redirect, and no answer to the GET is that outcome.
func (c *call) fourXXSettles(n int, h http.Header) bool {
	if c.key != c.opKey {
		return false
	}
	return !c.keySentBefore(n) || replayed(h)
}

// keySentBefore reports whether the operation's key may have reached the
// server before attempt n: with an earlier attempt of this call, with an
// earlier call, which left it pending, or with an attempt that a redirect
// this request follows answered when the key had been sent before it.
func (c *call) keySentBefore(n int) bool {
	return n > 1 || c.carried || c.resent
}

// replayed reports whether a response is the outcome a server stored for
// the request's idempotency key, replayed, as idemserver and other servers
// mark it.
func replayed(h http.Header) bool {
	return strings.EqualFold(headerValue(h, "Idempotent-Replayed"), "true")
}

// refused ends a request whose attempt n was refused before it was sent.
// The request ends with the outcome of attempt n-1, as when retries run
// out: its response if there is one, else its error, wrapped with why no
// further attempt was made. Only when the caller's context ended does the
// request end with the context's error.
func (c *call) refused(n int, last outcome, reason Reason, err error) (*http.Response, error) {
	c.report(n, outcome{err: err, unsent: true}, reason, 0)
	if last.resp != nil && reason != ReasonCanceled {
		if c.hold && c.pending {
			c.holdKey(last.resp, false)
		}
		return last.resp, nil
	}
	if last.resp != nil {
		last.resp.Body.Close()
	}
	if last.err != nil && reason != ReasonCanceled {
		err = last.err
	}
	return nil, c.giveUp(n-1, reason, err)
}

// assignKey decides the idempotency key: the caller's, the operation's
// pending key, the key of the request a redirect answered, or a new one.
// A request that follows a redirect of a pending operation takes that
// operation from the redirect (see linkRedirect), not from its context: the
// operation's key is pending in the KeyStore of the Transport that sent the
// redirected request, which need not be this one, and the GET that follows
// a 301, 302 or 303 is another request, which must not carry that key.
func (c *call) assignKey() error {
	cfg := &c.t.cfg
	var blankKey bool
	c.key, blankKey = callerKey(c.req.Header, cfg.keyHeader)
	linked := c.req.Response != nil && c.followLink()
	if linked {
		if err := c.followFlight(); err != nil {
			return err
		}
	}
	if c.key == "" && slices.Contains(cfg.keyedMethods, c.method) {
		key := c.redirectedKey()
		var err error
		if key == "" {
			if cfg.newKey == nil {
				// One reading of the clock stamps the key and, unless
				// something may have waited since, admits the first
				// attempt (see send): on some machines it is among the
				// dearest calls here.
				c.admitted = time.Now()
				key, err = c.t.keys.newKey(c.admitted)
			} else if key, err = cfg.newKey(); err == nil {
				// Checked before a KeyStore records it: an empty key would
				// send the request unkeyed, and so unretried, in silence.
				err = checkKey(key, cfg.structuredKey)
			}
			if err != nil {
				return err
			}
		}
		if op, hold, ok := operationOf(c.ctx); ok && !linked {
			if err = c.startFlight(c.t.flights, op); err != nil {
				return err
			}
			c.hold = hold
			candidate := key
			if key, err = cfg.keyStore.Acquire(c.ctx, op, key); err != nil {
				return err
			}
			// A KeyStore of the caller's may return any string.
			if err = checkKey(key, cfg.structuredKey); err != nil {
				return err
			}
			c.operation, c.pending, c.opKey = op, true, key
			c.carried = key != candidate
		}
		c.key = key
		value := key
		if cfg.structuredKey {
			value = structuredString(key)
		}
		c.keyValue = value
	}
	c.resend = idempotentMethod(c.method) || c.key != ""
	c.watchBody = !c.resend && c.body.replayable
	c.dropBlankKey = blankKey && c.key == ""
	return nil
}

// startFlight starts operation's flight in f, which fails if another call
// holds it: this call must not send the operation's key while another
// may release it (see flights).
func (c *call) startFlight(f *flights, operation string) error {
	c.operation = operation // named in the report of a refusal too
	n, err := f.start(operation)
	if err != nil {
		return err
	}
	c.flight, c.flightN = f, n
	return nil
}

// followFlight starts the flight of the operation whose redirect this
// request follows (see followLink), in the marks of the Transport whose
// KeyStore holds its key. If another call of the operation started since
// the redirect was returned, this request's outcome releases nothing.
func (c *call) followFlight() error {
	f := c.keyOwner().flights
	n, superseded, another, err := f.follow(c.operation, c.flightN)
	if err != nil {
		return err
	}
	c.flight, c.flightN, c.superseded = f, n, superseded
	c.shared = c.shared || another
	return nil
}

// redirectedKey returns the key sent with the request that a 307 or 308
// redirected to this one, or "" if this request follows no such redirect.
// [http.Client] builds the redirected request from the caller's, which has
// no key the Transport added, and links it to the redirect in its Response
// field; that response's Request is the attempt that was sent, header and
// key included.
func (c *call) redirectedKey() string {
	prev := c.req.Response
	if prev == nil || prev.Request == nil ||
		(prev.StatusCode != http.StatusTemporaryRedirect && prev.StatusCode != http.StatusPermanentRedirect) {
		return ""
	}
	value := headerValue(prev.Request.Header, c.t.cfg.keyHeader)
	if c.t.cfg.structuredKey && value != "" {
		key, err := sfv.Unquote(value)
		if err != nil {
			return ""
		}
		return key
	}
	return value
}

// redirectLink is an operation whose pending key a redirect that
// http.Client follows hands on to the request that follows it, with the
// Transport whose KeyStore holds the key.
type redirectLink struct {
	owner          *Transport
	operation, key string
	// sentBefore: the key may have reached the server before the attempt
	// the redirect answered (see keySentBefore).
	sentBefore bool
	// flight is the number of the flight the redirect hands on, and
	// shared says that the call that returned it releases nothing (see
	// flights).
	flight uint64
	shared bool
	hold   bool // the operation was made with HoldKey
}

// redirectLinkKey is the context key of a redirectLink.
type redirectLinkKey struct{}

// linkRedirect readies resp, a redirect that http.Client may follow, to
// hand the call's pending operation on to the request that follows it:
// http.Client points that request's Response field at resp, and resp's
// Request, the attempt sent, now carries the operation in its context. A
// 301, 302 or 303 is followed with a GET that carries no key, and so would
// otherwise have no way to find the operation's; a 307 or 308 is followed by
// the same request, which finds the key in the attempt's header, but a GET
// that follows a 301 and is redirected again needs the link as well.
// sentBefore says whether the key may have reached the server before the
// attempt resp answers; the request that follows inherits it.
func (c *call) linkRedirect(resp *http.Response, sentBefore bool) {
	r := resp.Request // set by attempt if the base transport did not
	ctx := context.WithValue(r.Context(), redirectLinkKey{}, redirectLink{c.keyOwner(), c.operation, c.opKey, sentBefore, c.flightN, c.shared, c.hold})
	resp.Request = r.WithContext(ctx)
	c.handed = true
}

// followLink takes on the pending operation of the redirect this request
// follows, if it has one (see linkRedirect), so that its key is released
// only once this request's outcome is final and has reached the caller.
// It reports whether it did. http.Client sends the request that follows a
// redirect with the context of the one redirected, operation included; a
// request with another context (or none) that points at the redirect is
// one a caller built from a response's Request, which follows nothing.
func (c *call) followLink() bool {
	prev := c.req.Response.Request
	if prev == nil {
		return false
	}
	l, ok := prev.Context().Value(redirectLinkKey{}).(redirectLink)
	if !ok {
		return false
	}
	if op, ok := OperationFrom(c.ctx); !ok || op != l.operation {
		return false
	}
	c.operation, c.opKey, c.pending, c.carried = l.operation, l.key, true, l.sentBefore
	c.flightN, c.shared, c.hold = l.flight, l.shared, l.hold
	if l.owner != c.t {
		c.owner = l.owner
	}
	return true
}

// keyOwner returns the Transport whose KeyStore holds the operation's key.
func (c *call) keyOwner() *Transport {
	if c.owner != nil {
		return c.owner
	}
	return c.t
}

// bodyAllowed reports whether a response with status code to a request
// with method can have content (RFC 9110 section 6.4.1). One that cannot
// is whole once its header has arrived, whatever Body the base transport
// gives it: net/http's HTTP/1 gives http.NoBody, its HTTP/2 a reader of
// its own.
func bodyAllowed(method string, code int) bool {
	return code >= 200 && code != http.StatusNoContent && code != http.StatusNotModified &&
		method != http.MethodHead
}

// send makes attempt n once the host's rate limiter has room for it and
// its circuit breaker lets it through, and tells the breaker and the
// limiter how it went. The limiter comes first so that a half-open
// breaker's few probe slots are not held while waiting. When either
// refuses, send returns why and an error, and nothing was sent.
func (c *call) send(n int) (o outcome, reason Reason, err error) {
	if l := c.t.limiters; l != nil {
		if err := l.wait(c.ctx, c.host); err != nil {
			if errors.Is(err, ErrWaitPastDeadline) {
				return o, ReasonWaitPastDeadline, err
			}
			return o, ReasonCanceled, err
		}
	}
	// One reading of the clock serves the breaker, the budget and the
	// attempt's start. The first attempt has the one that stamped its new
	// key, if there was one, unless a rate limiter or a KeyStore may have
	// made it wait since.
	if n > 1 || c.admitted.IsZero() || c.t.limiters != nil || c.pending {
		c.admitted = time.Now()
	}
	if b := c.t.breakers; b != nil {
		changes, err := b.send(c.host, c.admitted, func() breakerOutcome {
			o = c.attempt(n)
			return c.breakerOutcome(o)
		})
		c.noteChanges(changes)
		if err != nil {
			return o, ReasonCircuitOpen, err
		}
	} else {
		o = c.attempt(n)
	}
	if c.t.limiters != nil && o.resp != nil {
		c.t.limiters.observe(c.host, o.resp.StatusCode)
	}
	return o, "", nil
}

// noteChanges keeps breaker changes to report with the attempt. Almost
// always there are none, and then it does nothing.
func (c *call) noteChanges(changes []BreakerChange) {
	if len(changes) > 0 {
		c.changes = append(c.changes, changes...)
	}
}

// breakerOutcome says what an attempt's outcome tells the host's breaker.
// Network errors and 5xx responses are failures; other responses, 4xx
// included, are successes; an attempt ended by the caller's own context,
// or never sent, counts as neither.
func (c *call) breakerOutcome(o outcome) breakerOutcome {
	switch {
	case o.unsent || (o.err != nil && c.ctx.Err() != nil):
		return outcomeIgnored
	case o.err != nil || o.resp.StatusCode >= 500:
		return outcomeFailure
	}
	return outcomeSuccess
}

// vetoRetry returns why a retry that decide chose must not be made, or ""
// if it may: the host's breaker is open (the retry would only be refused
// after the wait), or the retry budget refuses it.
func (c *call) vetoRetry() Reason {
	if c.t.breakers != nil && c.t.breakers.state(c.host) == BreakerOpen {
		return ReasonCircuitOpen
	}
	if !c.t.cfg.budget.allowRetry(c.host, time.Now()) {
		return ReasonBudgetExhausted
	}
	return ""
}

// outcome is what one attempt produced.
type outcome struct {
	resp    *http.Response // nil if err is set
	err     error
	ctx     context.Context    // the attempt's context
	cancel  context.CancelFunc // ends ctx; call once resp is not needed
	elapsed time.Duration
	unsent  bool // the attempt was not sent: refused, or its body was unavailable
	// bodyRead: the base transport read the request body, which it does
	// only once it has a connection to send it on (set only for a call
	// that watches its body).
	bodyRead bool
}

// attempt sends attempt n, which the host's breaker admitted.
func (c *call) attempt(n int) outcome {
	if n == 1 {
		c.t.cfg.budget.recordFirst(c.host, c.admitted)
	}
	o := outcome{ctx: c.ctx, cancel: func() {}}
	ownCtx := false
	if d := c.t.cfg.attemptTimeout; d > 0 {
		o.ctx, o.cancel = context.WithTimeout(c.ctx, d)
		ownCtx = true
	}
	body, getBody, err := c.body.forAttempt(n)
	if err != nil {
		// Nothing is sent, so nothing will end the attempt's context.
		o.cancel()
		o.err, o.unsent = err, true
		return o
	}
	var watch *bodyWatch
	if c.watchBody && body != nil && body != http.NoBody {
		// The base transport gets a GetBody only if the caller gave one.
		// net/http's HTTP/2 sends a request again by itself after a stream
		// reset that does not prove the server did nothing (PROTOCOL_ERROR),
		// whenever it can rewind the body: the copy the Transport buffered
		// must not let it resend a request that net/http alone would not.
		if c.req.GetBody == nil {
			getBody = nil
		}
		watch = newBodyWatch(body, getBody)
		body = &watch.first
		if getBody != nil {
			getBody = watch.rewind
		}
	}
	var sends *atomic.Int32
	if c.pending && c.key == c.opKey && !c.keySentBefore(n) {
		// Each send net/http makes gets a connection first: more than one
		// means it sent the key again by itself (see resent).
		sends = new(atomic.Int32)
		o.ctx = httptrace.WithClientTrace(o.ctx, &httptrace.ClientTrace{
			GotConn: func(httptrace.GotConnInfo) { sends.Add(1) },
		})
		ownCtx = true
	}
	r := c.attemptRequest(o.ctx, ownCtx)
	r.Body, r.GetBody = body, getBody

	o.resp, o.err = c.t.base.RoundTrip(r)
	if sends != nil && sends.Load() > 1 {
		c.resent = true
	}
	if watch != nil {
		o.bodyRead = watch.read.Load()
	}
	if c.t.cfg.observed() {
		// Only a hook or a logger reads it; a clock reading is not free.
		o.elapsed = time.Since(c.admitted)
	}
	if o.err != nil && o.resp != nil {
		// The base transport broke its contract; keep only the error.
		discard(o.resp)
		o.resp = nil
	}
	if o.err == nil && o.resp == nil {
		o.err = errNilResponse
	}
	if o.resp != nil && o.resp.Request == nil {
		// The attempt sent, as http.Transport names it: a 307 or 308 that
		// http.Client follows takes its key from here.
		o.resp.Request = r
	}
	if o.resp != nil && o.resp.Body == nil {
		// Many RoundTrippers, fakes in tests above all, answer with a nil
		// Body, which http.Client takes for an empty one. So does the
		// Transport: holding, draining or wrapping a nil Body would panic,
		// and in a drain's timer, beyond any recover.
		o.resp.Body = http.NoBody
	}
	return o
}

// headerValue returns the first value of h's field named key, which must be
// in canonical form, as [http.Header.Get] would. Unlike Get it does not
// canonicalize key again, which costs more than the lookup itself.
func headerValue(h http.Header, key string) string {
	if vv := h[key]; len(vv) > 0 {
		return vv[0]
	}
	return ""
}

// callerKey returns the key the caller set in h under the field name key,
// which must be in canonical form, or "" if there is none. http.Header lets
// a caller set a field through its map under any spelling, which is sent as
// written, and a server reads names without regard to case: a key under
// another spelling is the caller's key all the same, and adding a second
// one beside it would send two. The canonical spelling costs one lookup;
// the others are looked for only when it holds no key.
//
// A blank value (empty, or only spaces and tabs) is no key: a field's value
// loses its surrounding white space on the way, and the server reads an
// empty one as no key, so a request sent again on its strength would run
// again. blankField reports whether, without a key, h holds such a field.
func callerKey(h http.Header, key string) (value string, blankField bool) {
	if len(h) == 0 {
		return "", false
	}
	if vv := h[key]; len(vv) > 0 {
		if !blank(vv[0]) {
			return vv[0], false
		}
		blankField = true
	}
	for k, vv := range h {
		// Equal lengths first: EqualFold is dearer, and a name of another
		// length cannot match.
		if len(k) == len(key) && len(vv) > 0 && strings.EqualFold(k, key) {
			if !blank(vv[0]) {
				return vv[0], false
			}
			blankField = true
		}
	}
	return "", blankField
}

// blank reports whether a header field value is empty once the spaces and
// tabs around it are dropped, as they are on the wire.
func blank(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] != ' ' && v[i] != '\t' {
			return false
		}
	}
	return true
}

// keyedRequest is an attempt's copy of the caller's request with room for
// the key field's value. An http.Request's size class has room to spare
// for it, so adding a key costs no allocation of its own.
type keyedRequest struct {
	http.Request
	key [1]string
}

// attemptRequest returns the caller's request as an attempt sends it: a
// copy with ctx as its context, the key added to its header, and a header
// of its own unless the base transport only reads the caller's. ownCtx
// says whether ctx is one the attempt made, rather than the call's own
// (contexts are not compared: a Context need not be a comparable type).
func (c *call) attemptRequest(ctx context.Context, ownCtx bool) *http.Request {
	if c.keyValue != "" && !ownCtx {
		kr := &keyedRequest{Request: *c.req}
		kr.Header = c.attemptHeader(&kr.key)
		return &kr.Request
	}
	// WithContext is the only way to give a request another context.
	r := c.req.WithContext(ctx)
	switch {
	case c.keyValue != "":
		r.Header = c.attemptHeader(new([1]string))
	case !c.t.baseReadsOnly || r.Header == nil || c.dropBlankKey:
		r.Header = c.attemptHeader(nil)
	}
	return r
}

// attemptHeader returns a copy of the caller's header with the key added,
// its value in keySlot (nil when there is no key to add). Every attempt
// gets its own, so nothing a base transport does to it can reach the
// caller or a later attempt. Like http.Header.Clone, it copies all values
// into one backing array, unless the base transport is net/http's, which
// only reads them: then the caller's values themselves are shared.
//
// A key added replaces the caller's field of that name under any spelling:
// callerKey found none but blank ones there, and a blank field sent beside
// the key would make two, which a server reads as a malformed key or takes
// either of. Without a key, a blank field is left out (see dropBlankKey).
func (c *call) attemptHeader(keySlot *[1]string) http.Header {
	src := c.req.Header
	h := make(http.Header, len(src)+1)
	name := c.t.cfg.keyHeader
	drop := keySlot != nil || c.dropBlankKey
	replaced := func(k string) bool { return drop && len(k) == len(name) && strings.EqualFold(k, name) }
	if c.t.baseReadsOnly {
		for k, vv := range src {
			if replaced(k) {
				continue
			}
			h[k] = vv
		}
	} else {
		n := 0
		for _, vv := range src {
			n += len(vv)
		}
		values := make([]string, n)
		for k, vv := range src {
			if replaced(k) {
				continue
			}
			if vv == nil {
				h[k] = nil
				continue
			}
			m := copy(values, vv)
			h[k] = values[:m:m]
			values = values[m:]
		}
	}
	if keySlot != nil {
		keySlot[0] = c.keyValue
		h[c.t.cfg.keyHeader] = keySlot[:]
	}
	return h
}

// decide says whether attempt n is retried, after what wait, and why.
func (c *call) decide(n int, o outcome) (Reason, time.Duration) {
	cfg := &c.t.cfg
	if o.err != nil {
		switch classifyError(o.err, c.ctx, o.ctx) {
		case errFinal:
			if c.ctx.Err() != nil {
				return ReasonCanceled, 0
			}
			return ReasonNotRetryable, 0
		case errTransient:
			if !c.resend {
				return ReasonNotRetryable, 0
			}
		case errNotSent:
			// An error that looks like a failed dial proves nothing once
			// the body has been read: it may be the body's own error,
			// after the header went out.
			if !c.resend && o.bodyRead {
				return ReasonNotRetryable, 0
			}
		}
	} else {
		code := o.resp.StatusCode
		switch {
		case code < 400:
			return ReasonSuccess, 0
		case !c.resend || !retryableStatus(code, o.resp.Header):
			return ReasonNotRetryable, 0
		}
	}

	if !c.body.replayable {
		return ReasonBodyNotReplayable, 0
	}
	if n >= cfg.maxAttempts {
		return ReasonAttemptsExhausted, 0
	}
	reason, wait := ReasonBackoff, cfg.backoff.Delay(n)
	if o.resp != nil {
		if ra, ok := ParseRetryAfter(o.resp.Header.Get("Retry-After"), time.Now()); ok {
			if ra = min(ra, cfg.maxRetryAfter); ra > wait {
				reason, wait = ReasonRetryAfter, ra
			}
		}
	}
	if deadline, ok := c.ctx.Deadline(); ok && time.Until(deadline) <= wait {
		return ReasonWaitPastDeadline, 0
	}
	return reason, wait
}

// report tells the hook and the logger about attempt n.
func (c *call) report(n int, o outcome, reason Reason, wait time.Duration) {
	cfg := &c.t.cfg
	changes := c.changes
	c.changes = nil
	if !cfg.observed() {
		return
	}
	a := Attempt{
		Method:    c.method,
		Host:      c.req.URL.Host,
		Key:       c.key,
		Operation: c.operation,
		Number:    n,
		Sent:      !o.unsent,
		Err:       o.err,
		Elapsed:   o.elapsed,
		Wait:      wait,
		Reason:    reason,

		BreakerChanges: changes,
	}
	if o.resp != nil {
		a.StatusCode = o.resp.StatusCode
	}
	if cfg.hook != nil {
		cfg.hook(a)
	}
	if cfg.logger != nil {
		c.logBreaker(changes)
		c.log(a)
	}
}

// logBreaker logs breaker state changes: opening at Warn, others at Info.
func (c *call) logBreaker(changes []BreakerChange) {
	for _, ch := range changes {
		level := slog.LevelInfo
		if ch.To == BreakerOpen {
			level = slog.LevelWarn
		}
		c.t.cfg.logger.LogAttrs(c.ctx, level, "idemhttp: circuit breaker "+ch.To.String(),
			slog.String("host", ch.Host),
			slog.String("from", ch.From.String()),
			slog.String("to", ch.To.String()))
	}
}

func (c *call) log(a Attempt) {
	level, msg := slog.LevelDebug, "idemhttp: retrying"
	switch {
	case a.Retrying():
	case a.Reason == ReasonSuccess || a.Reason == ReasonNotRetryable || a.Reason == ReasonCanceled:
		return
	case a.Reason == ReasonCircuitOpen && errors.Is(a.Err, ErrCircuitOpen):
		// Refused before sending: one line per request would flood the log
		// while a host is down; the breaker opening is logged at Warn.
		msg = "idemhttp: circuit open, not sent"
	default:
		level, msg = slog.LevelWarn, "idemhttp: giving up"
	}
	if !c.t.cfg.logger.Enabled(c.ctx, level) {
		return
	}
	attrs := []slog.Attr{
		slog.String("method", a.Method),
		slog.String("host", a.Host),
		slog.Int("attempt", a.Number),
		slog.String("reason", string(a.Reason)),
	}
	if a.Key != "" {
		attrs = append(attrs, slog.String("key", a.Key))
	}
	if a.Operation != "" {
		attrs = append(attrs, slog.String("operation", a.Operation))
	}
	if a.Err != nil {
		attrs = append(attrs, slog.String("error", a.Err.Error()))
	} else {
		attrs = append(attrs, slog.Int("status", a.StatusCode))
	}
	if a.Retrying() {
		attrs = append(attrs, slog.Duration("wait", a.Wait))
	}
	c.t.cfg.logger.LogAttrs(c.ctx, level, msg, attrs...)
}

// release forgets the operation's key once its outcome is final and
// delivered, or, for an operation made with HoldKey, leaves it to Settle.
func (c *call) release() {
	switch {
	case c.held != nil:
		c.held.decide(true)
	case c.pending:
		c.keyOwner().releaseKey(c.ctx, c.operation, c.opKey)
	}
}

// releaseKey forgets operation's key. A failure to forget is logged, not
// returned: the response is good, and a key left pending is only sent
// again, which an idempotent server answers by replay. The release runs
// even if ctx has ended: ctx is the request's, and the request is done.
func (t *Transport) releaseKey(ctx context.Context, operation, key string) {
	err := t.cfg.keyStore.Release(context.WithoutCancel(ctx), operation, key)
	if err != nil && t.cfg.logger != nil {
		t.cfg.logger.LogAttrs(ctx, slog.LevelWarn, "idemhttp: releasing key",
			slog.String("operation", operation), slog.String("error", err.Error()))
	}
}

// giveUp builds the error for a request that ends without a response.
func (c *call) giveUp(attempts int, reason Reason, err error) error {
	return &RetryError{Attempts: attempts, Reason: reason, Err: err}
}

// sleep waits for d or until ctx ends, whichever is first, and returns
// ctx's error in the second case.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
