package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unsafe"

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
// extend or complete; after it, the key is simply absent.
const LeaseMargin = time.Minute

// MaxClockSkew is how far a claim's time (Claim.Now, the middleware's
// clock) may be from the store's clock (see [WithClock]).
const MaxClockSkew = 5 * time.Second

// ErrClockSkew is returned, wrapped, by Claim and TakeOver for a claim
// whose time is more than [MaxClockSkew] from the store's clock: a
// middleware given a clock of its own and a store not given the same one.
// The store refuses it (the middleware answers 503) rather than keep
// records and leases for the wrong time.
var ErrClockSkew = errors.New("redisstore: the middleware's clock is not the store's; see redisstore.WithClock")

// ErrClocksDisagree is returned, wrapped, by Claim and TakeOver when the
// claim's clock says a record has ended (the lease of one in progress, or
// a completed one's expiry) while Redis, which counts down the durations
// its writer set, says it still has more than twice [MaxClockSkew] to run: the
// clock of the instance that claims is ahead of the one that wrote the
// record, or one of them was stepped. The store neither takes over the
// lease, whose handler may still be running, nor forgets the record. The
// error wraps [idemserver.ErrStoreMisconfigured] too, so the middleware
// answers 503 with Retry-After, saying the store refuses until its
// configuration is fixed. Keep the clocks of the instances synchronized.
var ErrClocksDisagree = errors.New("redisstore: the instances' clocks disagree")

// Errors of the store. Use errors.Is to test for them.
var (
	// ErrUnexpectedReply means Redis answered with something the store did
	// not write, such as a record that another program changed.
	ErrUnexpectedReply = errors.New("redisstore: unexpected reply")
	// ErrUnknownVersion means a record has a layout version that this
	// release cannot read: a later release wrote it. The store neither
	// replays nor replaces it, and the middleware answers 503.
	ErrUnknownVersion = errors.New("redisstore: record of an unknown layout version")
)

// Store is an [idemserver.Store] that keeps records in Redis. See the
// package documentation for the model; a Store is safe for concurrent use.
//
// Store implements [idemserver.PackedStore]: a replay goes from the bytes
// Redis returns to the client without becoming an [idemserver.Response].
type Store struct {
	client                              redis.UniversalClient
	prefix                              string
	now                                 func() time.Time
	eviction                            *evictionCheck // nil: WithEvictionAllowed
	takeOver, complete, release, extend *redis.Script
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
// Complete and Extend are given into Redis's native expiry (a duration):
// it must be the middleware's (see [idemserver.WithClock]). Nil means
// time.Now, the middleware's default. A clock that runs ahead of the real
// one (a test's, advanced past a lease) cannot take over a lease, or
// replace a completed record, that Redis keeps more than 2×MaxClockSkew
// longer: the claim fails with [ErrClocksDisagree].
func WithClock(now func() time.Time) Option {
	return func(s *Store) {
		if now == nil {
			now = time.Now
		}
		s.now = now
	}
}

// New returns a store that keeps its records in the Redis that client
// reaches: a single server, a Sentinel-managed one or a Cluster, of Redis
// 7.0 or later. The store does not close the client. New panics if client
// is a *redis.Ring, which loses records in silence (see the package
// documentation). Unless made [WithEvictionAllowed], the store refuses
// claims while that Redis may evict records (see [ErrEvictionPolicy]).
func New(client redis.UniversalClient, opts ...Option) *Store {
	if _, ok := client.(*redis.Ring); ok {
		panic("redisstore: New: a *redis.Ring cannot keep idempotency records (see the package documentation); use a *redis.Client, a Sentinel failover client or a *redis.ClusterClient")
	}
	s := &Store{
		client:   client,
		prefix:   DefaultPrefix,
		now:      time.Now,
		eviction: new(evictionCheck),
		takeOver: redis.NewScript(takeOverScript),
		complete: redis.NewScript(completeScript),
		release:  redis.NewScript(releaseScript),
		extend:   redis.NewScript(extendScript),
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Claim implements [idemserver.Store] in one round trip: SET NX GET. A
// completed record that has expired by c.Now, but not yet in Redis (the
// clocks of two instances differ), takes a second: the takeover script
// replaces it.
func (s *Store) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	return decoded(s.claim(ctx, c, c.Token, false, ""))
}

// TakeOver implements [idemserver.Store] in one round trip. It replaces
// the record only while its lease has ended at c.Now, so a lease its
// holder extended in the meantime is not taken.
func (s *Store) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	return decoded(s.claim(ctx, c, c.Token, true, expiredToken))
}

// ClaimPacked implements [idemserver.PackedStore]: it is Claim or
// TakeOver, with a completed record's response translated from the stored
// encoding to the packed form without becoming a Response. The lease token
// goes into Redis with the claim, so c.NewToken, if set, is called before
// Redis answers, whatever it answers.
func (s *Store) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	token := c.Token
	if c.NewToken != nil {
		token = c.NewToken()
	}
	claimed, rec, err := s.claim(ctx, c.Claim, token, c.TakeOver, c.ExpiredToken)
	switch {
	case err != nil:
		return idemserver.PackedClaimResult{}, err
	case claimed:
		return idemserver.PackedClaimResult{ClaimResult: idemserver.ClaimResult{Claimed: true}, Token: token}, nil
	}
	var res idemserver.PackedClaimResult
	res.Record = rec.found()
	if rec.completed {
		res.Response, err = respcodec.Packed(rec.response)
		if err != nil {
			return idemserver.PackedClaimResult{}, fmt.Errorf("redisstore: stored response: %w", err)
		}
	}
	return res, nil
}

