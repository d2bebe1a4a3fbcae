package idemserver

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrMaxHoldExceeded is the cause (see [context.Cause]) with which the
// middleware cancels the context of a handler that has held its key for
// longer than [WithMaxHold] allows. The middleware stops renewing the
// handler's lease then, so the key can be taken over once the lease lapses.
var ErrMaxHoldExceeded = errors.New("idemserver: handler held its key past the maximum hold")

// A leaseKeeper extends the lease of a claimed key while its handler runs,
// so that a live handler is never taken to be a crashed one.
//
// It wakes a third of a lease after sending each extension and extends the
// lease to one lease past the middleware's clock. An extension that fails for a
// reason other than a lost lease or a closed store, or that the store did
// not answer within its timeout (see [WithStoreTimeout]), is tried again a
// twentieth of a lease later (at most a second), for as long as the current
// lease has not ended; an extension still unanswered that long before the
// lease ends has failed. The keeper gives up, and cancels the
// handler's context with the reason, when the store reports [ErrLeaseLost],
// when the lease would end before another try, or when the handler has held
// the key for the maximum hold; from then on the handler may be taken over
// once its lease lapses.
//
// The keeper's timer runs a goroutine only while a renewal is due; stop
// stops the timer and waits for a renewal in progress, so that nothing
// extends the lease after the claim has ended and nothing outlives the
// request. The wake-ups run on the runtime's clock (time.Now, which a
// testing/synctest bubble fakes); the lease ends passed to the store are
// readings of the middleware's clock (see [WithClock]).
type leaseKeeper struct {
	m     *handler
	key   Key
	token string
	ctx   *detachedContext // the store's context, without cancellation
	hctx  *handlerContext  // the handler's context, which the keeper cancels

	mu           sync.Mutex
	timer        *time.Timer
	running      sync.WaitGroup     // a renewal in progress
	cancelExtend context.CancelFunc // ends the extension in progress
	stopped      bool
	leaseEnd     time.Time // when the current lease ends, by the runtime's clock
	holdEnd      time.Time // when the maximum hold ends, by the runtime's clock
	err          error     // why the handler's context was cancelled, if it was
}

// start starts keeping the lease that the claim took at claimed, by the
// runtime's clock.
func (k *leaseKeeper) start(claimed time.Time) {
	cfg := k.m.cfg
	// The timer may fire before AfterFunc returns.
	k.mu.Lock()
	defer k.mu.Unlock()
	k.leaseEnd = claimed.Add(cfg.lease)
	k.holdEnd = claimed.Add(cfg.maxHold)
	// The first renewal is due a third of a lease after the claim, not
	// after the handler starts: a store that answered the claim late has
	// used up part of the lease already, and a renewal due a third of a
	// lease from now could come after the lease ended and another request
	// took the key over.
	k.timer = time.AfterFunc(time.Until(claimed.Add(min(renewEvery(cfg.lease), cfg.maxHold))), k.renew)
}

// renew runs on the timer's goroutine: it extends the lease, tries again
// after a transient failure, or gives up.
func (k *leaseKeeper) renew() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	cfg := k.m.cfg
	now := time.Now()
	if !now.Before(k.holdEnd) {
		k.giveUpLocked(fmt.Errorf("%w (%v); its lease is no longer renewed", ErrMaxHoldExceeded, cfg.maxHold))
		k.mu.Unlock()
		return
	}
	k.running.Add(1)
	defer k.running.Done()
	// An extension the store has not answered within its timeout is tried
	// again (see WithStoreTimeout), and one that has not succeeded a retry
	// delay before the lease ends is too late: the keeper gives up then,
	// so that the handler learns it before another request may take the
	// key over. One that is in progress when the claim ends is ended by
	// stop.
	leaseEnd := k.leaseEnd
	ctx, cancel := context.WithDeadline(k.ctx,
		earliest(leaseEnd.Add(-renewRetryDelay(cfg.lease)), now.Add(cfg.storeTimeout)))
	defer cancel()
	k.cancelExtend = cancel
	k.mu.Unlock()

	err := k.m.store.Extend(ctx, k.key, k.token, cfg.now().Add(cfg.lease))

	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped {
		return // the claim has ended; the answer no longer matters
	}
	switch {
	case err == nil:
		// The new lease runs from when the extension was sent, so the
		// next one is due a third of a lease after that, not after the
		// answer: a slow store must not make it late.
		k.leaseEnd = now.Add(cfg.lease)
		k.timer.Reset(min(time.Until(now.Add(renewEvery(cfg.lease))), time.Until(k.holdEnd)))
	case errors.Is(err, ErrLeaseLost):
		k.giveUpLocked(fmt.Errorf("idemserver: extending the lease: %w", err))
	case errors.Is(err, ErrClosed):
		k.giveUpLocked(fmt.Errorf("%w: the store is closed: %w", ErrLeaseLost, err))
	default:
		retry := renewRetryDelay(cfg.lease)
		if !time.Now().Add(retry).Before(leaseEnd) {
			k.giveUpLocked(fmt.Errorf("%w: it could not be extended before it ended: %w", ErrLeaseLost, err))
			return
		}
		k.timer.Reset(retry)
	}
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// renewEvery is the time from one extension of a lease to the next. It is
// at least a millisecond, so that a lease too short to be renewed in time
// does not keep the store busy.
func renewEvery(lease time.Duration) time.Duration {
	return max(lease/3, time.Millisecond)
}

// renewRetryDelay is the wait before trying again an extension of a lease
// that failed for a reason other than a lost lease or a closed store.
func renewRetryDelay(lease time.Duration) time.Duration {
	return max(min(lease/20, time.Second), time.Millisecond)
}

// giveUpLocked stops renewing the lease and cancels the handler's context
// with cause.
func (k *leaseKeeper) giveUpLocked(cause error) {
	k.stopped = true
	k.err = cause
	k.hctx.cancel(cause)
}

// stop stops renewing the lease and waits for a renewal in progress to
// end. It returns when the current lease ends, by the runtime's clock, and
// why the keeper cancelled the handler's context, if it did.
func (k *leaseKeeper) stop() (leaseEnd time.Time, err error) {
	k.mu.Lock()
	k.stopped = true
	k.timer.Stop()
	if k.cancelExtend != nil {
		k.cancelExtend()
	}
	k.mu.Unlock()
	k.running.Wait()
	return k.leaseEnd, k.err
}
