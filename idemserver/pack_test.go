package idemserver

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSameFields(t *testing.T) {
	packed := appendFields(nil, http.Header{"A": {"1", ""}, "B": nil})
	for _, tt := range []struct {
		name string
		h    http.Header
		same bool
	}{
		{"equal", http.Header{"A": {"1", ""}, "B": nil}, true},
		{"empty values equal nil", http.Header{"A": {"1", ""}, "B": {}}, true},
		{"field without values missing", http.Header{"A": {"1", ""}}, false},
		{"field without values renamed", http.Header{"A": {"1", ""}, "C": nil}, false},
		{"value changed", http.Header{"A": {"1", "x"}, "B": nil}, false},
		{"value added", http.Header{"A": {"1", "", "2"}, "B": nil}, false},
		{"value removed", http.Header{"A": {"1"}, "B": nil}, false},
		{"field added", http.Header{"A": {"1", ""}, "B": nil, "D": {"4"}}, false},
		{"name case differs", http.Header{"a": {"1", ""}, "B": nil}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.same, sameFields(tt.h, packed))
		})
	}
	assert.True(t, sameFields(http.Header{}, nil))
	assert.False(t, sameFields(http.Header{"A": nil}, nil))
}

func TestHasField(t *testing.T) {
	packed := appendFields(nil, http.Header{"Vary": {"Origin"}, "X-Request-Id": {"r1"}})
	assert.True(t, hasField(packed, "Vary", []string{"Origin"}))
	assert.False(t, hasField(packed, "Vary", []string{"Origin", "Accept"}), "appended to")
	assert.False(t, hasField(packed, "X-Request-Id", []string{"r2"}), "replaced")
	assert.False(t, hasField(packed, "Content-Type", []string{"text/plain"}), "added")
	assert.False(t, hasField(nil, "Vary", []string{"Origin"}))
}
