package idemhttp

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// crashIterationsEnv raises (or lowers) the number of kills in
// TestFileKeyStoreSurvivesKill.
const crashIterationsEnv = "IDEMHTTP_CRASH_ITERATIONS"

// crashWorkers is how many goroutines the crash child runs.
const crashWorkers = 8

// crashChild records keys as fast as it can until it is killed. Worker w
// acquires operation <prefix>-w-n for n = 0, 1, 2, ... with key k-<op>,
// printing "A <op>" once Acquire returned nil, and releases every even n,
// printing "R <op>" once Release returned nil. A tiny compaction threshold
// makes kills land inside compactions too.
func crashChild(arg string) {
	path, prefix, _ := strings.Cut(arg, "|")
	s, err := OpenFileKeyStore(path, withCompactMinSize(16<<10))
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	var out sync.Mutex
	say := func(line string) {
		out.Lock()
		os.Stdout.WriteString(line + "\n") // one write per line, unbuffered
		out.Unlock()
	}
	say("ready")
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute) // in case the parent is gone
	var wg sync.WaitGroup
	for w := range crashWorkers {
		wg.Go(func() {
			for n := 0; time.Now().Before(deadline); n++ {
				op := fmt.Sprintf("%s-%d-%d", prefix, w, n)
				if _, err := s.Acquire(ctx, op, "k-"+op); err != nil {
					say("error: " + err.Error())
					return
				}
				say("A " + op)
				if n%2 == 0 {
					if err := s.Release(ctx, op, "k-"+op); err != nil {
						say("error: " + err.Error())
						return
					}
					say("R " + op)
				}
			}
		})
	}
	wg.Wait()
}

// crashModel is what the parent knows about the store.
type crashModel struct {
	present map[string]bool // operations that must be pending (key k-<op>)
	absent  map[string]bool // operations that must not be pending
}

func TestFileKeyStoreSurvivesKill(t *testing.T) {
	if testing.Short() {
		t.Skip("runs child processes")
	}
	iterations, seed, rng := crashIterations(t, 30)
	path := filepath.Join(t.TempDir(), "keys")
	model := crashModel{present: map[string]bool{}, absent: map[string]bool{}}
	for i := range iterations {
		killAfter := rng.IntN(400) // acknowledgements to wait for; 0 kills during open
		prefix := fmt.Sprintf("i%d", i)
		acked := runCrashChild(t, path, prefix, killAfter)
		checkAfterCrash(t, path, prefix, acked, &model)
		if t.Failed() {
			t.Fatalf("iteration %d (seed %d, kill after %d acknowledgements)", i, seed, killAfter)
		}
	}
}

// crashIterations returns how many kills a crash test makes (def, unless
// crashIterationsEnv says otherwise) and the random source that chooses
// them, with its seed, which it logs.
func crashIterations(t *testing.T, def int) (int, uint64, *rand.Rand) {
	t.Helper()
	if v := os.Getenv(crashIterationsEnv); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, crashIterationsEnv)
		def = n
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	return def, seed, rand.New(rand.NewPCG(seed, 0))
}

// runCrashChild starts a crash child, kills it with SIGKILL after
// killAfter acknowledgements and returns every line it printed.
func runCrashChild(t *testing.T, path, prefix string, killAfter int) []string {
	t.Helper()
	delay := time.Duration(-1) // no timer: killed after killAfter acknowledgements
	if killAfter == 0 {
		delay = 0
	}
	acks := 0
	return runKilledChild(t, "crash:"+path+"|"+prefix, delay, func(line string) bool {
		if strings.HasPrefix(line, "A ") || strings.HasPrefix(line, "R ") {
			acks++
		}
		return acks >= killAfter
	})
}