// claim claims c.Key with token, or takes over expiredToken's lease, and
// reports whether it did, or else the record it found.
func (s *Store) claim(ctx context.Context, c idemserver.Claim, token string, takeOver bool, expiredToken string) (bool, record, error) {
	if err := ctx.Err(); err != nil {
		return false, record{}, err
	}
	if err := checkToken(token); err != nil {
		return false, record{}, err
	}
	now := s.now()
	if d := c.Now.Sub(now); d > MaxClockSkew || d < -MaxClockSkew {
		return false, record{}, fmt.Errorf("%w: claim of %q stamped %v from it", ErrClockSkew, c.Key.Key, d)
	}
	if s.eviction != nil {
		if err := s.eviction.refusal(ctx, s.client, now); err != nil {
			return false, record{}, err
		}
	}
	a := newClaimArgs(s.prefix, c, token)
	if takeOver {
		return s.replace(ctx, a.key, a.value, a.ttl, c.Now, token, expiredToken)
	}
	cmd := redis.NewStringCmd(ctx, a.args[:]...)
	err := s.client.Process(ctx, cmd)
	var full error // Redis's refusal, when it is full
	switch {
	case errors.Is(err, redis.Nil):
		return true, record{}, nil
	case refusedWrite(err):
		// Redis refuses SET, a write command, even when NX would write
		// nothing: at its maxmemory, without the replicas that
		// min-replicas-to-write asks for, after a failed save, or as a
		// replica. A completed key still replays, and a claim sent again
		// finds itself: read the record, a second round trip only while
		// Redis refuses writes.
		full = err
		cmd = s.client.Get(ctx, a.key)
		if errors.Is(cmd.Err(), redis.Nil) {
			return false, record{}, claimError(err)
		}
		if cmd.Err() != nil {
			return false, record{}, claimError(errors.Join(err, cmd.Err()))
		}
	case err != nil:
		return false, record{}, claimError(err)
	}
	rec, err := parseRecord(cmd.Val())
	switch {
	case err != nil:
		return false, record{}, fmt.Errorf("redisstore: claim: %w", err)
	case !rec.completed && rec.token == token:
		// The claim was sent again after it had won (go-redis resends a
		// command whose reply was lost), and tokens are unique to one
		// claim. Its lease ends at c.LeaseExpires, as the middleware
		// reckons.
		return true, record{}, nil
	case rec.completed && !rec.at.After(c.Now):
		// Expired by the middleware's clock, not yet by Redis's: absent,
		// by the Store contract.
		if full != nil {
			return false, record{}, fmt.Errorf("redisstore: claim of a key whose record expired: %w", fullError(full))
		}
		return s.replace(ctx, a.key, a.value, a.ttl, c.Now, token, "")
	}
	return false, rec, nil
}

