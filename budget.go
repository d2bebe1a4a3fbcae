package idemhttp

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhttp/idemhttp/internal/hostmap"
)

// Budget defaults, used for options that are not given and by the zero Budget.
const (
	// DefaultBudgetRatio is the share of recent first attempts that may be
	// retried: 0.2 lets 20 retries follow 100 first attempts.
	DefaultBudgetRatio = 0.2
	// DefaultBudgetWindow is how far back a Budget counts attempts.
	DefaultBudgetWindow = 10 * time.Second
	// DefaultBudgetMinRetriesPerSecond is the floor of retries a Budget
	// allows however little traffic there is.
	DefaultBudgetMinRetriesPerSecond = 3
	// DefaultBudgetMaxHosts is how many hosts a Budget tracks at most.
	DefaultBudgetMaxHosts = 4096
)

// budgetBuckets is how many steps a Budget's window slides in.
const budgetBuckets = 10

// A Budget bounds how much retrying adds to the load on a host.
//
// Retries multiply load exactly when a server can least take it: if every
// request to an overloaded server is tried four times, the server sees four
// times its normal load until it falls over. A Budget caps that
// multiplication. It counts, over a sliding window, the first attempts of
// requests and the retries sent to each host, and allows a retry only if,
// counting it,
//
//	retries in the window ≤ ratio × first attempts in the window + floor × window in seconds
//
// where floor is a number of retries per second that is allowed however
// little traffic there is, so that a client sending one request a minute can
// still retry it. With the defaults (ratio 0.2, a 10 s window, a floor of 3
// retries per second) the retries of a busy client add at most 20% to its
// first attempts over any 10 s, and a quiet client can make up to 30
// retries in any 10 s. Right after a host starts failing, the window still
// holds the first attempts of the good times and none of their retries, so
// retries may come in a short burst before the 20% settles in; the circuit
// breaker (see [BreakerSettings]) is what stops that burst. The window slides
// in steps of a tenth of its length: attempts are forgotten between nine and
// ten tenths of a window after they were made.
//
// A retry the Budget refuses is not sent: the request ends with the outcome
// of its last attempt, and the refusal is counted in [Budget.Stats]. A
// Transport consults its Budget only for retries; first attempts are never
// refused, only counted.
//
// Hosts are counted separately unless [BudgetAcrossHosts] is given; hosts
// unused for a whole window are forgotten, which changes nothing because
// their counts have expired, and at most [BudgetMaxHosts] are tracked.
// One Budget may be shared by several Transports (pass it to [WithBudget] of
// each), so that all of a program's clients draw on the same allowance.
//
// A Budget is safe for concurrent use. The zero Budget uses the defaults.
type Budget struct {
	cfg        budgetConfig
	configured bool // cfg was set by NewBudget; else the defaults apply

	once  sync.Once
	hosts *hostmap.Map[*budgetWindow]

	firsts, retries, refused atomic.Uint64
}

// A BudgetOption configures a [Budget] made by [NewBudget].
type BudgetOption func(*budgetConfig)

type budgetConfig struct {
	ratio       float64
	floor       float64 // retries per second
	window      time.Duration
	maxHosts    int
	acrossHosts bool
}

func defaultBudgetConfig() budgetConfig {
	return budgetConfig{
		ratio:    DefaultBudgetRatio,
		floor:    DefaultBudgetMinRetriesPerSecond,
		window:   DefaultBudgetWindow,
		maxHosts: DefaultBudgetMaxHosts,
	}
}

// BudgetRatio sets the share of first attempts in the window that may be
// retried (default 0.2). Zero allows only the floor; a negative ratio is
// treated as zero.
func BudgetRatio(ratio float64) BudgetOption {
	return func(c *budgetConfig) { c.ratio = max(ratio, 0) }
}

// BudgetWindow sets how far back the Budget counts attempts (default 10 s).
// A window shorter than a millisecond is raised to one millisecond.
func BudgetWindow(window time.Duration) BudgetOption {
	return func(c *budgetConfig) { c.window = max(window, time.Millisecond) }
}

// BudgetMinRetriesPerSecond sets the floor: the retries per second, on
// average over the window, that are allowed whatever the traffic (default
// 3). Zero means no floor; a negative floor is treated as zero.
func BudgetMinRetriesPerSecond(n float64) BudgetOption {
	return func(c *budgetConfig) { c.floor = max(n, 0) }
}

// BudgetAcrossHosts makes the Budget count all hosts together, as one
// allowance, instead of each host on its own.
func BudgetAcrossHosts() BudgetOption {
	return func(c *budgetConfig) { c.acrossHosts = true }
}

