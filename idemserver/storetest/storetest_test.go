package storetest_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/storetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// broken wraps a MemoryStore and breaks one rule of the Store contract. It
// holds the MemoryStore in a named field, so that the middleware does not
// see the MemoryStore's PackedStore methods, which would bypass the
// broken ones.
type broken struct {
	MemoryStore *idemserver.MemoryStore
	claim       func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error)
	takeOver    func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error)
	complete    func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error
	release     func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string) error
	extend      func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, exp time.Time) error
}

func (b *broken) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	if b.claim != nil {
		return b.claim(b.MemoryStore, ctx, c)
	}
	return b.MemoryStore.Claim(ctx, c)
}

func (b *broken) TakeOver(ctx context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error) {
	if b.takeOver != nil {
		return b.takeOver(b.MemoryStore, ctx, c, token)
	}
	return b.MemoryStore.TakeOver(ctx, c, token)
}

func (b *broken) Complete(ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
	if b.complete != nil {
		return b.complete(b.MemoryStore, ctx, k, token, resp, exp)
	}
	return b.MemoryStore.Complete(ctx, k, token, resp, exp)
}

func (b *broken) Release(ctx context.Context, k idemserver.Key, token string) error {
	if b.release != nil {
		return b.release(b.MemoryStore, ctx, k, token)
	}
	return b.MemoryStore.Release(ctx, k, token)
}

func (b *broken) Extend(ctx context.Context, k idemserver.Key, token string, exp time.Time) error {
	if b.extend != nil {
		return b.extend(b.MemoryStore, ctx, k, token, exp)
	}
	return b.MemoryStore.Extend(ctx, k, token, exp)
}

// brokenPacked is a broken store that is also an [idemserver.PackedStore],
// whose packed methods are the MemoryStore's unless one breaks them, so
// that the middleware and the suite call them.
type brokenPacked struct {
	*broken
	claimPacked    func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error)
	completePacked func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedCompletion) error
}

func (b *brokenPacked) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	if b.claimPacked != nil {
		return b.claimPacked(b.MemoryStore, ctx, c)
	}
	return b.MemoryStore.ClaimPacked(ctx, c)
}

func (b *brokenPacked) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	if b.completePacked != nil {
		return b.completePacked(b.MemoryStore, ctx, c)
	}
	return b.MemoryStore.CompletePacked(ctx, c)
}

// holdingBroken is a broken store that says it holds responses.
type holdingBroken struct{ *broken }

func (holdingBroken) HoldResponses() bool { return true }

// peek returns the record of k without changing it, if there is one.
func peek(ctx context.Context, s *idemserver.MemoryStore, k idemserver.Key) (idemserver.Record, bool) {
	now := time.Now()
	c := idemserver.Claim{Key: k, Token: "peek", Now: now, LeaseExpires: now}
	res, err := s.Claim(ctx, c)
	if err != nil {
		return idemserver.Record{}, false
	}
	if res.Claimed {
		_ = s.Release(ctx, k, c.Token)
		return idemserver.Record{}, false
	}
	return res.Record, true
}

