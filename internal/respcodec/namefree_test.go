package respcodec

import (
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestFieldWithoutANameNeverStored(t *testing.T) {
	// What a store keeps must be what a replay reads back. A field with an
	// empty name (net/http does not send one) is left out by Append,
	// refused by AppendPacked, and refused by both decoders alike.
	resp := &idemserver.Response{Status: http.StatusCreated, Header: http.Header{"": {"x"}, "A": {"1"}}, Body: []byte("ok")}
	got, err := Decode(Encode(resp))
	require.NoError(t, err)
	assert.Equal(t, http.Header{"A": {"1"}}, got.Header)

	_, err = AppendPacked(nil, idemserver.PackResponse(resp))
	require.ErrorIs(t, err, ErrCorrupt)

	// An encoding with a nameless field: status 201, no flags, one field
	// "" with one value "x", body "ok".
	enc := "\x01\xc9\x01\x00\x01\x00\x01\x01x\x02ok"
	_, derr := Decode([]byte(enc))
	_, perr := Packed(enc)
	require.ErrorIs(t, derr, ErrCorrupt)
	require.ErrorIs(t, perr, ErrCorrupt)
}

func TestOneEncodingPerResponse(t *testing.T) {
	// The fields go in the order of their names, not the map's.
	h := http.Header{}
	for i := range 16 {
		h.Set("X-Field-"+strconv.Itoa(i), "v")
	}
	resp := &idemserver.Response{Status: http.StatusOK, Header: h, Body: []byte("b")}
	first := Encode(resp)
	for range 20 {
		require.Equal(t, first, Encode(resp))
	}
}
