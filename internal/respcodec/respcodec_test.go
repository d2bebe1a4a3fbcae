package respcodec

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

var samples = []struct {
	name string
	resp *idemserver.Response
}{
	{"status only", &idemserver.Response{Status: http.StatusNoContent}},
	{"fields and body", &idemserver.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Link": {"</a>", "</b>"}, "X-Empty": {""}, "X-None": {}},
		Body:   []byte(`{"id":1}`),
	}},
	{"binary body", &idemserver.Response{Status: http.StatusOK, Body: []byte{0, 1, 2, 0xff, 0x80}}},
	{"large body", &idemserver.Response{Status: http.StatusOK, Body: bytes.Repeat([]byte("0123456789abcdef"), 1<<16)}},
	{"body omitted", &idemserver.Response{Status: http.StatusCreated, Header: http.Header{"Location": {"/x"}}, BodyOmitted: true}},
	{"highest status", &idemserver.Response{Status: 999}},
	{"long field", &idemserver.Response{Status: http.StatusOK, Header: http.Header{"X-Long": {strings.Repeat("v", 300)}}}},
}

// normal returns resp as Decode returns it: no empty header or body, and
// no body when it was omitted.
func normal(resp *idemserver.Response) *idemserver.Response {
	c := *resp
	if len(c.Header) == 0 {
		c.Header = nil
	}
	if len(c.Body) == 0 || c.BodyOmitted {
		c.Body = nil
	}
	return &c
}

func TestRoundTrip(t *testing.T) {
	for _, tt := range samples {
		t.Run(tt.name, func(t *testing.T) {
			b := Encode(tt.resp)
			assert.Len(t, b, Size(tt.resp), "Size")
			assert.Equal(t, byte(Version), b[0])
			got, err := Decode(b)
			require.NoError(t, err)
			assert.Equal(t, normal(tt.resp), got)
		})
	}
}

func TestAppendExtends(t *testing.T) {
	resp := samples[1].resp
	b := Append([]byte("prefix"), resp)
	assert.Equal(t, "prefix", string(b[:6]))
	got, err := Decode(b[6:])
	require.NoError(t, err)
	assert.Equal(t, normal(resp), got)
}

func TestDecodedValuesAreIndependent(t *testing.T) {
	// Appending to one field's values must not write into another's.
	got, err := Decode(Encode(&idemserver.Response{Status: 200, Header: http.Header{"A": {"1"}, "B": {"2"}}}))
	require.NoError(t, err)
	got.Header["A"] = append(got.Header["A"], "x")
	assert.Equal(t, []string{"2"}, got.Header["B"])
}

func TestDecodeUnknownVersion(t *testing.T) {
	// An encoding written by a later release is refused, never misread.
	for _, v := range []byte{0, 2, 0xff} {
		b := Encode(samples[1].resp)
		b[0] = v
		_, err := Decode(b)
		require.ErrorIs(t, err, ErrUnknownVersion)
		assert.NotErrorIs(t, err, ErrCorrupt)
		assert.Contains(t, err.Error(), "version")
		_, err = Packed(string(b))
		require.ErrorIs(t, err, ErrUnknownVersion, "Packed")
	}
}

func TestDecodeCorrupt(t *testing.T) {
	valid := Encode(samples[1].resp)
	for _, tt := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"version only", []byte{Version}},
		{"status below 100", []byte{Version, 99, 0, 0, 0}},
		{"status above 999", []byte{Version, 0xe8, 0x07, 0, 0, 0}},
		{"unknown flag", []byte{Version, 200, 1, 2, 0, 0}},
		{"field count too large", []byte{Version, 200, 1, 0, 100, 0}},
		{"name past the end", []byte{Version, 200, 1, 0, 1, 9, 'a', 0, 0}},
		{"duplicate field", []byte{Version, 200, 1, 0, 2, 1, 'A', 0, 1, 'A', 0, 0}},
		{"body length too large", []byte{Version, 200, 1, 0, 0, 3, 'a', 'b'}},
		{"bytes after the body", []byte{Version, 200, 1, 0, 0, 1, 'a', 'b'}},
		{"body and the omitted flag", []byte{Version, 200, 1, 1, 0, 1, 'a'}},
		{"uvarint not in its shortest form", []byte{Version, 0xc8, 0x81, 0x00, 0, 0, 0}},
		{"overlong uvarint", []byte{Version, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}},
		{"truncated", valid[:len(valid)-1]},
		{"extended", append(bytes.Clone(valid), 'x')},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := Decode(tt.b)
			assert.ErrorIs(t, err, ErrCorrupt)
			assert.Nil(t, resp)
			p, err := Packed(string(tt.b))
			assert.ErrorIs(t, err, ErrCorrupt, "Packed")
			assert.True(t, p.IsZero(), "Packed")
		})
	}
}