// brokenStores are stores that each break one rule, with the subtests of
// the suite that must catch it.
var brokenStores = map[string]struct {
	store func(b *broken)
	// packed, when set, makes the store a PackedStore and breaks that.
	packed func(b *brokenPacked)
	// holds makes the store a ResponseHolder that holds responses.
	holds bool
	fails []string
}{
	"claims in-progress keys": {
		store: func(b *broken) {
			b.claim = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				res, err := s.Claim(ctx, c)
				if err == nil && !res.Claimed && !res.Record.Completed() {
					return idemserver.ClaimResult{Claimed: true}, nil
				}
				return res, err
			}
		},
		fails: []string{"Run/ClaimOutcomes", "Run/ConcurrentClaims", "HTTP/ConcurrentDuplicates"},
	},
	"accepts stale tokens": {
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				res, err := s.Claim(ctx, idemserver.Claim{Key: k, Now: time.Now()})
				if err == nil && !res.Claimed && !res.Record.Completed() {
					token = res.Record.Token
				}
				return s.Complete(ctx, k, token, resp, exp)
			}
		},
		fails: []string{"Run/StaleTokens/wrong_token/Complete", "Run/LeaseExpiry"},
	},
	"never expires": {
		store: func(b *broken) {
			b.claim = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				c.Now = time.Time{}
				return s.Claim(ctx, c)
			}
		},
		fails: []string{"Run/Expiry", "Run/ConcurrentClaimsOfExpiredRecord"},
	},
	"accepts another claim's completion of the response it holds": {
		// As a store that takes a completion it finds already made, with
		// the same response, for one sent again, whatever its token.
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				err := s.Complete(ctx, k, token, resp, exp)
				if rec, ok := peek(ctx, s, k); errors.Is(err, idemserver.ErrLeaseLost) && ok && rec.Completed() &&
					rec.Response.Status == resp.Status && bytes.Equal(rec.Response.Body, resp.Body) {
					return nil
				}
				return err
			}
		},
		fails: []string{"Run/StaleCompleteOfSameResponse"},
	},
	"truncates bodies": {
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				r := *resp
				r.Body = r.Body[:min(len(r.Body), 64<<10)]
				return s.Complete(ctx, k, token, &r, exp)
			}
		},
		fails: []string{"Run/Responses/1_MiB_body", "HTTP/LargeResponse"},
	},
	"truncates bodies past the default response limit": {
		// As a store whose column or value has a size limit it does not
		// check.
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				r := *resp
				r.Body = r.Body[:min(len(r.Body), idemserver.DefaultMaxResponseBytes)]
				return s.Complete(ctx, k, token, &r, exp)
			}
		},
		fails: []string{"Run/Responses/larger_than_the_default_limit"},
	},
	"keeps a record at its expiry": {
		// As a store that compares the expiry with < where <= belongs.
		store: func(b *broken) {
			b.claim = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				c.Now = c.Now.Add(-time.Nanosecond)
				return s.Claim(ctx, c)
			}
		},
		fails: []string{"Run/Expiry"},
	},
	"keeps a lease at its end": {
		store: func(b *broken) {
			b.takeOver = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error) {
				c.Now = c.Now.Add(-time.Nanosecond)
				return s.TakeOver(ctx, c, token)
			}
		},
		fails: []string{"Run/LeaseExpiry"},
	},
	"checks the token, then completes": {
		// As a store that reads the record, checks the token, and then
		// writes the response by key, in two steps.
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				if rec, ok := peek(ctx, s, k); !ok || rec.Completed() || rec.Token != token {
					return idemserver.ErrLeaseLost
				}
				// The worst interleaving, made certain rather than left to
				// the scheduler: the write waits for a takeover to land
				// after the check (for a while; a round whose takeovers
				// all came first has none to wait for).
				for end := time.Now().Add(200 * time.Millisecond); time.Now().Before(end); time.Sleep(100 * time.Microsecond) {
					if rec, ok := peek(ctx, s, k); ok && !rec.Completed() && rec.Token != token {
						token = rec.Token
						break
					}
				}
				return s.Complete(ctx, k, token, resp, exp)
			}
		},
		fails: []string{"Run/CompleteRacesTakeOvers"},
	},
	"drops repeated header values": {
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				r := *resp
				r.Header = resp.Header.Clone()
				for name, vs := range r.Header {
					r.Header[name] = vs[:1]
				}
				return s.Complete(ctx, k, token, &r, exp)
			}
		},
		fails: []string{"Run/Responses/multi-valued_fields", "HTTP/ExecutesOnceAndReplays"},
	},
	"joins scope and key": {
		store: func(b *broken) {
			join := func(k idemserver.Key) idemserver.Key { return idemserver.Key{Key: k.Scope + k.Key} }
			b.claim = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				c.Key = join(c.Key)
				return s.Claim(ctx, c)
			}
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				return s.Complete(ctx, join(k), token, resp, exp)
			}
		},
		fails: []string{"Run/Scopes/split_moves"},
	},
	"ignores cancellation": {
		store: func(b *broken) {
			b.claim = func(s *idemserver.MemoryStore, _ context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				return s.Claim(context.Background(), c)
			}
		},
		fails: []string{"Run/CancelledContext"},
	},
	"does not extend": {
		store: func(b *broken) {
			b.extend = func(*idemserver.MemoryStore, context.Context, idemserver.Key, string, time.Time) error { return nil }
		},
		fails: []string{"Run/Extend", "Run/StaleTokens/released/Extend"},
	},
	"ignores trailing spaces": {
		// As a SQL column whose collation pads with spaces compares them.
		store: func(b *broken) {
			trim := func(k idemserver.Key) idemserver.Key {
				return idemserver.Key{Scope: strings.TrimRight(k.Scope, " "), Key: strings.TrimRight(k.Key, " ")}
			}
			b.claim = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
				c.Key = trim(c.Key)
				return s.Claim(ctx, c)
			}
			b.takeOver = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error) {
				c.Key = trim(c.Key)
				return s.TakeOver(ctx, c, token)
			}
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				return s.Complete(ctx, trim(k), token, resp, exp)
			}
			b.release = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string) error {
				return s.Release(ctx, trim(k), token)
			}
			b.extend = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, exp time.Time) error {
				return s.Extend(ctx, trim(k), token, exp)
			}
		},
		fails: []string{"Run/Scopes/trailing_space_in_the_key", "Run/Scopes/trailing_space_in_the_scope"},
	},
	"drops the scope in Extend": {
		store: func(b *broken) {
			b.extend = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, exp time.Time) error {
				return s.Extend(ctx, idemserver.Key{Key: k.Key}, token, exp)
			}
		},
		fails: []string{"Run/Scopes/same_key,_two_scopes"},
	},
	"drops the scope in Release": {
		store: func(b *broken) {
			b.release = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string) error {
				return s.Release(ctx, idemserver.Key{Key: k.Key}, token)
			}
		},
		fails: []string{"Run/Scopes/same_key,_two_scopes"},
	},
	"drops the scope in TakeOver": {
		store: func(b *broken) {
			b.takeOver = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error) {
				c.Key = idemserver.Key{Key: c.Key.Key}
				return s.TakeOver(ctx, c, token)
			}
		},
		fails: []string{"Run/Scopes/same_key,_two_scopes"},
	},
	"keeps a record only until its lease ends": {
		// As a store that sets the record's time to live when it claims
		// and forgets to move it on when it completes.
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				if rec, ok := peek(ctx, s, k); ok && !rec.Completed() && rec.LeaseExpires.Before(exp) {
					exp = rec.LeaseExpires
				}
				return s.Complete(ctx, k, token, resp, exp)
			}
		},
		fails: []string{"Run/CompleteAfterLeaseEnded"},
	},
	"refuses to complete a lease that ended": {
		store: func(b *broken) {
			b.complete = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, exp time.Time) error {
				if rec, ok := peek(ctx, s, k); ok && !rec.Completed() && !time.Now().Before(rec.LeaseExpires) {
					return idemserver.ErrLeaseLost
				}
				return s.Complete(ctx, k, token, resp, exp)
			}
		},
		fails: []string{"Run/CompleteAfterLeaseEnded"},
	},
	"extends any lease of the key": {
		store: func(b *broken) {
			b.extend = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, _ string, exp time.Time) error {
				if rec, ok := peek(ctx, s, k); ok && !rec.Completed() {
					return s.Extend(ctx, k, rec.Token, exp)
				}
				return idemserver.ErrLeaseLost
			}
		},
		fails: []string{"Run/StaleTokens/wrong_token/Extend", "Run/StaleTokens/taken_over/Extend"},
	},
	"releases any lease of the key": {
		store: func(b *broken) {
			b.release = func(s *idemserver.MemoryStore, ctx context.Context, k idemserver.Key, _ string) error {
				if rec, ok := peek(ctx, s, k); ok && !rec.Completed() {
					return s.Release(ctx, k, rec.Token)
				}
				return idemserver.ErrLeaseLost
			}
		},
		fails: []string{"Run/StaleTokens/wrong_token/Release", "Run/StaleTokens/taken_over/Release"},
	},
	"takes over with a cancelled context": {
		store: func(b *broken) {
			b.takeOver = func(s *idemserver.MemoryStore, _ context.Context, c idemserver.Claim, token string) (idemserver.ClaimResult, error) {
				return s.TakeOver(context.Background(), c, token)
			}
		},
		fails: []string{"Run/CancelledContext"},
	},
	"accepts stale tokens when packed": {
		packed: func(b *brokenPacked) {
			b.completePacked = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedCompletion) error {
				if rec, ok := peek(ctx, s, c.Key); ok && !rec.Completed() {
					c.Token = rec.Token
				}
				return s.CompletePacked(ctx, c)
			}
		},
		fails: []string{"Run/Packed/StaleTokens/wrong_token/Complete", "Run/Packed/LeaseExpiry"},
	},
	"trusts a completion's Ref": {
		// As a store that finds the record by the claim's reference and
		// checks neither its key nor its token.
		packed: func(b *brokenPacked) {
			var mu sync.Mutex
			refs := make(map[uint64]idemserver.Key)
			b.claimPacked = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
				res, err := s.ClaimPacked(ctx, c)
				if err == nil && res.Claimed {
					mu.Lock()
					refs[res.Ref] = c.Key
					mu.Unlock()
				}
				return res, err
			}
			b.completePacked = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedCompletion) error {
				mu.Lock()
				key, ok := refs[c.Ref]
				mu.Unlock()
				if ok {
					if rec, found := peek(ctx, s, key); found && !rec.Completed() {
						c.Key, c.Token = key, rec.Token
					}
				}
				return s.CompletePacked(ctx, c)
			}
		},
		fails: []string{"Run/Packed/StaleTokens/wrong_token/Complete", "Run/Packed/Lifecycle"},
	},
	"replays packed responses without their fields": {
		packed: func(b *brokenPacked) {
			b.claimPacked = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
				res, err := s.ClaimPacked(ctx, c)
				if err == nil && !res.Response.IsZero() {
					r := res.Response.Response()
					r.Header = nil
					res.Response = idemserver.PackResponse(r)
				}
				return res, err
			}
		},
		fails: []string{"Run/Packed/Responses/multi-valued_fields", "Run/Packed/ClaimOutcomes"},
	},
	"ignores NewToken": {
		packed: func(b *brokenPacked) {
			b.claimPacked = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
				c.NewToken = nil
				return s.ClaimPacked(ctx, c)
			}
		},
		fails: []string{"Run/Packed/ClaimOutcomes"},
	},
	"holds responses but its claims do not say so": {
		// As a store would that a wrapper forwarding only the Store
		// methods turns into one whose responses are not held.
		holds: true,
		store: func(*broken) {},
		fails: []string{"Run/ClaimOutcomes", "Run/Lifecycle"},
	},
	"takes over any lease": {
		store: func(b *broken) {
			b.takeOver = func(s *idemserver.MemoryStore, ctx context.Context, c idemserver.Claim, _ string) (idemserver.ClaimResult, error) {
				res, err := s.Claim(ctx, c)
				if err != nil || res.Claimed || res.Record.Completed() {
					return res, err
				}
				// As if the lease had ended, whenever it ends.
				c.Now = res.Record.LeaseExpires
				return s.TakeOver(ctx, c, res.Record.Token)
			}
		},
		fails: []string{"Run/LeaseExpiry", "Run/ConcurrentTakeOvers"},
	},
}

