package idemhttp

import (
	"time"

	"github.com/idemhttp/idemhttp/internal/retryafter"
)

// ParseRetryAfter parses the value of a Retry-After header field as RFC 9110
// section 10.2.3 defines it: either a non-negative decimal number of seconds
// (delta-seconds) or an HTTP-date, in any of the three date forms HTTP
// recipients must accept (IMF-fixdate, RFC 850 and asctime).
//
// It returns how long to wait from now, and ok = false when the value is
// malformed, in which case the header must be ignored. A date in the past
// yields a zero wait with ok = true; delta-seconds beyond 2^31 are clamped
// to 2^31 seconds. Leading and trailing spaces and tabs are allowed; signs,
// fractions, other white space and anything after the value are not.
func ParseRetryAfter(value string, now time.Time) (wait time.Duration, ok bool) {
	return retryafter.Parse(value, now)
}
