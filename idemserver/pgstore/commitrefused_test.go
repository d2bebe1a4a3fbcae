package pgstore

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
)

// stateError is an error with a SQLSTATE, as drivers report them.
type stateError string

func (e stateError) Error() string    { return "server error " + string(e) }
func (e stateError) SQLState() string { return string(e) }

// Only the server's own refusal of a COMMIT says that nothing committed;
// every other answer leaves the outcome unknown, and the claim must not be
// released after it.
func TestCommitRefused(t *testing.T) {
	for _, tt := range []struct {
		err     error
		refused bool
	}{
		{stateError("40001"), true},                           // serialization failure
		{stateError("40P01"), true},                           // deadlock
		{fmt.Errorf("commit: %w", stateError("23505")), true}, // deferred unique violation
		{stateError("40003"), false},                          // statement completion unknown
		{stateError("08P01"), false},                          // a pooler's protocol error
		{stateError("57P01"), false},                          // administrator shutdown
		{errors.New("connection reset"), false},
		{nil, false},
	} {
		name := "nil"
		if tt.err != nil {
			name = tt.err.Error()
		}
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, tt.refused, commitRefused(tt.err))
		})
	}
}
