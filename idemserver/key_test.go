package idemserver

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseKey(t *testing.T) {
	long := strings.Repeat("k", MaxKeyLen)
	for _, tt := range []struct {
		name, in, want string
	}{
		{"bare uuid", "8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"quoted uuid", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"surrounding whitespace", " \tabc\t ", "abc"},
		{"bare punctuation", "a!#$%&'()*+,-./:;<=>?@[]^_`{|}~z", "a!#$%&'()*+,-./:;<=>?@[]^_`{|}~z"},
		{"quoted space", `"a b"`, "a b"},
		{"quoted escapes", `"a\"b\\c"`, `a"b\c`},
		{"escape first", `"\\x"`, `\x`},
		{"single character", "x", "x"},
		{"bare 255", long, long},
		{"quoted 255", `"` + long + `"`, long},
		{"quoted 255 escaped", `"` + strings.Repeat(`\\`, MaxKeyLen) + `"`, strings.Repeat(`\`, MaxKeyLen)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseKey(tt.in)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestParseKeyRejects(t *testing.T) {
	for _, tt := range []struct{ name, in string }{
		{"empty", ""},
		{"whitespace", "  "},
		{"256 bare", strings.Repeat("k", 256)},
		{"256 quoted", `"` + strings.Repeat("k", 256) + `"`},
		{"256 quoted escaped", `"` + strings.Repeat(`\"`, 256) + `"`},
		{"NUL", "a\x00b"},
		{"newline", "a\nb"},
		{"DEL", "a\x7fb"},
		{"tab inside quotes", "\"a\tb\""},
		{"non-ASCII", "ключ"},
		{"non-ASCII quoted", `"ключ"`},
		{"space in bare", "a b"},
		{"quote in bare", `a"b`},
		{"backslash in bare", `a\b`},
		{"unterminated", `"abc`},
		{"lone quote", `"`},
		{"trailing text", `"a"b`},
		{"two strings", `"a", "b"`},
		{"parameter", `"a";p=1`},
		{"unknown escape", `"a\nb"`},
		{"escape at end", `"a\`},
		{"empty quoted", `""`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseKey(tt.in)
			assert.ErrorIs(t, err, ErrMalformedKey)
		})
	}
}

func TestFormatKeyRoundTrips(t *testing.T) {
	for _, key := range []string{"abc", `a"b`, `a\b`, "a b", `"\`} {
		got, err := ParseKey(FormatKey(key))
		require.NoError(t, err, key)
		assert.Equal(t, key, got)
	}
}

func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{"abc", `"abc"`, `"a\"b"`, `"a\\b"`, " x ", `"`, `""`, `"a\`, `"a"b`, "a\x00", "é"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := ParseKey(in)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformedKey)
			return
		}
		require.NotEmpty(t, key)
		require.LessOrEqual(t, len(key), MaxKeyLen)
		for i := 0; i < len(key); i++ {
			require.True(t, key[i] >= 0x20 && key[i] < 0x7f, "byte %#x at %d of %q", key[i], i, key)
		}
		// The quoted form parses back to the same key.
		again, err := ParseKey(FormatKey(key))
		require.NoError(t, err)
		require.Equal(t, key, again)
		// A bare key is the input, trimmed.
		if trimmed := strings.Trim(in, " \t"); trimmed[0] != '"' {
			require.Equal(t, trimmed, key)
		}
	})
}
