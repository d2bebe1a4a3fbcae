package respcodec

import (
	"net/http"
	"testing"

	"github.com/idemhttp/idemhttp/idemserver"
)

// BenchmarkCodec measures encoding a response of eight header fields and
// decoding it, into a Response and into the packed form replays use:
//
//	go test -run '^$' -bench Codec -benchmem -count 10 ./internal/respcodec/
func BenchmarkCodec(b *testing.B) {
	resp := &idemserver.Response{Status: http.StatusCreated, Header: http.Header{}, Body: []byte(`{"id":"0123456789abcdef","status":"created"}`)}
	for _, name := range []string{"Content-Type", "Location", "X-Request-Id", "Cache-Control", "Etag", "Vary", "X-Ratelimit-Remaining", "Link"} {
		resp.Header[name] = []string{"value of " + name}
	}
	enc := Encode(resp)
	b.Run("op=encode", func(b *testing.B) {
		for b.Loop() {
			Encode(resp)
		}
	})
	b.Run("op=decode", func(b *testing.B) {
		for b.Loop() {
			if _, err := Decode(enc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("op=packed", func(b *testing.B) {
		s := string(enc)
		for b.Loop() {
			if _, err := Packed(s); err != nil {
				b.Fatal(err)
			}
		}
	})
}
