package idemhttp

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/idemhttp/idemhttp/internal/retryafter"
)

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 22, 8, 49, 37, 0, time.UTC)
	tests := []struct {
		name   string
		value  string
		want   time.Duration
		wantOK bool
	}{
		{"delta seconds", "120", 120 * time.Second, true},
		{"zero", "0", 0, true},
		{"surrounding spaces", "  7 ", 7 * time.Second, true},
		{"leading zeros", "007", 7 * time.Second, true},
		{"IMF-fixdate", "Sun, 22 Nov 2026 08:50:37 GMT", time.Minute, true},
		{"RFC 850 date", "Sunday, 22-Nov-26 08:50:37 GMT", time.Minute, true},
		{"asctime date", "Sun Nov 22 08:50:37 2026", time.Minute, true},
		{"past date", "Sun, 22 Nov 2026 08:00:00 GMT", 0, true},
		{"now", "Sun, 22 Nov 2026 08:49:37 GMT", 0, true},
		{"huge delta clamped", "99999999999999999999999", retryafter.MaxSeconds * time.Second, true},
		{"large delta", "4294967296", retryafter.MaxSeconds * time.Second, true},
		{"empty", "", 0, false},
		{"spaces only", "   ", 0, false},
		{"negative", "-5", 0, false},
		{"plus sign", "+5", 0, false},
		{"fraction", "1.5", 0, false},
		{"trailing garbage", "10s", 0, false},
		{"two values", "10, 20", 0, false},
		{"garbage", "soon", 0, false},
		{"date without zone", "Sun, 22 Nov 2026 08:50:37", 0, false},
		{"non-ASCII digits", "١٢", 0, false},
		{"tabs", "\t5\t", 5 * time.Second, true},
		{"no-break space", "\u00a05", 0, false},
		{"unicode space", "5\u2000", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := ParseRetryAfter(tt.value, now)
			assert.Equal(t, tt.wantOK, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}

func FuzzParseRetryAfter(f *testing.F) {
	for _, seed := range []string{
		"0", "120", "-1", "1.5", " 3 ", "99999999999999999999",
		"Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
		"Sun Nov  6 08:49:37 1994", "", "\x00", "Sun, 06 Nov 1994 08:49:37 GMT garbage",
	} {
		f.Add(seed)
	}
	now := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, value string) {
		wait, ok := ParseRetryAfter(value, now)
		if !ok {
			if wait != 0 {
				t.Fatalf("ParseRetryAfter(%q) = %v, false; want 0 with false", value, wait)
			}
			return
		}
		if wait < 0 {
			t.Fatalf("ParseRetryAfter(%q) = %v: negative wait", value, wait)
		}
		if wait > retryafter.MaxSeconds*time.Second && strings.Trim(value, " \t") != "" && strings.Trim(strings.Trim(value, " \t"), "0123456789") == "" {
			t.Fatalf("ParseRetryAfter(%q) = %v: beyond the clamp", value, wait)
		}
	})
}
