// Command restart shows an operation surviving the death of the process that
// started it. Pending idempotency keys live in a file store, so the next run
// of the program finds the unfinished operations and sends each again with
// the key the server has already seen.
//
// The program starts a local payment server and runs itself twice as a child
// process. The first run pays two orders: one meets an outage and gives up
// with its key pending; the other is charged by the server, but the process
// is killed before the reply arrives. The second run resumes both. The
// server's ledger shows each order charged exactly once.
//
//	go run ./examples/restart
package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp"
)

// childEnv holds "run-1" or "run-2" in the child processes.
const childEnv = "IDEMHTTP_RESTART_RUN"

// Orders paid by the first run: charged but killed before the reply, and
// refused by an outage.
const (
	orderKilled = "order-1001"
	orderOutage = "order-1002"
)

func main() {
	var err error
	if run := os.Getenv(childEnv); run != "" {
		err = child(os.Stdout, run, os.Args[1], os.Args[2])
	} else {
		err = demo(os.Stdout, os.Args[0])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "restart:", err)
		os.Exit(1)
	}
}

// demo runs the server and the two runs of the program, self being the
// program's executable.
func demo(out io.Writer, self string) error {
	out = &lockedWriter{w: out} // the children write to it too
	dir, err := os.MkdirTemp("", "idemhttp-restart")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	store := filepath.Join(dir, "pending.keys")
	srv := newServer()
	ts := httptest.NewServer(srv)
	defer ts.Close()

	// Run 1 is killed as soon as the server has charged orderKilled.
	fmt.Fprintln(out, "run 1: paying", orderOutage, "and", orderKilled)
	cmd := exec.Command(self, store, ts.URL)
	cmd.Env = append(os.Environ(), childEnv+"=run-1")
	cmd.Stdout, cmd.Stderr = out, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	select {
	case <-srv.charged:
		cmd.Process.Kill()
		fmt.Fprintln(out, "  the server charged", orderKilled, "and run 1 was killed before the reply arrived")
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
	}
	cmd.Wait()

	srv.recover()
	fmt.Fprintln(out, "run 2: a new process opens the same store")
	cmd = exec.Command(self, store, ts.URL)
	cmd.Env = append(os.Environ(), childEnv+"=run-2")
	cmd.Stdout, cmd.Stderr = out, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("run 2: %w", err)
	}
	fmt.Fprintln(out, "server ledger:")
	for _, order := range []string{orderKilled, orderOutage} {
		fmt.Fprintf(out, "  %s charged %d time(s)\n", order, srv.times(order))
	}
	return nil
}

// child is one run of the program that pays through a file store.
func child(out io.Writer, run, store, url string) error {
	keys, err := idemhttp.OpenFileKeyStore(store, idemhttp.WithStaleAfter(24*time.Hour))
	if err != nil {
		return err
	}
	defer keys.Close()
	client := idemhttp.NewClient(idemhttp.WithKeyStore(keys), idemhttp.WithMaxAttempts(3),
		idemhttp.WithBackoff(idemhttp.FullJitter(5*time.Millisecond, 20*time.Millisecond)))
	defer client.CloseIdleConnections()
	ctx := context.Background()

	if run == "run-1" {
		for _, order := range []string{orderOutage, orderKilled} {
			status, _, err := pay(ctx, client, url, order)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "  %s: %d after 3 attempts; its key stays pending\n", order, status)
		}
		return nil
	}

	pending, err := keys.Pending(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "  %d operations pending\n", len(pending))
	for _, p := range pending {
		if p.Stale {
			fmt.Fprintf(out, "  %s: key older than a day, the server may have forgotten it: check by hand\n", p.Operation)
			continue
		}
		status, replayed, err := pay(ctx, client, url, p.Operation)
		if err != nil {
			return err
		}
		how := "charged now"
		if replayed {
			how = "the server replayed the first charge"
		}
		fmt.Fprintf(out, "  %s key %s: %d, %s\n", p.Operation, p.Key, status, how)
	}
	pending, err = keys.Pending(ctx)
	fmt.Fprintf(out, "  %d operations pending\n", len(pending))
	return err
}

// pay charges order, with the order as the operation id.
func pay(ctx context.Context, client *http.Client, url, order string) (status int, replayed bool, err error) {
	ctx = idemhttp.WithOperation(ctx, order)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/orders/"+order+"/charge", strings.NewReader(`{"amount":100}`))
	if err != nil {
		return 0, false, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, false, err
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", nil
}

// server is a payment server that remembers idempotency keys and replays
// the first outcome of a key instead of charging again.
type server struct {
	mu      sync.Mutex
	outage  bool
	byKey   map[string]int // key -> status of its first outcome
	ledger  map[string]int // order -> times charged
	charged chan struct{}  // closed when orderKilled is charged
}

func newServer() *server {
	return &server{outage: true, byKey: map[string]int{}, ledger: map[string]int{}, charged: make(chan struct{})}
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body) // read it all, so a client's death cancels r.Context()
	order := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/orders/"), "/charge")
	key := r.Header.Get("Idempotency-Key")
	s.mu.Lock()
	if status, ok := s.byKey[key]; ok {
		s.mu.Unlock()
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(status)
		return
	}
	if s.outage && order == orderOutage {
		s.mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	s.ledger[order]++
	s.byKey[key] = http.StatusCreated
	first := s.outage && order == orderKilled
	s.mu.Unlock()
	if first {
		// The charge is done; the client dies before it hears of it.
		close(s.charged)
		<-r.Context().Done()
		return
	}
	w.WriteHeader(http.StatusCreated)
}

func (s *server) recover() {
	s.mu.Lock()
	s.outage = false
	s.mu.Unlock()
}

func (s *server) times(order string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ledger[order]
}

// lockedWriter serialises writes from this process and the copies of the
// children's output.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