// claimArgs holds the arguments of a claim's SET NX GET in one
// allocation: the command's arguments point into it, rather than each
// being boxed, or the key and the value made, on their own.
type claimArgs struct {
	// key is the record's key, over the bytes of keyBuf when short. It is
	// a string, passed by pointer, because go-redis reads a command's
	// first key to route it (Redis Cluster sends it to the node serving
	// the key's slot), and reads a string or a *string as it is sent.
	key    string
	value  []byte // the new record; in buf when its token is short
	ttl    int64  // the native expiry, in milliseconds
	args   [7]any
	keyBuf [96]byte
	buf    [offToken + 48]byte
}

func newClaimArgs(prefix string, c idemserver.Claim, token string) *claimArgs {
	a := &claimArgs{ttl: ttlMillis(withMargin(c.LeaseExpires.Sub(c.Now)))}
	// The key's bytes are never written again once appended, so a string
	// may share them.
	key := appendRecordKey(a.keyBuf[:0], prefix, c.Key)
	a.key = unsafe.String(unsafe.SliceData(key), len(key))
	a.value = appendInProgress(a.buf[:0], c.Fingerprint, c.LeaseExpires, token)
	a.args = [...]any{"set", &a.key, (*claimValue)(a), "nx", "get", "px", &a.ttl}
	return a
}

// claimValue is a view of a claimArgs that go-redis sends through its
// MarshalBinary: the value of the SET.
type claimValue claimArgs

// MarshalBinary returns the new record.
func (a *claimValue) MarshalBinary() ([]byte, error) { return a.value, nil }

// replace runs the takeover script: see takeOverScript.
func (s *Store) replace(ctx context.Context, key string, value []byte, ttl int64, now time.Time, token, expiredToken string) (bool, record, error) {
	reply, err := s.takeOver.Run(ctx, s.client, []string{key}, value, ttl, micros(now), expiredToken, token,
		LeaseMargin.Milliseconds(), clocksDisagree.Milliseconds()).Result()
	if err != nil {
		return false, record{}, claimError(err)
	}
	switch r := reply.(type) {
	case []any:
		if left, ok := disagreement(r); ok {
			what := "expires"
			if expiredToken != "" {
				what = "lease ends"
			}
			return false, record{}, fmt.Errorf("%w: the record's time says it has ended at the claim's time, %v, but Redis says its %s in %v; synchronize the instances' clocks (%w)",
				ErrClocksDisagree, now, what, left, idemserver.ErrStoreMisconfigured)
		}
	case int64:
		if r == 1 {
			return true, record{}, nil
		}
		if r == -1 {
			return false, record{}, fmt.Errorf("redisstore: takeover: %w", unreadable(ctx, s.client, key))
		}
	case string:
		rec, err := parseRecord(r)
		if err != nil {
			return false, record{}, fmt.Errorf("redisstore: takeover: %w", err)
		}
		return false, rec, nil
	}
	return false, record{}, fmt.Errorf("%w to a takeover: %v", ErrUnexpectedReply, reply)
}

// clocksDisagree is how much longer than the claim's clock Redis may say
// an ended lease or record has to run before the store takes the clocks
// to disagree: twice MaxClockSkew, since the native expiry set by Extend,
// or by Complete without the middleware's time, is reckoned on the store's
// clock, which may be MaxClockSkew from the middleware's that wrote the
// record's time, and a command that reached Redis late has its native
// expiry counted from then.
const clocksDisagree = 2 * MaxClockSkew

