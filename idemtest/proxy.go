package idemtest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"

	"github.com/idemhttp/idemhttp/idemserver"
)

// A Proxy is a standalone HTTP reverse proxy that injects [Faults] into the
// requests it forwards to one target, for tests whose client and server run
// in separate processes: point the client at the proxy's URL. It meets the
// same faults as a [Server], decided the same way (see the package
// documentation), with the idempotency key read from the
// idemserver.DefaultKeyHeader field; a lost response is one the target
// answered and the proxy dropped. When the target cannot be reached the
// proxy answers 502.
type Proxy struct {
	addr     string
	seed     int64
	injector *injector
	server   *http.Server
	upstream *http.Transport
	stop     context.CancelFunc // ends delays, stalls and requests to the target
	served   chan struct{}

	closeOnce sync.Once
}

// NewProxy starts a proxy to target, an http or https URL whose path, if any,
// prefixes the paths of the requests forwarded, listening on a port of its
// own on the loopback interface. It fails with an error wrapping
// [ErrInvalidFaults] if f is invalid. The caller must Close the proxy.
func NewProxy(target string, f Faults, seed int64) (*Proxy, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	u, err := url.Parse(target)
	if err != nil {
		return nil, fmt.Errorf("idemtest: proxy target: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("idemtest: proxy target %q is not an http or https URL with a host", target)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("idemtest: proxy: %w", err)
	}
	ctx, stop := context.WithCancel(context.Background())
	p := &Proxy{
		addr:     ln.Addr().String(),
		seed:     seed,
		upstream: http.DefaultTransport.(*http.Transport).Clone(),
		stop:     stop,
		served:   make(chan struct{}),
	}
	forward := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(u)
			r.Out.Host = r.In.Host
		},
		Transport: p.upstream,
		// The target being down is part of the test, not news.
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			http.Error(w, "idemtest proxy: "+err.Error(), http.StatusBadGateway)
		},
	}
	p.injector = newInjector(forward, f, seed, idemserver.DefaultKeyHeader, ctx.Done(), nil)
	p.server = &http.Server{Handler: p.injector, BaseContext: func(net.Listener) context.Context { return ctx }}
	go func() {
		defer close(p.served)
		_ = p.server.Serve(ln)
	}()
	return p, nil
}

// Addr returns the proxy's address, host:port.
func (p *Proxy) Addr() string { return p.addr }

// URL returns the proxy's base URL, of the form http://ipaddr:port.
func (p *Proxy) URL() string { return "http://" + p.addr }

// Seed returns the seed the proxy's faults are drawn from.
func (p *Proxy) Seed() int64 { return p.seed }

// Stats returns the counts of what the proxy's fault injector did.
func (p *Proxy) Stats() Stats { return p.injector.snapshot() }

// Close ends the proxy's stalls and delays, cancels the requests it is
// forwarding, closes its listener and connections, waits for its handlers to
// return and closes its connections to the target. Close is idempotent and
// returns nil.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.stop()
		_ = p.server.Close() // the listener's error, if any, changes nothing
		<-p.served
		p.injector.close()
		p.upstream.CloseIdleConnections()
	})
	return nil
}