func TestDecodeEveryPrefixFails(t *testing.T) {
	// A cut anywhere is detected: no prefix of an encoding is another one.
	for _, tt := range samples[:5] {
		b := Encode(tt.resp)
		for i := range len(b) {
			_, err := Decode(b[:i])
			require.Error(t, err, "%s cut at %d of %d", tt.name, i, len(b))
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, tt := range samples {
		if len(tt.resp.Body) < 1024 {
			f.Add(Encode(tt.resp))
		}
	}
	f.Add([]byte{})
	f.Add([]byte{2, 200, 1, 0, 0, 0})
	f.Add([]byte{Version, 200, 1, 0, 2, 1, 'A', 0, 1, 'A', 0, 0})
	f.Add([]byte{Version, 0xc8, 0x01, 0, 1, 1, 'A', 3, 0, 1, 'x', 2, 'y', 'z', 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		resp, err := Decode(b)
		if err != nil {
			require.Nil(t, resp)
			_, err := Packed(string(b))
			require.Error(t, err, "Packed read what Decode refused")
			return
		}
		require.GreaterOrEqual(t, resp.Status, 100)
		require.LessOrEqual(t, resp.Status, 999)
		// What decodes encodes to an encoding of the same size that
		// decodes to the same response.
		again := Encode(resp)
		require.Len(t, again, len(b))
		resp2, err := Decode(again)
		require.NoError(t, err)
		require.Equal(t, resp, resp2)
		// Packed reads what Decode reads, unless the packed form itself
		// refuses the response (an interim status, which no replay may
		// send; a field without a name); AppendPacked writes it back.
		p, err := Packed(string(b))
		if err != nil {
			asPacked, _ := idemserver.PackResponse(resp).AppendBinary(nil)
			_, perr := idemserver.ParsePackedResponse(string(asPacked))
			require.Error(t, perr, "Packed refused a response the packed form holds: %v", err)
			return
		}
		require.Equal(t, resp, p.Response())
		back, err := AppendPacked(nil, p)
		require.NoError(t, err)
		require.Len(t, back, len(b))
	})
}

func TestPackedTranslations(t *testing.T) {
	// The translations to and from idemserver's packed form give what
	// decoding and packing a Response would, in either direction.
	for _, tt := range samples {
		t.Run(tt.name, func(t *testing.T) {
			want := normal(tt.resp)
			p, err := Packed(string(Encode(tt.resp)))
			require.NoError(t, err)
			assert.Equal(t, want, normal(p.Response()), "Packed")

			b, err := AppendPacked([]byte("prefix"), idemserver.PackResponse(tt.resp))
			require.NoError(t, err)
			require.Equal(t, "prefix", string(b[:6]))
			assert.Len(t, b[6:], Size(tt.resp), "AppendPacked writes what Append would")
			got, err := Decode(b[6:])
			require.NoError(t, err)
			assert.Equal(t, want, got, "AppendPacked")
			if len(tt.resp.Header) <= 1 {
				// The same bytes, when the fields' order cannot differ.
				assert.Equal(t, Encode(tt.resp), b[6:])
			}
		})
	}
}

func TestPackedStatusNotReplayable(t *testing.T) {
	// A status that the encoding allows but no replay does is refused,
	// rather than handed to the middleware.
	_, err := Packed(string(Encode(&idemserver.Response{Status: http.StatusContinue})))
	require.Error(t, err)
}

func TestAppendPackedZero(t *testing.T) {
	_, err := AppendPacked(nil, idemserver.PackedResponse{})
	require.ErrorIs(t, err, ErrCorrupt)
}

func TestPackedRefusesWhatDecodeRefuses(t *testing.T) {
	valid := Encode(samples[1].resp)
	for _, b := range [][]byte{
		nil,
		{Version},
		{Version, 99, 0, 0, 0},
		{Version, 200, 1, 2, 0, 0},
		{Version, 200, 1, 0, 2, 1, 'A', 0, 1, 'A', 0, 0},
		{Version, 200, 1, 0, 0, 1, 'a', 'b'},
		{Version, 200, 1, 1, 0, 1, 'a'},
		valid[:len(valid)-1],
	} {
		_, errDecode := Decode(b)
		require.Error(t, errDecode, "%q", b)
		_, err := Packed(string(b))
		require.ErrorIs(t, err, ErrCorrupt, "%q", b)
	}
	b := Encode(samples[1].resp)
	b[0] = Version + 1
	_, err := Packed(string(b))
	require.ErrorIs(t, err, ErrUnknownVersion)
}