// TestBrokenStore runs the suites against one broken store, named by
// STORETEST_BROKEN, in the subprocess TestSuiteCatchesBrokenStores starts.
func TestBrokenStore(t *testing.T) {
	name := os.Getenv("STORETEST_BROKEN")
	if name == "" {
		t.Skip("run by TestSuiteCatchesBrokenStores")
	}
	newStore := func(t *testing.T) idemserver.Store {
		b := &broken{MemoryStore: idemserver.NewMemoryStore()}
		t.Cleanup(func() { _ = b.MemoryStore.Close() })
		tt := brokenStores[name]
		if tt.packed != nil {
			p := &brokenPacked{broken: b}
			tt.packed(p)
			return p
		}
		tt.store(b)
		if tt.holds {
			return holdingBroken{b}
		}
		return b
	}
	t.Run("Run", func(t *testing.T) { storetest.Run(t, newStore) })
	t.Run("HTTP", func(t *testing.T) { storetest.RunHTTP(t, newStore) })
}

func TestSuiteCatchesBrokenStores(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the suites once per broken store")
	}
	exe, err := os.Executable()
	require.NoError(t, err)
	for name, tt := range brokenStores {
		t.Run(name, func(t *testing.T) {
			cmd := exec.CommandContext(t.Context(), exe, "-test.run=^TestBrokenStore$", "-test.v")
			cmd.Env = append(os.Environ(), "STORETEST_BROKEN="+name)
			out, err := cmd.CombinedOutput()
			require.Error(t, err, "the suites pass a store that %s:\n%s", name, out)
			for _, sub := range tt.fails {
				assert.True(t, strings.Contains(string(out), "--- FAIL: TestBrokenStore/"+sub+" "),
					"a store that %s should fail %s", name, sub)
			}
			if t.Failed() {
				t.Logf("output:\n%s", tail(string(out), 4000))
			}
		})
	}
}

// TestSuitePassesMemoryStore is the control: the same suites pass the
// store that breaks nothing.
func TestSuitePassesMemoryStore(t *testing.T) {
	newStore := func(t *testing.T) idemserver.Store {
		s := idemserver.NewMemoryStore()
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	t.Run("Run", func(t *testing.T) { storetest.Run(t, newStore) })
	t.Run("HTTP", func(t *testing.T) { storetest.RunHTTP(t, newStore) })
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[strings.LastIndexByte(s[:len(s)-n], '\n')+1:]
}