// runKilledChild runs the key store child in mode and returns the lines it
// printed. It kills the child with SIGKILL after delay, unless delay is
// negative (at once if it is zero); as soon as killOn reports true for a
// line; when the child reports an error, which fails the test; and when
// its output ends. The child must die of the kill.
func runKilledChild(t *testing.T, mode string, delay time.Duration, killOn func(line string) bool) []string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKeyStoreChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"="+mode)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	var once sync.Once
	kill := func() { once.Do(func() { assert.NoError(t, cmd.Process.Kill()) }) }
	switch {
	case delay == 0:
		kill()
	case delay > 0:
		timer := time.AfterFunc(delay, kill)
		defer timer.Stop()
	}
	var lines []string
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Text()
		lines = append(lines, line)
		if strings.HasPrefix(line, "error") {
			t.Errorf("child: %s", line)
			kill()
		}
		if killOn(line) {
			kill()
		}
	}
	kill()
	require.Error(t, cmd.Wait(), "the child must die of SIGKILL; stderr: %s", stderr.String())
	return lines
}

// checkAfterCrash opens the store the killed child left and checks it
// against the acknowledgements and the model, then folds this iteration
// into the model.
func checkAfterCrash(t *testing.T, path, prefix string, lines []string, m *crashModel) {
	t.Helper()
	s, err := OpenFileKeyStore(path)
	require.NoError(t, err, "process death releases the lock and leaves a readable store")
	defer func() { require.NoError(t, s.Close()) }()
	pending := pendingMap(t, s)

	acquired, released := map[string]bool{}, map[string]bool{}
	last := map[int]int{} // worker -> highest n acknowledged
	for _, line := range lines {
		kind, op, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		w, n := parseCrashOp(t, prefix, op)
		last[w] = max(last[w], n+1) // stored +1 so that 0 means none
		if kind == "A" {
			acquired[op] = true
		} else {
			released[op] = true
		}
	}
	for op := range acquired {
		if released[op] {
			assert.NotContains(t, pending, op, "acknowledged release came back")
			m.absent[op] = true
		} else if n := crashN(t, prefix, op); n%2 == 1 {
			if assert.Contains(t, pending, op, "acknowledged key lost") {
				assert.Equal(t, "k-"+op, pending[op], "acknowledged key changed")
			}
		}
	}
	for op := range m.present {
		if assert.Contains(t, pending, op, "key lost in a later crash") {
			assert.Equal(t, "k-"+op, pending[op])
		}
	}
	for op := range m.absent {
		assert.NotContains(t, pending, op, "released key came back in a later crash")
	}
	for op, key := range pending {
		assert.Equal(t, "k-"+op, key, "key invented for %s", op)
		if !strings.HasPrefix(op, prefix+"-") {
			assert.True(t, m.present[op], "operation %s invented", op)
			continue
		}
		// A worker can have made durable at most one operation beyond the
		// last it acknowledged.
		w, n := parseCrashOp(t, prefix, op)
		assert.LessOrEqual(t, n, last[w], "operation %s never attempted", op)
		m.present[op] = true // what is here now must stay
	}
	for op := range acquired {
		if !m.present[op] {
			m.absent[op] = true
		}
	}
}

func parseCrashOp(t *testing.T, prefix, op string) (worker, n int) {
	t.Helper()
	rest, ok := strings.CutPrefix(op, prefix+"-")
	require.True(t, ok, "operation %q of another child", op)
	ws, ns, ok := strings.Cut(rest, "-")
	require.True(t, ok, op)
	worker, err := strconv.Atoi(ws)
	require.NoError(t, err, op)
	n, err = strconv.Atoi(ns)
	require.NoError(t, err, op)
	return worker, n
}

func crashN(t *testing.T, prefix, op string) int {
	_, n := parseCrashOp(t, prefix, op)
	return n
}

// upgradeChild opens the store at path, a file of format version 1 that
// the open rewrites in the current version, prints "opened", and then
// records keys until it is killed: operation new-n with key k-new-n for
// n = 0, 1, 2, ..., printing "A new-n" once Acquire returned nil.
func upgradeChild(path string) {
	s, err := OpenFileKeyStore(path)
	if err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println("opened")
	deadline := time.Now().Add(time.Minute) // in case the parent is gone
	for n := 0; time.Now().Before(deadline); n++ {
		op := fmt.Sprintf("new-%d", n)
		if _, err := s.Acquire(context.Background(), op, "k-"+op); err != nil {
			fmt.Println("error:", err)
			return
		}
		fmt.Println("A", op)
	}
}

