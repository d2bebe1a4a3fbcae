package idemhttp

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withGatedSync makes the store's fsyncs wait, once armed, until gate is
// closed; entered is closed when the first of them starts to wait.
func withGatedSync(armed <-chan struct{}, entered chan<- struct{}, gate <-chan struct{}) FileOption {
	return func(c *fileConfig) {
		c.sync = func(f *os.File) error {
			select {
			case <-armed:
				select {
				case entered <- struct{}{}:
				default:
				}
				<-gate
			default:
			}
			return f.Sync()
		}
	}
}

// A Settle whose context ends while its release waits for the disk
// behind another caller's fsync (a FileKeyStore commits in groups) must
// tell the truth: an error means the key stays pending, so that the next
// call of the operation sends it again and gets the server's replay, as
// Settle promises. A Settle that reports failure while the release it
// queued goes on to the disk leaves the caller believing the key pending,
// and the next call is sent under a new key: a second charge.
func TestSettleWhoseContextEndsTellsTheTruth(t *testing.T) {
	srv := newChargeServer(t)
	armed, entered, gate := make(chan struct{}), make(chan struct{}, 1), make(chan struct{})
	store := openTestStore(t, filepath.Join(t.TempDir(), "keys"), withGatedSync(armed, entered, gate))
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
	resp := do(t, tr, post(t, heldCtx(), srv.URL, "x"))

	// Another operation's record takes the disk, and holds it.
	close(armed)
	other := make(chan error, 1)
	go func() {
		_, err := store.Acquire(context.Background(), "other", "key-other")
		other <- err
	}()
	<-entered
	ctx, cancel := context.WithCancel(context.Background())
	settled := make(chan error, 1)
	go func() { settled <- Settle(ctx, resp) }()
	// Cancelled once the release is queued behind the other record.
	require.Eventually(t, func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return store.releaseSeq != 0
	}, 10*time.Second, time.Millisecond)
	cancel()
	var err error
	returned := false
	select {
	case err = <-settled: // before the disk is free: it must have kept the key
		returned = true
	case <-time.After(100 * time.Millisecond): // it waits for the disk
	}
	close(gate)
	if !returned {
		err = <-settled
	}
	require.NoError(t, <-other)

	do(t, tr, post(t, WithOperation(context.Background(), "order-1"), srv.URL, "x"))
	keys := srv.keys.all()
	if err != nil {
		assert.Equal(t, keys[0], keys[1], "Settle failed (%v): the key stays pending and is sent again", err)
		assert.Equal(t, int32(1), srv.executions.Load(), "charged once")
	} else {
		assert.NotEqual(t, keys[0], keys[1], "settled: the operation starts anew")
	}
}

// A Settle whose context has already ended releases nothing.
func TestSettleWithAnEndedContextReleasesNothing(t *testing.T) {
	srv := newChargeServer(t)
	store := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
	resp := do(t, tr, post(t, heldCtx(), srv.URL, "x"))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, Settle(ctx, resp), context.Canceled)
	assert.Equal(t, map[string]string{"order-1": srv.keys.all()[0]}, pendingMap(t, store))
	require.NoError(t, Settle(context.Background(), resp))
	assert.Empty(t, pendingMap(t, store))
}
