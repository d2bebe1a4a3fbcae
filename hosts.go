package idemhttp

import (
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
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
	host := u.Hostname()
	// Names of hosts are compared without regard to case; an IPv6 zone
	// names a network interface, whose name is not: fe80::1%eth0 and
	// fe80::1%ETH0 may be two hosts.
	addr, zone, hasZone := strings.Cut(host, "%")
	host = strings.ToLower(addr)
	if hasZone {
		host += "%" + zone
	}
	return scheme + "://" + net.JoinHostPort(host, port)
}

// hostKeys remembers the hostKey of each (scheme, authority) a Transport
// has seen, so that requests to a known host do not build the same string
// again. It holds at most max entries and starts afresh when full. The
// entry used last is kept apart too: most requests go where the one before
// went, and comparing two short strings costs less than hashing them
// under a lock.
type hostKeys struct {
	last atomic.Pointer[hostKeyEntry]
	mu   sync.RWMutex
	m    map[hostID]*hostKeyEntry
	max  int
}

type hostID struct{ scheme, host string }

// hostKeyEntry is a remembered hostKey. Entries are never changed, so the
// one in last can be read without a lock.
type hostKeyEntry struct {
	id  hostID
	key string
}

func newHostKeys(max int) *hostKeys {
	return &hostKeys{m: make(map[hostID]*hostKeyEntry), max: max}
}

// get returns hostKey(u).
func (h *hostKeys) get(u *url.URL) string {
	if e := h.last.Load(); e != nil && e.id.host == u.Host && e.id.scheme == u.Scheme {
		return e.key
	}
	id := hostID{u.Scheme, u.Host}
	h.mu.RLock()
	e := h.m[id]
	h.mu.RUnlock()
	if e == nil {
		// Clone: u's strings may share memory with a long request URL.
		e = &hostKeyEntry{id: hostID{strings.Clone(id.scheme), strings.Clone(id.host)}, key: hostKey(u)}
		h.mu.Lock()
		if len(h.m) >= h.max {
			clear(h.m)
		}
		h.m[e.id] = e
		h.mu.Unlock()
	}
	h.last.Store(e)
	return e.key
}
