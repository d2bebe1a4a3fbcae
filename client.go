package idemhttp

import "net/http"

// NewClient returns an [http.Client] whose transport is a [Transport] over
// [http.DefaultTransport], configured by opts. To wrap another base
// transport, use NewTransport directly:
//
//	client := &http.Client{Transport: idemhttp.NewTransport(base, opts...)}
//
// The client has no overall timeout; bound each request with its context,
// which the Transport also uses to avoid waits that could not finish in
// time.
func NewClient(opts ...Option) *http.Client {
	return &http.Client{Transport: NewTransport(nil, opts...)}
}