// largeVersion1File returns a store file of format version 1 large enough
// that rewriting it takes a while, and its pending keys.
func largeVersion1File() ([]byte, map[string]string) {
	data := keylog.V1Header().Append(nil)
	pending := map[string]string{}
	var body []byte
	for i := range 30000 {
		op, key := fmt.Sprintf("order-%06d", i), fmt.Sprintf("0190b2a4-7c1e-7b3a-9c1d-%012d", i)
		body = keylog.AppendAcquire(body, op, key, int64(i))
		if i%3 == 0 {
			body = keylog.AppendRelease(body, op, key)
		} else {
			pending[op] = key
		}
		if len(body) > 64<<10 || i == 29999 {
			data = append(data, frameOf(body)...)
			body = body[:0]
		}
	}
	return data, pending
}

// TestFileKeyStoreUpgradeSurvivesKill kills a process while its open
// rewrites a version 1 file in the current version, at a random moment of
// the open or of the appends after it, and checks that the file still
// opens with every key it held and every key acknowledged since, unchanged.
func TestFileKeyStoreUpgradeSurvivesKill(t *testing.T) {
	if testing.Short() {
		t.Skip("runs child processes")
	}
	iterations, seed, rng := crashIterations(t, 20)
	image, want := largeVersion1File()
	dir := t.TempDir()

	// Kills are spread over twice the time from a child's start to the
	// end of its open.
	p := filepath.Join(dir, "measure")
	require.NoError(t, os.WriteFile(p, image, 0o600))
	start := time.Now()
	runUpgradeChild(t, p, -1)
	span := 2 * time.Since(start)

	states := map[string]int{}
	for i := range iterations {
		p := filepath.Join(dir, fmt.Sprint("keys-", i))
		require.NoError(t, os.WriteFile(p, image, 0o600))
		delay := time.Duration(rng.Int64N(int64(span)))
		lines := runUpgradeChild(t, p, delay)
		states[upgradeState(t, p)]++
		checkAfterUpgradeCrash(t, p, lines, want)
		if t.Failed() {
			t.Fatalf("iteration %d (seed %d, kill after %v)", i, seed, delay)
		}
	}
	t.Logf("files left by the kills: %v", states)
}

// runUpgradeChild starts an upgrade child on path, kills it with SIGKILL
// after delay (or once it has opened the store, for a negative delay) and
// returns every line it printed.
func runUpgradeChild(t *testing.T, path string, delay time.Duration) []string {
	t.Helper()
	return runKilledChild(t, "upgrade:"+path, delay, func(line string) bool {
		return line == "opened" && delay < 0
	})
}

// upgradeState says what a killed upgrade child left at path: the file of
// version 1 with or without a temporary file beside it, or the file of
// the current version.
func upgradeState(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	h, err := keylog.ReadHeader(data)
	require.NoError(t, err, "the file's header")
	state := fmt.Sprint("version ", h.Version())
	if _, err := os.Stat(path + ".compact"); err == nil {
		state += " and a temporary file"
	}
	return state
}

// checkAfterUpgradeCrash opens the store a killed upgrade child left and
// checks that it holds the keys of the version 1 file, every key the child
// acknowledged, and at most one key more, which the child was recording.
func checkAfterUpgradeCrash(t *testing.T, path string, lines []string, want map[string]string) {
	t.Helper()
	s, err := OpenFileKeyStore(path)
	require.NoError(t, err, "a kill during the upgrade leaves a readable store")
	defer func() { require.NoError(t, s.Close()) }()
	pending := pendingMap(t, s)
	acked := 0
	for _, line := range lines {
		if op, ok := strings.CutPrefix(line, "A "); ok {
			assert.Equal(t, "k-"+op, pending[op], "acknowledged key of %s", op)
			acked++
		}
	}
	for op, key := range want {
		if pending[op] != key {
			assert.Equal(t, key, pending[op], "key of %s, pending in the version 1 file", op)
		}
	}
	for op, key := range pending {
		if _, ok := want[op]; ok {
			continue
		}
		var n int
		_, err := fmt.Sscanf(op, "new-%d", &n)
		if assert.NoError(t, err, "operation %s invented", op) {
			assert.LessOrEqual(t, n, acked, "operation %s never attempted", op)
			assert.Equal(t, "k-"+op, key)
		}
	}
}
