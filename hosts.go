package idemhttp

import (
	"net"
	"net/url"
	"strings"
	"time"
)

// Defaults for the per-host state of a Transport; see [WithHostLimits].
const (
	// DefaultMaxHosts is how many hosts a Transport keeps breakers and rate
	// limiters for at once.
	DefaultMaxHosts = 1024
	// DefaultIdleHostTimeout is how long a host must go unused before its
	// breaker and rate limiter are forgotten.
	DefaultIdleHostTimeout = 5 * time.Minute
)

// WithHostLimits bounds the per-host state of the Transport: the circuit
// breakers and rate limiters of at most maxHosts hosts are kept (default
// 1024), least recently used forgotten first, and a host unused for longer
// than idle (default 5 minutes) is forgotten. A forgotten host starts afresh
// when it is used again: closed, at the configured rate. Keep idle above the
// breaker's OpenTimeout and Interval so that forgetting a host loses nothing
// it would still act on. Eviction happens while requests are made; the
// Transport starts no goroutine for it. A value of zero or less leaves that
// limit as it was. A [Budget] bounds its own hosts; see [BudgetMaxHosts].
func WithHostLimits(maxHosts int, idle time.Duration) Option {
	return func(c *config) {
		if maxHosts > 0 {
			c.maxHosts = maxHosts
		}
		if idle > 0 {
			c.idleHost = idle
		}
	}
}

// hostKey names the host a request goes to as scheme://host:port, with the
// scheme's default port filled in, so that breakers, rate limiters and
// budgets treat http://a and http://a:80 as one host and http://a and
// https://a as two.
func hostKey(u *url.URL) string {
	scheme := strings.ToLower(u.Scheme)
	port := u.Port()
	if port == "" {
		switch scheme {
		case "https", "wss":
			port = "443"
		default:
			port = "80"
		}
	}
	return scheme + "://" + net.JoinHostPort(strings.ToLower(u.Hostname()), port)
}
