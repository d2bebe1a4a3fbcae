package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemhttp/idemhttp/idemtest"
)

// Flags that break the server on purpose, to show that idemchaos catches
// what they break; they are left out of the usage text. unsafeFlag serves
// without the middleware, so retries execute again. unsafeEffectFlag makes
// the handler's effect one that the guarantee does not cover: in lease mode
// it forwards no key to the payment provider, and with postgres-tx it
// writes the payment outside the claim's transaction, so a server killed
// between the payment and the stored response pays again when a retry
// runs the handler after the takeover (see ledger.go). unsafeTTLFlag sets
// the middleware's retention, so that a short one forgets outcomes early.
// unsafeForgetKeysFlag breaks the client instead: it keeps its pending
// keys in memory, so that a killed client's successor sends the payments
// in flight again with new keys. unsafeReleaseOnHeadersFlag breaks the
// client too: it releases an operation's key as soon as the header of a
// final 2xx has arrived, before its body was read, so that a body cut in
// transit leaves the operation to be called again with a new key.
const (
	unsafeFlag                 = "unsafe-no-middleware"
	unsafeEffectFlag           = "unsafe-effect"
	unsafeTTLFlag              = "unsafe-ttl"
	unsafeForgetKeysFlag       = "unsafe-forget-keys"
	unsafeReleaseOnHeadersFlag = "unsafe-release-on-headers"
)

// scenario is what a run does, from the flags.
type scenario struct {
	ops, workers    int
	clientKills     int
	serverRestarts  int
	faults          float64
	spec            storeSpec
	seed            int64
	timeout         time.Duration
	dir             string
	noMiddleware    bool
	unsafeEffect    bool
	unsafeTTL       time.Duration
	forgetKeys      bool
	releaseEarly    bool
	self            string // this program's executable
	stderr          io.Writer
	pollEvery       time.Duration
	serverReadyWait time.Duration
}

// runScenario runs the scenario args describe, prints its report to stdout
// and returns the exit status.
func runScenario(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sc, err := parseScenario(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "idemchaos:", err)
		return exitError
	}
	rep, err := sc.run(ctx)
	if err != nil {
		fmt.Fprintln(stderr, "idemchaos:", err)
		return exitError
	}
	rep.print(stdout)
	return rep.status()
}

