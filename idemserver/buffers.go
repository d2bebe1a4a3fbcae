package idemserver

import (
	"context"
	"sync"
	"time"
)

// buffers are the byte buffers of one keyed request: the request body,
// read to fingerprint it, and the header fields and body of the response
// the recorder holds back. They live only as long as the request, so they
// are reused from one request to the next through bufferPool.
//
// Nothing that outlives the request may point into them: the store copies
// what it keeps, and the reader and recorder that handed them to the
// handler let go of them before they go back to the pool.
type buffers struct {
	reqBody  []byte
	fields   []byte
	respBody []byte
	// call is the context of the request's store calls, one at a time,
	// kept for the next call while no store could be watching it.
	call *callContext
}

// storeCall returns the context of a store call under parent that must
// end within d; endCall must follow the call.
func (b *buffers) storeCall(parent context.Context, deadline time.Time) *callContext {
	if b.call == nil {
		b.call = new(callContext)
	}
	b.call.start(parent, deadline)
	return b.call
}

// endCall ends the deadline of c, from storeCall, and lets go of it if a
// store could still be watching it, or kept is set: a store handed back a
// context derived from it.
func (b *buffers) endCall(c *callContext, kept bool) {
	if !c.stop() || kept {
		b.call = nil
	}
}

// maxPooledBuffer is the largest buffer kept for reuse, so that one request
// with a large body does not keep that much memory for good.
const maxPooledBuffer = 64 << 10

// bufferPool holds buffers for reuse; sync.Pool drops what stays unused
// through two garbage collections. It is the package's only mutable state
// outside the values its functions return.
var bufferPool = sync.Pool{New: func() any { return new(buffers) }}

func getBuffers() *buffers { return bufferPool.Get().(*buffers) }

// put returns b to the pool, without the buffers that grew too large.
func (b *buffers) put() {
	// A call that did not end with endCall (its store panicked) is ended
	// here, and let go of if a store could still be watching it: its
	// timer and its watch of its parent would end the next call.
	if b.call != nil && !b.call.stop() {
		b.call = nil
	}
	b.reqBody = reusable(b.reqBody)
	b.fields = reusable(b.fields)
	b.respBody = reusable(b.respBody)
	bufferPool.Put(b)
}

func reusable(buf []byte) []byte {
	if cap(buf) > maxPooledBuffer {
		return nil
	}
	return buf[:0]
}