// BudgetMaxHosts sets how many hosts the Budget tracks at once (default
// 4096); beyond that, the least recently used host is forgotten. Values
// below one mean one.
func BudgetMaxHosts(n int) BudgetOption {
	return func(c *budgetConfig) { c.maxHosts = max(n, 1) }
}

// NewBudget returns a Budget configured by opts, with the defaults for the
// options not given.
func NewBudget(opts ...BudgetOption) *Budget {
	b := &Budget{cfg: defaultBudgetConfig(), configured: true}
	for _, opt := range opts {
		opt(&b.cfg)
	}
	return b
}

// BudgetStats counts what a [Budget] has seen since it was made.
type BudgetStats struct {
	// FirstAttempts is the number of first attempts counted.
	FirstAttempts uint64
	// Retries is the number of retries the Budget allowed.
	Retries uint64
	// Refused is the number of retries the Budget refused.
	Refused uint64
}

// Stats returns the Budget's counts over its whole life, all hosts together.
func (b *Budget) Stats() BudgetStats {
	return BudgetStats{
		FirstAttempts: b.firsts.Load(),
		Retries:       b.retries.Load(),
		Refused:       b.refused.Load(),
	}
}

func (b *Budget) init() {
	b.once.Do(func() {
		if !b.configured {
			b.cfg = defaultBudgetConfig()
		}
		// A host unused for a whole window has no attempts left in it, so
		// forgetting it then changes nothing.
		b.hosts = hostmap.New(b.cfg.maxHosts, b.cfg.window, func(string) *budgetWindow {
			return new(budgetWindow)
		})
	})
}

// window returns the counts of host, as of now.
func (b *Budget) window(host string, now time.Time) *budgetWindow {
	b.init()
	if b.cfg.acrossHosts {
		host = ""
	}
	return b.hosts.Get(host, now)
}

// slot numbers the step of the window that now falls in.
func (b *Budget) slot(now time.Time) int64 {
	return now.UnixNano() / int64(b.cfg.window/budgetBuckets)
}

// recordFirst counts a first attempt to host, made at now. A nil Budget
// counts nothing.
func (b *Budget) recordFirst(host string, now time.Time) {
	if b == nil {
		return
	}
	w := b.window(host, now)
	slot := b.slot(now)
	w.mu.Lock()
	w.bucket(slot).firsts++
	w.mu.Unlock()
	b.firsts.Add(1)
}

// allowRetry reports whether a retry to host may be sent at now, and if so
// counts it. A nil Budget allows every retry.
func (b *Budget) allowRetry(host string, now time.Time) bool {
	if b == nil {
		return true
	}
	w := b.window(host, now)
	slot := b.slot(now)
	w.mu.Lock()
	firsts, retries := w.sums(slot)
	allowance := b.cfg.ratio*float64(firsts) + b.cfg.floor*b.cfg.window.Seconds()
	// The epsilon keeps 0.2 × 100 from rounding down to 19.
	ok := float64(retries+1) <= math.Floor(allowance+1e-9)
	if ok {
		w.bucket(slot).retries++
	}
	w.mu.Unlock()
	if ok {
		b.retries.Add(1)
	} else {
		b.refused.Add(1)
	}
	return ok
}

// budgetWindow holds one host's counts in a ring of steps.
type budgetWindow struct {
	mu      sync.Mutex
	buckets [budgetBuckets]budgetBucket
}

type budgetBucket struct {
	slot            int64
	firsts, retries int64
}

// bucket returns the step for slot, clearing it if it held an older one.
func (w *budgetWindow) bucket(slot int64) *budgetBucket {
	bk := &w.buckets[(slot%budgetBuckets+budgetBuckets)%budgetBuckets]
	if bk.slot != slot {
		*bk = budgetBucket{slot: slot}
	}
	return bk
}

// sums adds up the steps of the window that ends with slot.
func (w *budgetWindow) sums(slot int64) (firsts, retries int64) {
	for _, bk := range w.buckets {
		if bk.slot <= slot && slot-bk.slot < budgetBuckets {
			firsts += bk.firsts
			retries += bk.retries
		}
	}
	return firsts, retries
}

// WithBudget sets the retry budget the Transport consults before every
// retry. By default each Transport has its own [Budget] with the default
// settings; pass one Budget to several Transports to share it, or nil to
// retry without a budget.
func WithBudget(b *Budget) Option {
	return func(c *config) { c.budget, c.budgetSet = b, true }
}
