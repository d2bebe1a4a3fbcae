// Package retryafter parses the Retry-After header field, so that the
// client, which waits by it, and the server middleware, which takes a 409
// that carries it for "in progress", agree on which values count.
package retryafter

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// MaxSeconds clamps delta-seconds too large to be meant literally,
// as RFC 9111 section 1.2.2 does for delta-seconds that overflow; it keeps
// the conversion to a Duration from overflowing. Callers cap waits far
// lower.
const MaxSeconds = 1 << 31

// Parse parses the value of a Retry-After header field as RFC 9110
// section 10.2.3 defines it: either a non-negative decimal number of seconds
// (delta-seconds) or an HTTP-date, in any of the three date forms HTTP
// recipients must accept (IMF-fixdate, RFC 850 and asctime).
//
// It returns how long to wait from now, and ok = false when the value is
// malformed, in which case the header must be ignored. A date in the past
// yields a zero wait with ok = true; delta-seconds beyond 2^31 are clamped
// to 2^31 seconds. Leading and trailing spaces and tabs are allowed; signs,
// fractions, other white space and anything after the value are not.
func Parse(value string, now time.Time) (wait time.Duration, ok bool) {
	value = strings.Trim(value, " \t") // optional whitespace is SP and HTAB only
	if value == "" {
		return 0, false
	}
	if isDigits(value) {
		secs, err := strconv.ParseUint(value, 10, 64)
		if err != nil || secs > MaxSeconds { // only overflow can fail here
			secs = MaxSeconds
		}
		return time.Duration(secs) * time.Second, true
	}
	when, err := http.ParseTime(value)
	if err != nil {
		return 0, false
	}
	if d := when.Sub(now); d > 0 {
		return d, true
	}
	return 0, true
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
