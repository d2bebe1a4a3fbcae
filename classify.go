package idemhttp

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"strings"
	"syscall"
	"time"
)

// idempotentMethod reports whether RFC 9110 section 9.2.2 defines method as
// idempotent, so that sending it twice has the effect of sending it once.
func idempotentMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace,
		http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// retryableStatus reports whether a response with this status may succeed
// if the request is sent again. A 409 qualifies only with a valid
// Retry-After, the way an idempotency-aware server says "the first request
// with this key is still in progress"; any other 409 is a real conflict. A
// Retry-After that does not parse is ignored, as it is for the wait, so a
// 409 carrying only such a value is a conflict too.
func retryableStatus(code int, header http.Header) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests,
		http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	case http.StatusConflict:
		// Validity does not depend on the time: any instant will do.
		_, ok := ParseRetryAfter(header.Get("Retry-After"), time.Time{})
		return ok
	}
	return false
}

// finalStatus reports whether a response ends an operation for good, so its
// idempotency key can be forgotten: a success, a 3xx that [http.Client]
// would not follow, or a client error that sending again would not change.
// A 307 or 308 asks for the same request to be sent elsewhere, where it has
// yet to run. A 301, 302 or 303 with a Location is the server's outcome,
// but http.Client follows it with a GET, and the caller gets that GET's
// outcome instead: until then the caller knows nothing of the operation's.
// Neither is final even when the caller stops http.Client from following
// it, which the Transport cannot tell.
func finalStatus(code int, header http.Header) bool {
	switch {
	case followedRedirect(code, header):
		return false
	case code == http.StatusTemporaryRedirect || code == http.StatusPermanentRedirect:
		return false
	case code < 400:
		return true
	}
	return code < 500 && !retryableStatus(code, header)
}

// followedRedirect reports whether [http.Client] follows a response with
// this status and header to another request: a 301, 302, 303, 307 or 308
// with a Location.
func followedRedirect(code int, header http.Header) bool {
	switch code {
	case http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther,
		http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		return header.Get("Location") != ""
	}
	return false
}

// errorClass is what an attempt's error says about retrying it.
type errorClass int

const (
	// errFinal: retrying cannot help (a TLS verification failure, a
	// malformed request) or is not ours to do (the caller's context ended).
	errFinal errorClass = iota
	// errTransient: the attempt failed in a way that may not recur, but the
	// server may have received and acted on the request.
	errTransient
	// errNotSent: the attempt failed before any byte of the request could
	// reach the server, so even a non-idempotent request may be resent.
	errNotSent
)

// classifyError sorts an attempt's error. attemptCtx is the context the
// attempt ran with; callerCtx is the caller's. Unknown errors are final: a
// retry library must not guess that an unrecognised failure is harmless.
func classifyError(err error, callerCtx, attemptCtx context.Context) errorClass {
	if callerCtx.Err() != nil {
		return errFinal
	}
	if attemptCtx.Err() != nil {
		return errTransient // the attempt timed out
	}

	var (
		unknownAuthority x509.UnknownAuthorityError
		hostname         x509.HostnameError
		invalidCert      x509.CertificateInvalidError
		verification     *tls.CertificateVerificationError
		recordHeader     tls.RecordHeaderError
	)
	if errors.As(err, &unknownAuthority) || errors.As(err, &hostname) ||
		errors.As(err, &invalidCert) || errors.As(err, &verification) ||
		errors.As(err, &recordHeader) {
		return errFinal
	}

	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		if dnsErr.IsTimeout || dnsErr.IsTemporary {
			return errNotSent
		}
		return errFinal // the name does not exist; asking again will not help
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return errNotSent
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return errNotSent
	}
	if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ECONNABORTED) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return errTransient
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return errTransient
	}
	if isTruncatedResponse(err) {
		return errTransient
	}
	if isHTTP2Transient(err) {
		return errTransient
	}
	return errFinal
}

// isTruncatedResponse recognises a response whose status line or header
// block could not be parsed, which is what a connection cut in the middle
// of them looks like: net/http reports the bytes it got as malformed rather
// than as an unexpected EOF, unless the cut falls at the end of a line.
// Like any response lost in transit, it says nothing of whether the server
// acted. A server that really sends garbage is retried too, within the
// attempt limit, which costs a few attempts and breaks nothing.
func isTruncatedResponse(err error) bool {
	var header textproto.ProtocolError
	if errors.As(err, &header) {
		return true // "malformed MIME header...": the header block
	}
	// The status line: net/http's errors for it have no type of their own.
	msg := err.Error()
	return strings.Contains(msg, "malformed HTTP response") ||
		strings.Contains(msg, "malformed HTTP status code") ||
		strings.Contains(msg, "malformed HTTP version")
}

// isHTTP2Transient recognises HTTP/2 connection shutdowns and stream resets.
// net/http's HTTP/2 error types are unexported, so their messages are the
// only stable signal. A GOAWAY reaches the caller in three forms: the
// connection closed after it ("server sent GOAWAY"), the request's stream
// beyond its last stream id when it carries an error code ("Transport
// received GOAWAY from server"), and net/http's own retry of a graceful
// one that it could not make ("received Server's graceful shutdown
// GOAWAY").
func isHTTP2Transient(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "http2: server sent GOAWAY") ||
		strings.Contains(msg, "http2: Transport received GOAWAY") ||
		strings.Contains(msg, "http2: Transport received Server's graceful shutdown GOAWAY") ||
		strings.Contains(msg, "stream error: stream ID") ||
		strings.Contains(msg, "http2: client connection lost") ||
		strings.Contains(msg, "http: server closed idle connection")
}
