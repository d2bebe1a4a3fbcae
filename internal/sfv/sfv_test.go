package sfv

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestQuoteUnquote(t *testing.T) {
	for _, tt := range []struct{ s, quoted string }{
		{"", `""`},
		{"abc", `"abc"`},
		{`a"b\c`, `"a\"b\\c"`},
		{" spaced out ", `" spaced out "`},
	} {
		assert.Equal(t, tt.quoted, Quote(tt.s))
		got, err := Unquote(tt.quoted)
		require.NoError(t, err, tt.quoted)
		assert.Equal(t, tt.s, got)
	}
}

func TestUnquoteRejects(t *testing.T) {
	for _, v := range []string{"", "abc", `"abc`, `"a"b`, `"a";p=1`, `"a\nb"`, `"a\`, "\"a\x01\"", "\"é\""} {
		_, err := Unquote(v)
		assert.Error(t, err, v)
	}
}
