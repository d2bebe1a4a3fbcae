package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhttp/idemhttp/idemserver"
)

// EvictionCheckInterval is how often, at most, a [Store] reads Redis's
// eviction settings again, by the store's clock (see [WithClock]). The
// store reads them on its first claim, and then with the first claim
// after each interval: a Redis whose maxmemory-policy an operator changed
// at runtime is caught within about one interval (see [ErrEvictionPolicy]).
// A clock that steps back by more than an interval makes the next claim
// read them again, so a step back does not stretch the interval.
const EvictionCheckInterval = time.Minute

// ErrEvictionPolicy is returned, wrapped, by Claim, ClaimPacked and
// TakeOver while the Redis the store uses may evict records before they
// expire, or while the store cannot tell whether it may. The error wraps
// [idemserver.ErrStoreMisconfigured] as well.
//
// Every record has a TTL, so a Redis with a maxmemory and any
// maxmemory-policy but noeviction (the allkeys-* and volatile-* ones)
// drops live records under memory pressure, and tells no one: a retry of
// a completed key that Redis dropped runs its handler again. The store
// reads maxmemory and maxmemory_policy (INFO memory, on every primary of
// a Redis Cluster) and refuses claims unless maxmemory is 0 or the policy
// is noeviction; the middleware answers them 503 with Retry-After,
// without running the handler, and reports the error to its observer. A
// Redis that refuses INFO (Redis ACLs put it in the @dangerous category),
// or lacks it, gets the same refusal, with an error that says so.
//
// Only new claims are refused: Complete, Release and Extend of claims
// already held go on, so that work under way is neither stranded nor run
// twice. A claim of a completed key is refused too, rather than replayed:
// the store decides before it sends the claim, so refusing costs no
// round trip, and a Redis that may have dropped other records answers
// nothing the middleware should rely on. A takeover is a new execution
// of its key's handler, and is refused as well.
//
// Set maxmemory-policy noeviction (or maxmemory 0), or, to give up the
// guarantee, make the store with [WithEvictionAllowed]. Claims are served
// again within [EvictionCheckInterval] of the fix.
var ErrEvictionPolicy = errors.New("redisstore: claims refused: Redis may evict records before they expire")

// WithEvictionAllowed makes the store skip its check of Redis's eviction
// settings (it never sends INFO): for an operator who accepts that Redis
// evicts records under memory pressure, or who cannot grant the store's
// user INFO. It gives up a guarantee: a record Redis evicts is forgotten
// before its TTL, in silence, and a retry of its key runs the handler
// again. See [ErrEvictionPolicy].
func WithEvictionAllowed() Option {
	return func(s *Store) { s.eviction = nil }
}

// evictionCheck keeps a store's latest verdict on Redis's eviction
// settings, and makes sure that only one claim at a time reads them.
type evictionCheck struct {
	verdict atomic.Pointer[evictionVerdict] // nil until the first check answered

	mu   sync.Mutex
	call *evictionCall // the check under way, if any

	// nodes holds what each primary of a Cluster answered at the last
	// check that asked them all, by address. Only the check under way
	// uses it, and checks do not overlap.
	nodes map[string]error
}

// evictionVerdict is what one check found.
type evictionVerdict struct {
	err error // nil: Redis does not evict; else wraps ErrEvictionPolicy
	// The verdict holds for claims made in [from, next), by the store's
	// clock: from an interval before the check, so that claims that read
	// the clock just before it do not check again, to an interval after.
	// A clock that steps back (one given with WithClock need not be
	// monotonic) past from is rechecked at once, rather than keeping the
	// verdict for as long as the step.
	from, next time.Time
}

// evictionCall is one check under way, which claims that have no verdict
// to go on wait for.
type evictionCall struct {
	done chan struct{}
	err  error
}

// refusal returns the error a claim made at now, by the store's clock,
// fails with: nil while Redis does not evict. In the steady state it is
// one atomic load and two comparisons of times.
func (e *evictionCheck) refusal(ctx context.Context, c redis.UniversalClient, now time.Time) error {
	v := e.verdict.Load()
	if v != nil && now.Before(v.next) && !now.Before(v.from) {
		return v.err
	}
	return e.recheck(ctx, c, now, v)
}

// recheck reads Redis's settings again, unless another claim is doing so:
// then it answers the last verdict, or with none yet waits for that
// claim's.
func (e *evictionCheck) recheck(ctx context.Context, c redis.UniversalClient, now time.Time, last *evictionVerdict) error {
	for {
		e.mu.Lock()
		if v := e.verdict.Load(); v != last {
			// Another claim checked since this one loaded the verdict.
			e.mu.Unlock()
			return v.err
		}
		call := e.call
		if call == nil {
			// Until check returns, the claims waiting are refused: a
			// check that panicked (in a hook, say) lets none through.
			call = &evictionCall{done: make(chan struct{}), err: errCheckUnfinished}
			e.call = call
			e.mu.Unlock()
			defer func() {
				e.mu.Lock()
				e.call = nil
				e.mu.Unlock()
				close(call.done)
			}()
			call.err = e.check(ctx, c, now)
			return call.err
		}
		e.mu.Unlock()
		if last != nil {
			return last.err
		}
		select {
		case <-call.done:
		case <-ctx.Done():
			return ctx.Err()
		}
		if ctx.Err() == nil && (errors.Is(call.err, context.Canceled) || errors.Is(call.err, context.DeadlineExceeded)) {
			// The claim that checked went away; this one is still here.
			continue
		}
		return call.err
	}
}

