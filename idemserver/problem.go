package idemserver

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem types. Every response the middleware writes itself is an
// application/problem+json document (RFC 9457) whose "type" member is one
// of these URIs; they are stable, so clients can branch on them. Each URI
// leads to the documentation of its constant.
const (
	// ProblemMalformedKey (400): the key header is not a valid key, or the
	// request carries more than one.
	ProblemMalformedKey = problemBase + "ProblemMalformedKey"
	// ProblemMissingKey (400): the request has no key and the middleware
	// requires one (see [RequireKey]).
	ProblemMissingKey = problemBase + "ProblemMissingKey"
	// ProblemBodyTooLarge (413): the request body is larger than the limit
	// the middleware reads to fingerprint it (see [WithMaxBodyBytes]).
	ProblemBodyTooLarge = problemBase + "ProblemBodyTooLarge"
	// ProblemBodyUnreadable (400, or 408 when reading it timed out): the
	// request body could not be read. The handler did not run. It is 500
	// when a form that middleware in front parsed cannot be read back from
	// the server's temporary files.
	ProblemBodyUnreadable = problemBase + "ProblemBodyUnreadable"
	// ProblemFingerprintMismatch (422): the key was first used for a
	// request with a different method, path, query or body. Retrying will
	// not help; the client must use a new key for a new request.
	ProblemFingerprintMismatch = problemBase + "ProblemFingerprintMismatch"
	// ProblemInProgress (409, with Retry-After): a request with this key
	// is still being processed. Retry the same request later.
	ProblemInProgress = problemBase + "ProblemInProgress"
	// ProblemStoreUnavailable (503, with Retry-After): the middleware could
	// not reach its store, or the store was full of records it may not
	// forget yet ([ErrStoreFull]), or refused claims until its
	// configuration is fixed ([ErrStoreMisconfigured]), or it could not
	// keep the outcome; it did not run the handler or kept nothing it did.
	// The detail member says which. Retry the same request later.
	ProblemStoreUnavailable = problemBase + "ProblemStoreUnavailable"
	// ProblemLeaseLost (503, with Retry-After): the handler ran, but its
	// claim on the key was lost before its response could be stored: it
	// held the key past [WithMaxHold], or its lease could not be renewed,
	// and another request took the key over. The response is withheld,
	// since a retry gets that other request's outcome, not this one. Retry
	// the same request.
	ProblemLeaseLost = problemBase + "ProblemLeaseLost"
	// ProblemRequestCanceled (503, with Retry-After): the request's context
	// ended (the client went away, a deadline set in front of the
	// middleware passed, or the handler held its key past [WithMaxHold])
	// and the handler returned without writing a response. Nothing was
	// stored and the claim was released. Retry the same request.
	ProblemRequestCanceled = problemBase + "ProblemRequestCanceled"
	// ProblemResponseNotStored (replayed with the original status): the
	// request with this key was processed, but its response body was not
	// kept: it was too large (see [WithMaxResponseBytes]), it was
	// streamed without a Content-Length and its first client went away
	// before it had all of it, or it was shorter than the Content-Length
	// the handler declared.
	ProblemResponseNotStored = problemBase + "ProblemResponseNotStored"
)

const problemBase = "https://pkg.go.dev/github.com/idemhttp/idemhttp/idemserver#"

// problem is an RFC 9457 problem details document.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
}

// problemTitle returns the short, fixed summary of a problem type.
func problemTitle(typ string) string {
	switch typ {
	case ProblemMalformedKey:
		return "Malformed idempotency key"
	case ProblemMissingKey:
		return "Idempotency key required"
	case ProblemBodyTooLarge:
		return "Request body too large"
	case ProblemBodyUnreadable:
		return "Request body unreadable"
	case ProblemFingerprintMismatch:
		return "Idempotency key reused for a different request"
	case ProblemInProgress:
		return "Request with this idempotency key in progress"
	case ProblemStoreUnavailable:
		return "Idempotency store unavailable"
	case ProblemLeaseLost:
		return "Idempotency key lost to another request"
	case ProblemRequestCanceled:
		return "Request canceled before the handler answered"
	case ProblemResponseNotStored:
		return "Response of this idempotency key not stored"
	}
	return ""
}

// problemBody returns the JSON document of a problem.
func problemBody(typ string, status int, detail string) []byte {
	b, err := json.Marshal(problem{Type: typ, Title: problemTitle(typ), Status: status, Detail: detail})
	if err != nil { // cannot happen: every field is a string or an int
		panic(err)
	}
	return b
}

// writeProblem writes a problem response. retryAfter, when not empty, is
// sent as the Retry-After field.
func writeProblem(w http.ResponseWriter, typ string, status int, detail, retryAfter string) {
	body := problemBody(typ, status, detail)
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	if retryAfter != "" {
		h.Set("Retry-After", retryAfter)
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