// disagreement reads the takeover script's {-2, ms} reply: how long Redis
// says the record has left.
func disagreement(r []any) (time.Duration, bool) {
	if len(r) != 2 {
		return 0, false
	}
	code, ok1 := r[0].(int64)
	ms, ok2 := r[1].(int64)
	if !ok1 || !ok2 || code != -2 {
		return 0, false
	}
	return time.Duration(ms) * time.Millisecond, true
}

// refusedWrite reports whether err is Redis refusing a write command in a
// state where it still answers reads.
func refusedWrite(err error) bool {
	if err == nil {
		// Before errors.As, whose target would be allocated on every
		// claim.
		return false
	}
	if redis.IsOOMError(err) {
		return true
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	msg := rerr.Error()
	return strings.HasPrefix(msg, "NOREPLICAS ") || strings.HasPrefix(msg, "MISCONF ") || strings.HasPrefix(msg, "READONLY ")
}

// claimError wraps an error of Redis's answering a claim.
func claimError(err error) error {
	if strings.HasPrefix(err.Error(), "ERR syntax error") {
		// SET with both NX and GET came with Redis 7.0.
		return fmt.Errorf("redisstore: claim: %w (the store needs Redis 7.0 or later)", err)
	}
	return fmt.Errorf("redisstore: claim: %w", fullError(err))
}

// fullError returns err, Redis's refusal of a claim's write, wrapped with
// [idemserver.ErrStoreFull] when Redis refused it for being at its
// maxmemory: under noeviction, full of records it may not drop, as the
// middleware's observer and its 503 then say.
func fullError(err error) error {
	if redis.IsOOMError(err) {
		return fmt.Errorf("%w: %w", idemserver.ErrStoreFull, err)
	}
	return err
}

// unreadable returns the error for a record a script found unreadable,
// naming its version when it has one this release does not know.
func unreadable(ctx context.Context, c redis.UniversalClient, key string) error {
	v, err := c.GetRange(ctx, key, 0, 0).Result()
	if err == nil && v != "" && v[0] != layoutVersion {
		return fmt.Errorf("%w %d (this release reads version %d)", ErrUnknownVersion, v[0], layoutVersion)
	}
	return fmt.Errorf("%w: a record this store cannot read", ErrUnexpectedReply)
}

// found returns the record that a claim found, without its response.
func (r record) found() idemserver.Record {
	rec := idemserver.Record{Fingerprint: r.fingerprint}
	if r.completed {
		rec.Expires = r.at
	} else {
		rec.Token = r.token
		rec.LeaseExpires = r.at
	}
	return rec
}

// decoded returns the ClaimResult of a claim that answered claimed, or
// found r, or failed with err.
func decoded(claimed bool, r record, err error) (idemserver.ClaimResult, error) {
	if err != nil || claimed {
		return idemserver.ClaimResult{Claimed: claimed}, err
	}
	res := idemserver.ClaimResult{Record: r.found()}
	if r.completed {
		resp, err := respcodec.Decode([]byte(r.response))
		if err != nil {
			return idemserver.ClaimResult{}, fmt.Errorf("redisstore: stored response: %w", err)
		}
		res.Record.Response = resp
	}
	return res, nil
}

// Complete implements [idemserver.Store] in one round trip. The record
// expires at expires, by the middleware's clock; in Redis, natively,
// MaxClockSkew after expires on the store's clock (see [WithClock]), which
// may be that far behind the middleware's, so that Redis never drops the
// record before the middleware's clock says it has ended. A record completed
// with an expiry at least MaxClockSkew past on the store's clock is deleted.
func (s *Store) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	if resp == nil {
		return errNoResponse
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return s.completeWith(ctx, key, token, respcodec.Encode(resp), time.Time{}, expires)
}

// errNoResponse is the error of a Complete with a nil response, which
// changes nothing (see [idemserver.Store.Complete]).
var errNoResponse = errors.New("redisstore: complete: no response")

// CompletePacked implements [idemserver.PackedStore]: it is Complete, with
// the response translated from the packed form to the stored encoding
// without becoming a Response, and the native expiry reckoned from c.Now
// (as Complete reckons it when c.Now is zero).
func (s *Store) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	enc, err := respcodec.AppendPacked(nil, c.Response)
	if err != nil {
		return fmt.Errorf("redisstore: complete: %w", err)
	}
	return s.completeWith(ctx, c.Key, c.Token, enc, c.Now, c.Expires)
}

