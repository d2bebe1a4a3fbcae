package varint

import (
	"encoding/binary"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestLenMatchesAppendUvarint(t *testing.T) {
	for _, v := range []uint64{0, 1, 0x7f, 0x80, 0x3fff, 0x4000, 1 << 35, math.MaxUint32, math.MaxUint64} {
		assert.Equal(t, len(binary.AppendUvarint(nil, v)), Len(v), "v=%d", v)
	}
}

func TestWriteMatchesAppendUvarint(t *testing.T) {
	for _, v := range []uint64{0, 1, 0x7f, 0x80, 0x3fff, 0x4000, 1 << 35, math.MaxUint32, math.MaxUint64} {
		var b strings.Builder
		b.WriteString("x")
		Write(&b, v)
		assert.Equal(t, string(binary.AppendUvarint([]byte("x"), v)), b.String(), "v=%d", v)
	}
}

func TestUvarintMatchesBinary(t *testing.T) {
	inputs := [][]byte{nil, {0}, {0x7f}, {0x80}, {0x80, 0x01}, {0xff, 0xff, 0x03},
		binary.AppendUvarint(nil, math.MaxUint64),
		{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02},
		{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
		{0x80, 0x80}}
	for _, b := range inputs {
		wantV, wantN := binary.Uvarint(b)
		v, n := Uvarint(b)
		assert.Equal(t, wantV, v, "% x", b)
		assert.Equal(t, wantN, n, "% x", b)
		v, n = Uvarint(string(b))
		assert.Equal(t, wantV, v, "string % x", b)
		assert.Equal(t, wantN, n, "string % x", b)
	}
}
