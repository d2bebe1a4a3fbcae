package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// operations returns the ids of the scenario's n operations, in the order
// they are made.
func operations(n int) []string {
	width := len(strconv.Itoa(n))
	ops := make([]string, n)
	for i := range ops {
		ops[i] = fmt.Sprintf("op-%0*d", width, i+1)
	}
	return ops
}

// work is the client child. It opens the key store, drives every operation
// the key store has pending to a final outcome, then makes the operations
// that its log does not record as done, with -workers of them at once.
//
// An operation is recorded done, durably, once its final response has
// arrived and before its body is read, which releases its key: so an
// operation that is not recorded done either still has its key pending or
// never had one, and sending it with a new key cannot execute it twice.
// (This order needs a response with a body: the Transport releases the key
// of a response without one before Do returns.)
func work(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleClient, flag.ContinueOnError)
	keysPath := fs.String("keys", "", "the key store file")
	logPath := fs.String("log", "", "the client log")
	url := fs.String("url", "", "the server's base URL")
	n := fs.Int("ops", 0, "number of operations")
	workers := fs.Int("workers", 1, "operations made at once")
	forgetKeys := fs.Bool(unsafeForgetKeysFlag, false, "keep the pending keys in memory")
	releaseEarly := fs.Bool(unsafeReleaseOnHeadersFlag, false, "release a key before the body of its 2xx was read")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var keys idemhttp.KeyStore = idemhttp.NewMemoryKeyStore()
	if !*forgetKeys {
		file, err := idemhttp.OpenFileKeyStore(*keysPath)
		if err != nil {
			return err
		}
		defer file.Close()
		keys = file
	}
	lines, err := readLines(*logPath)
	if err != nil {
		return err
	}
	done := make(map[string]bool)
	for _, l := range lines {
		if l[0] == "done" && len(l) > 1 {
			done[l[1]] = true
		}
	}
	log, err := openLineLog(*logPath)
	if err != nil {
		return err
	}
	defer log.Close()

	w := &worker{log: log, url: *url}
	if *releaseEarly {
		w.releaseEarly = keys.Release
	}
	w.client = idemhttp.NewClient(
		idemhttp.WithKeyStore(keys),
		idemhttp.WithMaxAttempts(6),
		idemhttp.WithBackoff(idemhttp.FullJitter(5*time.Millisecond, 100*time.Millisecond)),
		idemhttp.WithAttemptTimeout(time.Second), // ends stalls
		idemhttp.WithMaxRetryAfter(2*time.Second),
		idemhttp.WithBreaker(idemhttp.BreakerSettings{OpenTimeout: 200 * time.Millisecond}),
	)
	defer w.client.CloseIdleConnections()

	pending, err := keys.Pending(ctx)
	if err != nil {
		return err
	}
	var first []string
	resumed := make(map[string]bool)
	for _, p := range pending {
		first = append(first, p.Operation)
		resumed[p.Operation] = true
	}
	if err := w.drive(ctx, first, *workers); err != nil {
		return err
	}
	var rest []string
	for _, op := range operations(*n) {
		if !done[op] && !resumed[op] {
			rest = append(rest, op)
		}
	}
	return w.drive(ctx, rest, *workers)
}

type worker struct {
	client *http.Client
	log    *lineLog
	url    string
	// releaseEarly, if set, releases an operation's key as soon as a 2xx
	// has arrived, before its body is read: a broken client, for the test
	// that shows that idemchaos catches one.
	releaseEarly func(ctx context.Context, operation, key string) error
	// failed holds the first error that stopped an operation for good.
	failed error
	mu     sync.Mutex
}

// drive makes the operations ops, n at a time, each until its outcome is
// final.
func (w *worker) drive(ctx context.Context, ops []string, n int) error {
	err := forEach(ctx, ops, n, func(op string) {
		if err := w.complete(ctx, op); err != nil {
			w.mu.Lock()
			w.failed = errors.Join(w.failed, err)
			w.mu.Unlock()
		}
	})
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failed
}

// forEach calls do with each of ops, n calls at a time, until ctx ends,
// and returns ctx's error if it ended.
func forEach(ctx context.Context, ops []string, n int, do func(op string)) error {
	jobs := make(chan string)
	var wg sync.WaitGroup
	for range max(n, 1) {
		wg.Go(func() {
			for op := range jobs {
				do(op)
			}
		})
	}
	for _, op := range ops {
		if ctx.Err() != nil {
			break
		}
		jobs <- op
	}
	close(jobs)
	wg.Wait()
	return ctx.Err()
}