// completeWith completes the record with the encoded response enc. The
// native expiry is reckoned from now, the middleware's time, or when now
// is zero from the store's clock, which may be up to MaxClockSkew from the
// middleware's that stamped expires: then it is that much later, so that
// Redis never drops the record before the middleware's clock says.
func (s *Store) completeWith(ctx context.Context, key idemserver.Key, token string, enc []byte, now, expires time.Time) error {
	if now.IsZero() {
		now = s.now().Add(-MaxClockSkew)
	}
	var ttl int64 // 0: the script deletes the record
	if d := expires.Sub(now); d > 0 {
		ttl = ttlMillis(d)
	}
	return s.tokenOp(ctx, s.complete, "complete", key, token, appendTime(nil, expires), enc, ttl)
}

// Release implements [idemserver.Store] in one round trip.
func (s *Store) Release(ctx context.Context, key idemserver.Key, token string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return s.tokenOp(ctx, s.release, "release", key, token)
}

// Extend implements [idemserver.Store] in one round trip. The lease ends
// at leaseExpires by the middleware's clock, and the record expires in
// Redis LeaseMargin after that, reckoned on the store's clock (see
// [WithClock]), which is within MaxClockSkew of the middleware's (Claim
// refuses a claim stamped farther from it), and the margin covers that.
func (s *Store) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ttl := ttlMillis(withMargin(leaseExpires.Sub(s.now())))
	return s.tokenOp(ctx, s.extend, "extend", key, token, appendTime(nil, leaseExpires), ttl)
}

// tokenOp runs one of the scripts that act only while the record holds
// token, which answer 1 when they did, 0 when the token is not there and
// -1 for a record they cannot read.
func (s *Store) tokenOp(ctx context.Context, script *redis.Script, op string, key idemserver.Key, token string, args ...any) error {
	args = append([]any{token}, args...)
	rk := recordKey(s.prefix, key)
	n, err := script.Run(ctx, s.client, []string{rk}, args...).Int64()
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: %s: %w", op, err)
	case n == 0:
		return fmt.Errorf("redisstore: %s: %w", op, idemserver.ErrLeaseLost)
	case n == -1:
		return fmt.Errorf("redisstore: %s: %w", op, unreadable(ctx, s.client, rk))
	case n != 1:
		return fmt.Errorf("%w to %s: %d", ErrUnexpectedReply, op, n)
	}
	return nil
}

// withMargin returns how long an in-progress record whose lease lasts d
// lives in Redis: d plus LeaseMargin, saturated rather than overflowing
// for a lease too long to add to.
func withMargin(d time.Duration) time.Duration {
	if d > math.MaxInt64-LeaseMargin {
		return math.MaxInt64
	}
	return d + LeaseMargin
}

// ttlMillis returns d in whole milliseconds, rounded up, and at least 1:
// the native expiry of a record, which must not end before its time.
// It is at most as long as the record's time field reaches (about 285
// years), which also keeps a saturated duration from overflowing.
func ttlMillis(d time.Duration) int64 {
	const most = maxMicros / 1000
	if d >= most*time.Millisecond {
		return most
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return max(int64(ms), 1)
}