func parseScenario(args []string, stderr io.Writer) (*scenario, error) {
	if _, ok := stderr.(*os.File); !ok {
		stderr = &lockedWriter{w: stderr} // the children write to it too
	}
	sc := &scenario{stderr: stderr, pollEvery: 2 * time.Millisecond, serverReadyWait: 30 * time.Second}
	fs := flag.NewFlagSet("idemchaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&sc.ops, "ops", 300, "operations to make")
	fs.IntVar(&sc.workers, "workers", 8, "operations the client makes at once")
	fs.IntVar(&sc.clientKills, "client-kills", 3, "times the client is killed with SIGKILL and restarted")
	fs.IntVar(&sc.serverRestarts, "server-restarts", 0,
		"times the server is killed with SIGKILL and restarted (persistent stores only)")
	fs.Float64Var(&sc.faults, "faults", 0.2, "share of requests the proxy faults, in [0, 1]")
	fs.StringVar(&sc.spec.name, "store", "memory", "the server's store: "+storeNames)
	fs.StringVar(&sc.spec.dsn, "dsn", envDefault(dsnVariables),
		"PostgreSQL connection string, for -store postgres and postgres-tx (default $"+
			strings.Join(dsnVariables, " or $")+")")
	fs.StringVar(&sc.spec.redisAddr, "redis", envDefault(redisVariables),
		"Redis server host:port, for -store redis (default $"+redisVariables[0]+")")
	fs.Int64Var(&sc.seed, "seed", 0, "seed of the faults and of the kill moments (0: random)")
	fs.DurationVar(&sc.timeout, "timeout", 5*time.Minute, "bound on the whole run")
	fs.StringVar(&sc.dir, "dir", "", "keep the run's files in this directory (default: a temporary one, removed)")
	fs.BoolVar(&sc.noMiddleware, unsafeFlag, false, "serve without the middleware (a broken server)")
	fs.BoolVar(&sc.unsafeEffect, unsafeEffectFlag, false,
		"the handler's effect is not deduplicated downstream nor in the claim's transaction")
	fs.DurationVar(&sc.unsafeTTL, unsafeTTLFlag, 0, "the middleware's retention of outcomes (0: its default)")
	fs.BoolVar(&sc.forgetKeys, unsafeForgetKeysFlag, false, "the client keeps its pending keys in memory (a broken client)")
	fs.BoolVar(&sc.releaseEarly, unsafeReleaseOnHeadersFlag, false,
		"the client releases a key on the header of a 2xx, before its body was read (a broken client)")
	fs.Usage = func() {
		shown := flag.NewFlagSet("idemchaos", flag.ContinueOnError)
		shown.SetOutput(stderr)
		fs.VisitAll(func(f *flag.Flag) {
			if !strings.HasPrefix(f.Name, "unsafe-") {
				shown.Var(f.Value, f.Name, f.Usage)
			}
		})
		fmt.Fprintln(stderr, "usage: idemchaos [flags]")
		shown.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	switch {
	case sc.ops < 1:
		return nil, fmt.Errorf("-ops %d: need at least one operation", sc.ops)
	case sc.workers < 1:
		return nil, fmt.Errorf("-workers %d: need at least one", sc.workers)
	case sc.clientKills < 0 || sc.serverRestarts < 0:
		return nil, errors.New("-client-kills and -server-restarts cannot be negative")
	case math.IsNaN(sc.faults) || sc.faults < 0 || sc.faults > 1:
		return nil, fmt.Errorf("-faults %v: want a share in [0, 1]", sc.faults)
	case sc.timeout <= 0:
		return nil, fmt.Errorf("-timeout %v: want a positive duration", sc.timeout)
	}
	if err := sc.spec.check(); err != nil {
		return nil, err
	}
	if sc.serverRestarts > 0 && !sc.spec.persistent() {
		return nil, fmt.Errorf("-server-restarts %d needs a persistent store: the %s store keeps its keys "+
			"in the server process, and a restart would lose every one of them", sc.serverRestarts, sc.spec.name)
	}
	if sc.noMiddleware && sc.spec.transactional() {
		return nil, fmt.Errorf("-%s: the postgres-tx handler writes in the claim's transaction, "+
			"which there is none of without the middleware", unsafeFlag)
	}
	if sc.seed == 0 {
		sc.seed = rand.Int64()
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	sc.self = self
	return sc, nil
}

// proxyFaults spreads a share p of faulted requests over the kinds of
// fault, and delays another share p of requests by up to 20ms. A tenth of
// the faulted requests have their response's body cut after the server
// stored the outcome: the client has a 201 it cannot read to the end, and
// only a client that still holds the key gets the answer replayed rather
// than paying again.
func proxyFaults(p float64) idemtest.Faults {
	return idemtest.Faults{
		ResetBefore:     0.25 * p,
		LoseResponse:    0.2 * p,
		CutBody:         0.1 * p,
		Unavailable:     0.2 * p,
		TooManyRequests: 0.15 * p,
		Stall:           0.1 * p,
		RetryAfter:      time.Second,
		Latency:         p,
		MaxLatency:      20 * time.Millisecond,
	}
}

// files of a run, in its directory.
type files struct {
	ledger, keys, clientLog string
}

func (sc *scenario) run(ctx context.Context) (rep *report, err error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, sc.timeout)
	defer cancel()
	dir := sc.dir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "idemchaos")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f := files{
		ledger:    filepath.Join(dir, "ledger"),
		keys:      filepath.Join(dir, "pending.keys"),
		clientLog: filepath.Join(dir, "client.log"),
	}
	for _, p := range []string{f.ledger, f.keys, f.clientLog} {
		if _, err := os.Stat(p); err == nil {
			return nil, fmt.Errorf("%s exists: -dir must not hold an earlier run", p)
		}
	}

	sc.spec.space = newSpace()
	removeSpace, err := sc.spec.prepare(ctx)
	if err != nil {
		return nil, err
	}
	defer func() {
		if rerr := removeSpace(); rerr != nil && err == nil {
			err = fmt.Errorf("removing the run's %s: %w", sc.spec.space, rerr)
		}
	}()

	// The server children inherit the listening socket, so that a
	// restarted server listens where the proxy sends, and connections
	// that arrive while no server runs wait in its backlog.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	sock, err := ln.(*net.TCPListener).File()
	ln.Close()
	if err != nil {
		return nil, err
	}
	defer sock.Close()
	server, err := sc.startServer(ctx, f.ledger, 0, sock)
	if err != nil {
		return nil, err
	}
	// Killed before the space is removed, so that it holds no
	// transaction open there.
	defer func() { server.kill() }()

	proxy, err := idemtest.NewProxy("http://"+addr, proxyFaults(sc.faults), sc.seed)
	if err != nil {
		return nil, err
	}
	defer proxy.Close()

	clientArgs := []string{"-keys", f.keys, "-log", f.clientLog, "-url", proxy.URL(),
		"-ops", strconv.Itoa(sc.ops), "-workers", strconv.Itoa(sc.workers)}
	if sc.forgetKeys {
		clientArgs = append(clientArgs, "-"+unsafeForgetKeysFlag)
	}
	if sc.releaseEarly {
		clientArgs = append(clientArgs, "-"+unsafeReleaseOnHeadersFlag)
	}
	rep = &report{scenario: sc}
	rng := rand.New(rand.NewPCG(uint64(sc.seed), 0x6b696c6c73))
	killAt := newSchedule(moments(rng, sc.clientKills, sc.ops), sc.ops)
	restartAt := newSchedule(moments(rng, sc.serverRestarts, sc.ops), sc.ops)
	progress := &doneTail{path: f.clientLog, done: make(map[string]bool)}

	client, err := sc.start(roleClient, clientArgs, nil, nil)
	if err != nil {
		return nil, err
	}
	defer func() { client.kill() }()
	tick := time.NewTicker(sc.pollEvery)
	defer tick.Stop()
	for finished := false; !finished; {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the run did not finish: %w (%d of %d operations done)",
				ctx.Err(), len(progress.done), sc.ops)
		case <-client.exited:
			if client.err != nil {
				return nil, fmt.Errorf("client worker failed: %w", client.err)
			}
			finished = true
			continue
		case <-server.exited:
			return nil, fmt.Errorf("server %d exited by itself: %v", rep.serverRestarts, server.err)
		case <-tick.C:
		}
		if err := progress.read(); err != nil {
			return nil, err
		}
		done := len(progress.done)
		if restartAt.due(done) {
			restartAt.made(done)
			sc.awaitEffect(ctx, f.ledger)
			if !server.kill() { // it exited in the meantime, unasked
				return nil, fmt.Errorf("server %d exited by itself: %v", rep.serverRestarts, server.err)
			}
			rep.serverRestarts++
			if server, err = sc.startServer(ctx, f.ledger, rep.serverRestarts, sock); err != nil {
				return nil, err
			}
		}
		if killAt.due(done) {
			sleepRandom(ctx, rng) // land at any moment of an operation
			if client.kill() {    // not if it finished in the meantime
				killAt.made(done)
				rep.clientKills++
				if client, err = sc.start(roleClient, clientArgs, nil, nil); err != nil {
					return nil, err
				}
			}
		}
	}
	if rep.end, err = checkRun(ctx, f.clientLog, "http://"+addr, sc.workers); err != nil {
		return nil, err
	}
	if err := proxy.Close(); err != nil {
		return nil, err
	}
	if err := server.stop(); err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	rep.proxy = proxy.Stats()
	var payments []entry
	if sc.spec.transactional() {
		if payments, err = sc.spec.payments(ctx); err != nil {
			return nil, err
		}
	}
	rep.wall = time.Since(start)
	return rep, rep.read(f, payments)
}

