package redisstore

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// A record is one Redis string, so that a claim is one native command (SET
// NX GET) and a replay reads it as a GET would. Its layout, version 1:
//
//	offset  size  field
//	0       1     layout version: 1
//	1       1     state: 'p' in progress, 'c' completed
//	2       32    fingerprint
//	34      8     time, big-endian: the end of the lease ('p') or the
//	              record's expiry ('c'), in microseconds since the Unix
//	              epoch on the middleware's clock, clamped to [0, 2^53-1]
//	              so that Lua's numbers hold it exactly
//	42      2     token length n, big-endian
//	44      n     token: the lease token ('p'), or the token of the lease
//	              that completed the record ('c'), so that a completion sent
//	              again after its reply was lost is told it succeeded
//	44+n    rest  'c' only: the response, in internal/respcodec's encoding;
//	              an in-progress record ends with its token
//
// A record of another version, or one this store did not write, is never
// read as one: the store returns an error wrapping [ErrUnknownVersion] or
// [ErrUnexpectedReply], the middleware answers 503, the handler does not
// run, and the scripts leave the record alone.
const (
	layoutVersion   = 1
	stateInProgress = 'p'
	stateCompleted  = 'c'
	offFingerprint  = 2
	offTime         = offFingerprint + len(idemserver.Fingerprint{})
	offTokenLen     = offTime + 8
	offToken        = offTokenLen + 2
	maxTokenLen     = math.MaxUint16
	maxMicros       = 1<<53 - 1
)

// record is a record as parseRecord reads it; its strings share the
// value's memory.
type record struct {
	completed   bool
	fingerprint idemserver.Fingerprint
	at          time.Time // end of the lease, or expiry
	token       string
	response    string // respcodec's encoding; completed records only
}

// parseRecord reads the record value v.
func parseRecord(v string) (record, error) {
	var r record
	if len(v) > 0 && v[0] != layoutVersion {
		return r, fmt.Errorf("%w %d (this release reads version %d)", ErrUnknownVersion, v[0], layoutVersion)
	}
	if len(v) < offToken {
		return r, fmt.Errorf("%w: a record of %d bytes", ErrUnexpectedReply, len(v))
	}
	n := int(binary.BigEndian.Uint16([]byte(v[offTokenLen:offToken])))
	end := offToken + n
	switch {
	case end > len(v):
		return r, fmt.Errorf("%w: a token of %d bytes in a record of %d", ErrUnexpectedReply, n, len(v))
	case v[1] == stateInProgress && end == len(v):
	case v[1] == stateCompleted && end < len(v):
		r.completed = true
		r.response = v[end:]
	default:
		return r, fmt.Errorf("%w: a record in state %q of %d bytes", ErrUnexpectedReply, v[1], len(v))
	}
	at := binary.BigEndian.Uint64([]byte(v[offTime:offTokenLen]))
	if at > maxMicros {
		return r, fmt.Errorf("%w: a time of %#x µs, past the layout's range", ErrUnexpectedReply, at)
	}
	copy(r.fingerprint[:], v[offFingerprint:offTime])
	r.at = time.UnixMicro(int64(at))
	r.token = v[offToken:end]
	return r, nil
}

// appendInProgress appends the value of an in-progress record to b.
func appendInProgress(b []byte, fp idemserver.Fingerprint, leaseEnd time.Time, token string) []byte {
	b = append(b, layoutVersion, stateInProgress)
	b = append(b, fp[:]...)
	b = appendTime(b, leaseEnd)
	b = binary.BigEndian.AppendUint16(b, uint16(len(token)))
	return append(b, token...)
}

// appendTime appends t as the record's time field.
func appendTime(b []byte, t time.Time) []byte {
	return binary.BigEndian.AppendUint64(b, uint64(micros(t)))
}

// micros returns t in microseconds since the Unix epoch, clamped to the
// range of the record's time field. time.Time saturates far from now (the
// middleware's expiry of a record kept "forever"), and so does this.
func micros(t time.Time) int64 {
	switch {
	case t.Before(time.Unix(0, 0)):
		return 0
	case t.After(time.UnixMicro(maxMicros)):
		return maxMicros
	}
	return t.UnixMicro()
}

// checkToken returns an error for a lease token the layout cannot hold.
func checkToken(token string) error {
	switch {
	case token == "":
		return fmt.Errorf("redisstore: a claim without a lease token")
	case len(token) > maxTokenLen:
		return fmt.Errorf("redisstore: a lease token of %d bytes; at most %d", len(token), maxTokenLen)
	}
	return nil
}
