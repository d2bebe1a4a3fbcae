package idemserver

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"slices"
)

// A Fingerprint identifies the content of a request: a SHA-256 digest of its
// method, path, query and body (and, for a body that middleware in front of
// the idempotency middleware parsed as a form, that form). Two requests that
// carry the same key must have the same fingerprint; otherwise the second
// is refused with 422.
type Fingerprint [sha256.Size]byte

// String returns the fingerprint in lower-case hexadecimal.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// fingerprintVersion starts every digest, so that a change of encoding can
// never make an old fingerprint match a new one.
const fingerprintVersion = "idemserver fingerprint v1"

// fingerprint returns the Fingerprint of a request. Every part is written
// with its length in front, so no two different requests share an encoding:
// a path ending where the query begins cannot collide with another split.
// The path is the escaped path and the query the raw query, exactly as the
// client sent them.
func fingerprint(method, path, query string, body []byte) Fingerprint {
	return fingerprintForm(method, path, query, body, nil)
}

// fingerprintForm is fingerprint for a request whose form was parsed in
// front of the middleware (see parsedForm); form is nil for any other. The
// form follows the body, after a name that says what it is, so a request
// without one is encoded as fingerprint always encoded it, and none with
// one shares its encoding.
func fingerprintForm(method, path, query string, body, form []byte) Fingerprint {
	// Small requests are encoded on the stack and hashed in one call.
	var buf [1024]byte
	b := appendField(buf[:0], fingerprintVersion)
	b = appendField(b, method)
	b = appendField(b, path)
	b = appendField(b, query)
	b = binary.BigEndian.AppendUint64(b, uint64(len(body)))
	if form == nil && len(b)+len(body) <= len(buf) {
		return sha256.Sum256(append(b, body...))
	}
	h := sha256.New()
	h.Write(bytes.Clone(b))
	h.Write(body)
	if form != nil {
		h.Write(appendField(nil, "parsed form"))
		h.Write(binary.BigEndian.AppendUint64(nil, uint64(len(form))))
		h.Write(form)
	}
	var f Fingerprint
	h.Sum(f[:0])
	return f
}

// errFormFile is a file of a parsed form that could not be read back.
var errFormFile = errors.New("a file of the parsed form could not be read back")

func appendField(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// parsedForm returns an encoding of the form of a request whose form a
// middleware in front of this one parsed (CSRF middleware does, to find
// its token), which consumes a form body: the middleware then reads no
// body, or only what followed a multipart form's closing boundary, and the
// handler reads the form from the request instead (and whatever body is
// left, which the fingerprint covers too). The encoding holds the fields
// the handler reads, sorted by name, and the uploaded files, with their
// contents, so that two requests with different forms do not share a
// fingerprint. It is nil for a request whose form was not parsed or is
// empty, and fails with errBodyTooLarge past max bytes.
// A file it cannot read back (multipart keeps large ones in temporary
// files) fails with errFormFile: the server's fault, not the request's.
func parsedForm(r *http.Request, max int64) ([]byte, error) {
	if len(r.PostForm) == 0 && (r.MultipartForm == nil || len(r.MultipartForm.File) == 0) {
		return nil, nil
	}
	b := appendField(nil, url.Values(r.PostForm).Encode())
	if r.MultipartForm != nil {
		files := r.MultipartForm.File
		for _, name := range slices.Sorted(maps.Keys(files)) {
			b = appendField(b, name)
			b = binary.BigEndian.AppendUint64(b, uint64(len(files[name])))
			for _, fh := range files[name] {
				b = appendField(b, fh.Filename)
				b = appendField(b, fh.Header.Get("Content-Type"))
				b = binary.BigEndian.AppendUint64(b, uint64(fh.Size))
				if int64(len(b))+fh.Size > max {
					return nil, errBodyTooLarge
				}
				f, err := fh.Open()
				if err != nil {
					return nil, fmt.Errorf("%w: %w", errFormFile, err)
				}
				n := len(b)
				b = slices.Grow(b, int(fh.Size))
				m, err := io.ReadFull(f, b[n:n+int(fh.Size)])
				_ = f.Close()
				if err != nil {
					return nil, fmt.Errorf("%w: %w", errFormFile, err)
				}
				b = b[:n+m]
			}
		}
	}
	if int64(len(b)) > max {
		return nil, errBodyTooLarge
	}
	return b, nil
}