// awaitEffect waits, up to a second, until the ledger file grows: a handler
// has just made its effect (a charge, or with postgres-tx an insert in its
// transaction) and is about to answer, so that a server kill that follows
// at once lands between the effect and the stored response, where a store
// that is not atomic with the handler's effect is put to the test.
func (sc *scenario) awaitEffect(ctx context.Context, ledger string) {
	size := func() int64 {
		fi, err := os.Stat(ledger)
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	was := size()
	deadline := time.Now().Add(time.Second)
	for size() == was && time.Now().Before(deadline) && ctx.Err() == nil {
		sleep(ctx, time.Millisecond)
	}
}

// moments returns n progress points, sorted, at which to kill a process:
// counts of operations done, drawn uniformly from the first four fifths of
// the run so that the process is still working when its moment comes.
func moments(rng *rand.Rand, n, ops int) []int {
	at := make([]int, n)
	for i := range at {
		at[i] = 1 + rng.IntN(max(ops*4/5, 1))
	}
	slices.Sort(at)
	return at
}

// schedule is when the kills of one kind are due, by the progress of the
// run: the count of operations the client log records done.
type schedule struct {
	at   []int // the moments left, sorted
	ops  int   // operations in the scenario
	last int   // operations done at the last kill; -1 before the first
}

func newSchedule(at []int, ops int) *schedule {
	return &schedule{at: at, ops: ops, last: -1}
}

// due reports whether a kill is due with done operations done: its moment
// has come, some operation has been recorded done since the last kill (so
// that the process started after it has worked, rather than being killed
// as it starts, which proves nothing), and some operation is left (so
// that the kill lands while there is work to lose).
func (s *schedule) due(done int) bool {
	return len(s.at) > 0 && done >= s.at[0] && done > s.last && done < s.ops
}

// made records the kill made with done operations done.
func (s *schedule) made(done int) {
	s.at = s.at[1:]
	s.last = done
}

// sleepRandom waits up to 10ms, so that a kill lands anywhere in an
// operation rather than just after one was recorded.
func sleepRandom(ctx context.Context, rng *rand.Rand) {
	sleep(ctx, time.Duration(rng.Int64N(int64(10*time.Millisecond))))
}

// startServer starts the server child numbered number on the socket and
// waits until it serves.
func (sc *scenario) startServer(ctx context.Context, ledger string, number int, sock *os.File) (*child, error) {
	args := []string{"-ledger", ledger, "-store", sc.spec.name, "-space", sc.spec.space,
		"-redis", sc.spec.redisAddr, "-server", strconv.Itoa(number)}
	if sc.noMiddleware {
		args = append(args, "-"+unsafeFlag)
	}
	if sc.unsafeEffect {
		args = append(args, "-"+unsafeEffectFlag)
	}
	if sc.unsafeTTL > 0 {
		args = append(args, "-"+unsafeTTLFlag, sc.unsafeTTL.String())
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	c, err := sc.start(roleServer, args, []*os.File{sock}, w)
	w.Close()
	if err != nil {
		return nil, err
	}
	ready := make(chan bool, 1)
	go func() {
		line, _ := bufio.NewReader(r).ReadString('\n')
		ready <- line == "ready\n"
	}()
	select {
	case ok := <-ready:
		if ok {
			return c, nil
		}
	case <-time.After(sc.serverReadyWait):
	case <-ctx.Done():
	}
	c.kill()
	r.Close() // ends the reader
	return nil, fmt.Errorf("server %d did not start", number)
}

// child is a child process of the scenario.
type child struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed when the process has exited; then err is set
	err    error
}

// start starts this program in role with args, its stdout to stdout (nil
// for none), its stderr to the scenario's.
func (sc *scenario) start(role string, args []string, extra []*os.File, stdout *os.File) (*child, error) {
	cmd := exec.Command(sc.self, args...)
	cmd.Env = append(os.Environ(), roleEnv+"="+role)
	if role == roleServer {
		cmd.Env = append(cmd.Env, dsnEnv+"="+sc.spec.dsn)
	}
	cmd.Stderr = sc.stderr
	if stdout != nil {
		cmd.Stdout = stdout
	}
	cmd.ExtraFiles = extra
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", role, err)
	}
	c := &child{cmd: cmd, exited: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.exited)
	}()
	return c, nil
}