// errCheckUnfinished is the verdict of a check that did not return.
var errCheckUnfinished = errors.New("redisstore: claim: the check of Redis's eviction settings did not finish")

// check reads Redis's eviction settings and records the verdict, which it
// returns. When Redis could not be asked (it is down, say), it records
// nothing and returns the error: the claim fails, as it would have on its
// own command, and the next claim checks again. A primary of a Cluster
// that could not be asked, but was at an earlier check, counts with what
// it answered then: the keys of the primaries that are up can still be
// claimed, and the store does not ask every primary again with every
// claim while one is down.
func (e *evictionCheck) check(ctx context.Context, c redis.UniversalClient, now time.Time) error {
	var verdict, failed error
	if cc, ok := c.(masterIterator); ok {
		var mu sync.Mutex
		nodes := make(map[string]error)
		// fn returns nil, so an error is the cluster's state's.
		err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
			addr := node.Options().Addr
			v, err := nodeVerdict(ctx, node, " on "+addr)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				last, ok := e.nodes[addr]
				if !ok {
					failed = err
					return nil
				}
				v = last
			}
			nodes[addr] = v
			switch {
			case v == nil:
			case verdict == nil || !errors.Is(verdict, errMayEvict):
				// A node that may evict says more than one that cannot
				// be checked.
				verdict = v
			}
			return nil
		})
		if err != nil {
			failed = err
		}
		if failed == nil {
			e.nodes = nodes
		}
	} else {
		verdict, failed = nodeVerdict(ctx, c, "")
	}
	if failed != nil && verdict == nil {
		return fmt.Errorf("redisstore: claim: reading Redis's eviction settings: %w", failed)
	}
	if verdict != nil {
		verdict = misconfigured{verdict}
	}
	e.verdict.Store(&evictionVerdict{err: verdict, from: now.Add(-EvictionCheckInterval), next: now.Add(EvictionCheckInterval)})
	return verdict
}

// misconfigured is a verdict that refuses claims: it wraps
// ErrEvictionPolicy, and [idemserver.ErrStoreMisconfigured] too, so that
// the middleware's 503 says the store refuses by its configuration rather
// than that it could not be reached.
type misconfigured struct{ error }

func (e misconfigured) Unwrap() []error {
	return []error{e.error, idemserver.ErrStoreMisconfigured}
}

// masterIterator is a client of several primaries, each serving part of
// the keys: a *redis.ClusterClient.
type masterIterator interface {
	ForEachMaster(ctx context.Context, fn func(ctx context.Context, client *redis.Client) error) error
}

// errMayEvict marks the verdict on a server that may evict records, as
// against one whose settings could not be read.
var errMayEvict = errors.New("it may evict")

// nodeVerdict reads the eviction settings of the one server c reaches,
// named where, and returns a verdict (nil when it does not evict), or
// else the error that kept it from being asked.
func nodeVerdict(ctx context.Context, c redis.Cmdable, where string) (verdict, failed error) {
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		if refusedInfo(err) {
			return fmt.Errorf("%w: Redis%s refused INFO, which the store needs to read maxmemory and maxmemory-policy (%w); allow the store's user INFO (ACL: +info), or give up the guarantee with redisstore.WithEvictionAllowed()", ErrEvictionPolicy, where, err), nil
		}
		return nil, err
	}
	maxmemory, policy, ok := evictionSettings(info)
	switch {
	case !ok:
		return fmt.Errorf("%w: INFO memory from Redis%s lacks maxmemory or maxmemory_policy; check that maxmemory-policy is noeviction and give up the guarantee with redisstore.WithEvictionAllowed()", ErrEvictionPolicy, where), nil
	case maxmemory > 0 && policy != "noeviction":
		return fmt.Errorf("%w: Redis%s has maxmemory %d and maxmemory-policy %s, under which %w live records in silence, and a retry of an evicted key runs its handler again; set maxmemory-policy noeviction (or maxmemory 0), or give up the guarantee with redisstore.WithEvictionAllowed()", ErrEvictionPolicy, where, maxmemory, policy, errMayEvict), nil
	}
	return nil, nil
}

// refusedInfo reports whether err is Redis refusing INFO for good: an ACL
// without it, or a server where it is renamed or disabled.
func refusedInfo(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	msg := rerr.Error()
	return strings.HasPrefix(msg, "NOPERM") || strings.HasPrefix(msg, "ERR unknown command")
}

// evictionSettings reads maxmemory and maxmemory_policy from the text of
// INFO memory, and reports whether it found both. A text that holds them
// more than once (a proxy's, with a section per server behind it) gets the
// largest maxmemory and a policy other than noeviction if any has one: it
// may evict when any of its servers may.
func evictionSettings(info string) (maxmemory int64, policy string, ok bool) {
	var haveMax bool
	for line := range strings.Lines(info) {
		line = strings.TrimSpace(line)
		if v, found := strings.CutPrefix(line, "maxmemory:"); found {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, "", false
			}
			maxmemory, haveMax = max(maxmemory, n), true
		} else if v, found := strings.CutPrefix(line, "maxmemory_policy:"); found {
			if v == "" {
				return 0, "", false
			}
			if policy == "" || policy == "noeviction" {
				policy = v
			}
		}
	}
	return maxmemory, policy, haveMax && policy != ""
}
