package varint

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestLenMatchesAppendUvarint(t *testing.T) {
	for _, v := range []uint64{0, 1, 0x7f, 0x80, 0x3fff, 0x4000, 1 << 35, math.MaxUint32, math.MaxUint64} {
		assert.Equal(t, len(binary.AppendUvarint(nil, v)), Len(v), "v=%d", v)
	}
}
