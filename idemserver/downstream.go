package idemserver

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
)

// KeyFrom returns the key that the middleware claimed for the request whose
// context is ctx, and true; it reports false for any other context, such as
// that of a request without a key or one that was not claimed (a replay
// never reaches the handler). A handler uses it to name what it asks of
// other services by keys derived from its own, with [Key.Derive], so that a
// retry that runs the handler again after a crash is deduplicated by those
// services too.
func KeyFrom(ctx context.Context) (Key, bool) {
	k, ok := ctx.Value(claimedKey{}).(*Key)
	if !ok {
		return Key{}, false
	}
	return *k, true
}

// deriveDomain separates the hashes Derive makes from any other use of
// SHA-256 over the same bytes; its version changes if the encoding does.
const deriveDomain = "idemhttp/idemserver Key.Derive v1\x00"

// Derive returns an idempotency key for a request that the handler of k
// sends to another service, such as a payment provider; label names that
// request among the handler's requests ("charge", "refund", "email"). Send
// it as that request's Idempotency-Key.
//
// The result depends on the scope, the key and the label alone, and will
// not change between versions or processes, so every run of a handler for
// one key, including a run after a crash or a takeover, derives the same
// key for the same label. Different scopes, keys or labels give different
// keys: the three are hashed with SHA-256 in an encoding that prefixes
// each with its length, so no two combinations share an input. The result
// is the 43-character unpadded base64url encoding of the hash, a valid key
// for [ParseKey] and for most services' key syntax; it reveals neither the
// scope nor the key.
//
// Since the request's body is not part of it, a client that sends a key
// again for a different request after the key's record has expired gets
// the same derived key, and a service that keeps keys longer than this
// middleware would answer that request with the first one's outcome. Keys
// name one operation each, as idemhttp's client makes them; a service
// whose clients may reuse theirs should keep records at least as long as
// the services its handlers call.
func (k Key) Derive(label string) string {
	h := sha256.New()
	var buf [binary.MaxVarintLen64]byte
	h.Write([]byte(deriveDomain))
	for _, s := range [...]string{k.Scope, k.Key, label} {
		h.Write(binary.AppendUvarint(buf[:0], uint64(len(s))))
		h.Write([]byte(s))
	}
	var sum [sha256.Size]byte
	return base64.RawURLEncoding.EncodeToString(h.Sum(sum[:0]))
}
