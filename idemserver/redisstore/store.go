package redisstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

// DefaultPrefix is the prefix of the Redis keys of a [Store] made without
// [WithPrefix].
const DefaultPrefix = "idem:"

// LeaseMargin is how long an in-progress record outlives the end of its
// lease in Redis before it expires there. Until then the record shows the
// ended lease, which the middleware takes over and its holder may still
// extend; after it, the key is simply absent.
const LeaseMargin = time.Minute

// ErrUnexpectedReply means Redis answered a script with something the
// store did not write, such as a record that another program changed.
var ErrUnexpectedReply = errors.New("redisstore: unexpected reply")

// Store is an [idemserver.Store] that keeps records in Redis. See the
// package documentation for the model; a Store is safe for concurrent use.
type Store struct {
	client                           redis.UniversalClient
	prefix                           string
	now                              func() time.Time
	claim, complete, release, extend *redis.Script
}

// An Option configures a [Store].
type Option func(*Store)

// WithPrefix sets the prefix of the store's Redis keys, DefaultPrefix
// unless set. Stores with different prefixes share a Redis without seeing
// each other's records. A prefix with a hash tag of its own ("{idem}:")
// puts every record in that tag's Cluster slot.
func WithPrefix(p string) Option {
	return func(s *Store) { s.prefix = p }
}

// WithClock sets the clock the store reads to turn the times that
// Complete and Extend are given into durations: it must be the
// middleware's (see [idemserver.WithClock]). Nil means time.Now, the
// middleware's default.
func WithClock(now func() time.Time) Option {
	return func(s *Store) {
		if now == nil {
			now = time.Now
		}
		s.now = now
	}
}

// New returns a store that keeps its records in the Redis that client
// reaches: a single server, a Sentinel-managed one or a Cluster, but not a
// Ring (see the package documentation). The store does not close the
// client.
func New(client redis.UniversalClient, opts ...Option) *Store {
	s := &Store{
		client:   client,
		prefix:   DefaultPrefix,
		now:      time.Now,
		claim:    redis.NewScript(claimScript),
		complete: redis.NewScript(completeScript),
		release:  redis.NewScript(releaseScript),
		extend:   redis.NewScript(extendScript),
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Claim implements [idemserver.Store] in one round trip.
func (s *Store) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	return s.run(ctx, c, false, "")
}

// TakeOver implements [idemserver.Store] in one round trip. It replaces
// the record only while its lease has ended by the Redis server's clock,
// so a lease its holder extended in the meantime is not taken.
func (s *Store) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	return s.run(ctx, c, true, expiredToken)
}

func (s *Store) run(ctx context.Context, c idemserver.Claim, takeOver bool, expiredToken string) (idemserver.ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return idemserver.ClaimResult{}, err
	}
	if c.Token == "" {
		return idemserver.ClaimResult{}, errors.New("redisstore: claim without a lease token")
	}
	args := make([]any, 4, 5)
	args[0] = c.Fingerprint[:]
	args[1] = c.Token
	args[2] = micros(c.LeaseExpires.Sub(c.Now))
	args[3] = micros(LeaseMargin)
	if takeOver {
		args = append(args, expiredToken)
	}
	reply, err := s.claim.Run(ctx, s.client, []string{recordKey(s.prefix, c.Key)}, args...).Slice()
	if err != nil {
		return idemserver.ClaimResult{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	return parseClaim(reply, c.Now)
}

// parseClaim reads the reply of claimScript. Durations in it become times
// relative to now, the claim's time: the middleware compares the times of
// a record only with that.
func parseClaim(reply []any, now time.Time) (idemserver.ClaimResult, error) {
	var res idemserver.ClaimResult
	code, ok := at[int64](reply, 0)
	if !ok {
		return res, fmt.Errorf("%w to a claim: %v", ErrUnexpectedReply, reply)
	}
	if code == 1 {
		res.Claimed = true
		return res, nil
	}
	fp, ok1 := at[string](reply, 1)
	str, ok2 := at[string](reply, 2)
	left, ok3 := at[int64](reply, 3)
	if code != 2 && code != 3 || !ok1 || !ok2 || !ok3 || len(fp) != len(res.Record.Fingerprint) {
		return res, fmt.Errorf("%w to a claim: %d fields, code %d", ErrUnexpectedReply, len(reply), code)
	}
	copy(res.Record.Fingerprint[:], fp)
	at := now.Add(time.Duration(left) * time.Microsecond)
	if code == 3 {
		res.Record.Token = str
		res.Record.LeaseExpires = at
		return res, nil
	}
	resp, err := respcodec.Decode([]byte(str))
	if err != nil {
		return res, fmt.Errorf("redisstore: stored response: %w", err)
	}
	res.Record.Response = resp
	res.Record.Expires = at
	return res, nil
}

// at returns reply[i] as a T, and whether it is one.
func at[T any](reply []any, i int) (T, bool) {
	if i >= len(reply) {
		var zero T
		return zero, false
	}
	v, ok := reply[i].(T)
	return v, ok
}

// Complete implements [idemserver.Store] in one round trip. The record
// expires in Redis at expires, by the server's clock: the store keeps it
// for as long as expires is from now on the store's clock (see
// [WithClock]). A record completed with an expiry already past is deleted.
func (s *Store) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ttl := micros(expires.Sub(s.now()))
	return s.tokenOp(ctx, s.complete, "complete", key, token, respcodec.Encode(resp), ttl)
}

// Release implements [idemserver.Store] in one round trip.
func (s *Store) Release(ctx context.Context, key idemserver.Key, token string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return s.tokenOp(ctx, s.release, "release", key, token)
}

// Extend implements [idemserver.Store] in one round trip. The lease ends
// as long from now, by the server's clock, as leaseExpires is from now on
// the store's clock (see [WithClock]).
func (s *Store) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d := micros(leaseExpires.Sub(s.now()))
	return s.tokenOp(ctx, s.extend, "extend", key, token, d, micros(LeaseMargin))
}

// tokenOp runs one of the scripts that act only while the record holds
// token, which answer 1 when they did and 0 when the token is not there.
func (s *Store) tokenOp(ctx context.Context, script *redis.Script, op string, key idemserver.Key, token string, args ...any) error {
	args = append([]any{token}, args...)
	n, err := script.Run(ctx, s.client, []string{recordKey(s.prefix, key)}, args...).Int64()
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: %s: %w", op, err)
	case n == 0:
		return fmt.Errorf("redisstore: %s: %w", op, idemserver.ErrLeaseLost)
	case n != 1:
		return fmt.Errorf("%w to %s: %d", ErrUnexpectedReply, op, n)
	}
	return nil
}

// micros returns d in whole microseconds, the unit of the scripts.
func micros(d time.Duration) int64 { return d.Microseconds() }