// complete sends op until its outcome is final, records it done and only
// then reads the response, which releases op's key. A 201 whose body is
// not op's receipt (a replay of another answer) is recorded as wrong; one
// whose body cannot be read to its end is recorded cut, and op is sent
// again.
func (w *worker) complete(ctx context.Context, op string) error {
	for ctx.Err() == nil {
		resp, err := w.pay(ctx, op)
		if err != nil {
			// Retries ran out, or the budget or breaker refused: the key
			// stays pending and the next call sends it again.
			sleep(ctx, 50*time.Millisecond)
			continue
		}
		if !final(resp) {
			drain(resp)
			sleep(ctx, 50*time.Millisecond)
			continue
		}
		if w.releaseEarly != nil && resp.StatusCode/100 == 2 {
			if err := w.releaseEarly(ctx, op, sentKey(resp)); err != nil {
				drain(resp)
				return err
			}
		}
		replayed := strconv.FormatBool(resp.Header.Get(idemserver.ReplayedHeader) == "true")
		err = w.log.append(true, "done", op, strconv.Itoa(resp.StatusCode), replayed, sentKey(resp))
		if err != nil {
			drain(resp)
			return err
		}
		if resp.StatusCode != http.StatusCreated {
			drain(resp)
			return fmt.Errorf("%s: final status %s", op, resp.Status)
		}
		wrong, err := checkReceipt(resp, op)
		if err != nil {
			// The body was cut in transit, after the server had stored
			// the outcome: the key must still be pending, so op is called
			// again at once and answered by a replay. The log notes the
			// key, for the report to check that the next answer came to
			// the same one (a client that released the key on the
			// header would send a new one, and pay again).
			if err := w.log.append(false, "cut", op, sentKey(resp)); err != nil {
				return err
			}
			continue
		}
		if wrong != "" {
			fmt.Fprintf(os.Stderr, "idemchaos client: %s: %s\n", op, wrong)
			return w.log.append(true, "wrong", op)
		}
		return nil
	}
	return ctx.Err()
}

// checkReceipt reads and closes the body of a 201 that answers op, and says
// how it differs from op's receipt, as the handler wrote it: its body and
// its Content-Type, the one header field the handler sets ("" if it does
// not). It fails if the body cannot be read.
func checkReceipt(resp *http.Response, op string) (wrong string, err error) {
	want := receiptOf(op)
	body, err := io.ReadAll(io.LimitReader(resp.Body, int64(len(want))+1))
	drain(resp)
	switch {
	case err != nil:
		return "", err
	case string(body) != want:
		return fmt.Sprintf("body %q, want %q", body, want), nil
	case resp.Header.Get("Content-Type") != receiptType:
		return fmt.Sprintf("Content-Type %q, want %q", resp.Header.Get("Content-Type"), receiptType), nil
	}
	return "", nil
}

// pay sends one call of operation op.
func (w *worker) pay(ctx context.Context, op string) (*http.Response, error) {
	req, err := payment(idemhttp.WithOperation(ctx, op), w.url, op)
	if err != nil {
		return nil, err
	}
	return w.client.Do(req)
}

// payment returns the request that pays op at the server at url; every
// call of op sends the same one, so that its fingerprint never changes.
func payment(ctx context.Context, url, op string) (*http.Request, error) {
	body := fmt.Sprintf(`{"op":%q,"amount":100}`, op)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/pay/"+op, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// sentKey returns the idempotency key of the attempt that resp answers
// ("-" if it has none), for the check that its outcome is still replayed at
// the end of the run.
func sentKey(resp *http.Response) string {
	if resp.Request != nil {
		if k := resp.Request.Header.Get(idemhttp.DefaultKeyHeader); k != "" && !strings.ContainsAny(k, " \t\n") {
			return k
		}
	}
	return noKey
}

// final reports whether resp is an outcome the Transport releases the key
// of: a 2xx, or a 4xx that is not retried.
func final(resp *http.Response) bool {
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
		return true
	case s == http.StatusRequestTimeout, s == http.StatusTooEarly, s == http.StatusTooManyRequests:
		return false
	case s == http.StatusConflict:
		return resp.Header.Get("Retry-After") == ""
	case s >= 300 && s < 400:
		return s != http.StatusTemporaryRedirect && s != http.StatusPermanentRedirect
	default:
		return s >= 400 && s < 500
	}
}

func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