// kill kills the process with SIGKILL, waits for it to be gone, and reports
// whether the signal ended it. A process that exited by itself just before
// (its exit not yet waited for, so the signal still finds it) was not
// killed: its exit status stands, and the run must not count a kill that
// did not happen.
func (c *child) kill() bool {
	select {
	case <-c.exited:
		return false
	default:
	}
	_ = c.cmd.Process.Kill()
	<-c.exited
	ws, ok := c.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// stop asks the process to end with SIGINT and waits for it.
func (c *child) stop() error {
	select {
	case <-c.exited:
		return c.err
	default:
	}
	if err := c.cmd.Process.Signal(os.Interrupt); err != nil {
		return err
	}
	select {
	case <-c.exited:
		return c.err
	case <-time.After(10 * time.Second):
		c.kill()
		return errors.New("did not stop within 10s of SIGINT")
	}
}

// doneTail follows the client log as it grows and collects the operations
// recorded done. It moves past whole lines only, and reads a line without
// its newline again the next time: a worker that starts after one was torn
// cuts it off (see openLineLog) and writes its own lines in its place.
type doneTail struct {
	path string
	off  int64 // the end of the last whole line read
	done map[string]bool
}

func (t *doneTail) read() error {
	f, err := os.Open(t.path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	data, err := io.ReadAll(io.NewSectionReader(f, t.off, math.MaxInt64-t.off))
	if err != nil {
		return err
	}
	for {
		i := slices.Index(data, '\n')
		if i < 0 {
			break
		}
		var op string
		if _, err := fmt.Sscanf(string(data[:i]), "done %s", &op); err == nil {
			t.done[op] = true
		}
		data = data[i+1:]
		t.off += int64(i) + 1
	}
	return nil
}

// lockedWriter serializes the writes of several goroutines, such as those
// that copy the children's output.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
