package idemtest_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/pgstore"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/idemtest"
)

// The variables that name the shared stores' servers; without them the
// soak's variants over those stores skip. scripts/with-services.sh sets
// both.
const (
	soakPostgresEnv = "IDEMHTTP_TEST_POSTGRES_DSN"
	soakRedisEnv    = "IDEMHTTP_TEST_REDIS_ADDR"
)

// soakBackend is a store the soak runs over, and how.
type soakBackend struct {
	name string
	env  string // the variable naming the store's server; "" for none
	// shared runs two servers over the store, requests spread across
	// them, and crashes one halfway through the first pass, starting
	// another in its place.
	shared bool
	// open returns a store of the test's own, emptied when t ends, and
	// where the handler's effect is kept.
	open func(t testing.TB) (idemserver.Store, soakEffects)
	// wrap, if set, wraps the store the servers share (a broken one, to
	// show the soak can fail).
	wrap func(idemserver.Store) idemserver.Store
}

// soakBackends lists the stores the soak runs over.
func soakBackends() []soakBackend {
	return []soakBackend{
		{name: "memory", open: openSoakMemory},
		{name: "memory/shared", shared: true, open: openSoakMemory},
		{name: "postgres/lease", env: soakPostgresEnv, shared: true, open: func(t testing.TB) (idemserver.Store, soakEffects) {
			return openSoakPostgres(t, false)
		}},
		{name: "postgres/transactional", env: soakPostgresEnv, shared: true, open: func(t testing.TB) (idemserver.Store, soakEffects) {
			return openSoakPostgres(t, true)
		}},
		{name: "redis", env: soakRedisEnv, shared: true, open: openSoakRedis},
	}
}

// skipUnset skips t when the store's server is not named.
func (b soakBackend) skipUnset(t testing.TB) {
	t.Helper()
	if b.env != "" && os.Getenv(b.env) == "" {
		t.Skipf("%s is not set; scripts/with-services.sh runs the soak over every store", b.env)
	}
}

// configs returns the shapes the soak runs over the store. A crash leaves
// claims that hold their keys for a lease, so shared stores run one shape
// by default, and every shape in long runs.
func (b soakBackend) configs(all []soakConfig) []soakConfig {
	if !b.shared || os.Getenv(soakEnvSeeds) != "" {
		return all
	}
	return []soakConfig{{"concurrent/mixed reads", 8, readModes, 0, nil}}
}

// instances returns how many servers run at once.
func (b soakBackend) instances() int {
	if b.shared {
		return 2
	}
	return 1
}

// server returns the middleware's options for the store.
func (b soakBackend) server() []idemserver.Option {
	if b.shared {
		return []idemserver.Option{idemserver.WithLease(soakLease)}
	}
	return nil
}

// soakEffects is where the handler's effect, a charge with its receipt,
// is kept.
type soakEffects interface {
	// charge records the receipt of op, for the request r.
	charge(r *http.Request, op, receipt string) error
	// receipts returns the receipts kept, per operation.
	receipts(t testing.TB) map[string][]string
}

// memoryEffects keeps charges in memory: the handler's effect is not the
// store's to undo.
type memoryEffects struct {
	mu   sync.Mutex
	kept map[string][]string
}

func (m *memoryEffects) charge(_ *http.Request, op, receipt string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.kept[op] = append(m.kept[op], receipt)
	return nil
}

func (m *memoryEffects) receipts(testing.TB) map[string][]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string][]string, len(m.kept))
	for op, r := range m.kept {
		out[op] = append([]string(nil), r...)
	}
	return out
}

// txEffects keeps charges in a table, written through the transaction of
// a transactional pgstore: a charge whose claim is rolled back is undone.
type txEffects struct {
	db    *sql.DB
	table string
}

func (e txEffects) charge(r *http.Request, op, receipt string) error {
	tx := pgstore.Tx(r.Context())
	if tx == nil {
		return errors.New("no transaction in the request's context")
	}
	_, err := tx.ExecContext(r.Context(), "INSERT INTO "+e.table+" (op, receipt) VALUES ($1, $2)", op, receipt)
	if err != nil {
		pgstore.Rerun(r.Context(), err)
	}
	return err
}

func (e txEffects) receipts(t testing.TB) map[string][]string {
	rows, err := e.db.QueryContext(context.Background(), "SELECT op, receipt FROM "+e.table+" ORDER BY id")
	require.NoError(t, err)
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var op, receipt string
		require.NoError(t, rows.Scan(&op, &receipt))
		out[op] = append(out[op], receipt)
	}
	require.NoError(t, rows.Err())
	return out
}

func openSoakMemory(t testing.TB) (idemserver.Store, soakEffects) {
	store := idemserver.NewMemoryStore()
	t.Cleanup(func() { _ = store.Close() })
	return store, &memoryEffects{kept: map[string][]string{}}
}

// soakName returns a name no other test uses.
func soakName() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "idemtest_soak_" + hex.EncodeToString(b)
}

// openSoakPostgres returns a pgstore over a table of the test's own, and
// with transactional, the handler's effects in a table of its own too;
// both are dropped when t ends.
func openSoakPostgres(t testing.TB, transactional bool) (idemserver.Store, soakEffects) {
	db, err := sql.Open("pgx", os.Getenv(soakPostgresEnv))
	require.NoError(t, err)
	db.SetMaxOpenConns(32)
	t.Cleanup(func() { _ = db.Close() })
	name := soakName()
	tables := []string{name}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+strings.Join(tables, ", "))
		assert.NoError(t, err)
	})
	opts := []pgstore.Option{pgstore.WithTable(name)}
	var effects soakEffects = &memoryEffects{kept: map[string][]string{}}
	if transactional {
		opts = append(opts, pgstore.WithTransactional())
		payments := name + "_payments"
		tables = append(tables, payments)
		_, err := db.ExecContext(t.Context(), "CREATE TABLE "+payments+
			" (id bigserial PRIMARY KEY, op text NOT NULL, receipt text NOT NULL)")
		require.NoError(t, err)
		effects = txEffects{db: db, table: payments}
	}
	store, err := pgstore.New(db, opts...)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(t.Context()))
	return store, effects
}

// openSoakRedis returns a redisstore under a key prefix of the test's
// own, whose keys are deleted when t ends.
func openSoakRedis(t testing.TB) (idemserver.Store, soakEffects) {
	client := redis.NewClient(&redis.Options{Addr: os.Getenv(soakRedisEnv), PoolSize: 32})
	t.Cleanup(func() { _ = client.Close() })
	prefix := soakName() + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		iter := client.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			assert.NoError(t, client.Del(ctx, iter.Val()).Err())
		}
		assert.NoError(t, iter.Err())
	})
	require.NoError(t, client.Ping(t.Context()).Err())
	return redisstore.New(client, redisstore.WithPrefix(prefix)), &memoryEffects{kept: map[string][]string{}}
}

// errCrashed is what a crashed server's calls to the store, and its
// clients' attempts, meet.
var errCrashed = errors.New("soak: the server crashed")

// A soakInstance is one server of a soak, one of those that share the
// store, and the switch that crashes it.
//
// A crash, with servers in the test's process, is modelled so: the
// connections of the server's clients are closed (the client side of
// each attempt ends, and the handler's context with its connection); a
// handler that has not acted yet never acts; and the server's calls to
// the store fail, so its claims are neither renewed, completed nor
// released: they hold their keys until their leases end, when another
// server may take them over. In transactional mode, the claim's
// transaction is rolled back instead, as the database does when a
// session dies, and the handler's effect with it.
//
// What it does not model: in lease mode, a crash between the handler's
// effect and the completion of its claim (an effect there is lost to the
// store, and runs again on the retry: such a store is not atomic with the
// handler's writes); the outcome of a handler that acted before the crash
// is written. Nor a crash within a store call, nor a half-sent response:
// those are the store's own crash tests' and the fault injector's.
type soakInstance struct {
	srv    *idemtest.Server
	host   string
	store  idemserver.Store // the shared store, as this server sees it
	ctx    context.Context  // ends when the server crashes
	cancel context.CancelFunc

	running atomic.Int64  // handlers running here
	started chan struct{} // a handler started here
	lost    atomic.Int64  // claims lost with the crash

	mu    sync.Mutex
	dead  bool
	acted map[idemserver.Key]bool // the keys whose handler acted here
}

// handling counts a handler running here until the function it returns
// is called.
func (in *soakInstance) handling() (done func()) {
	in.running.Add(1)
	select {
	case in.started <- struct{}{}:
	default:
	}
	return func() { in.running.Add(-1) }
}

// act runs the handler's effect f for r, unless the server has crashed.
func (in *soakInstance) act(r *http.Request, f func() error) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.dead {
		return errCrashed
	}
	if err := f(); err != nil {
		return err
	}
	if k, ok := idemserver.KeyFrom(r.Context()); ok {
		in.acted[k] = true
	}
	return nil
}

// crash crashes the server.
func (in *soakInstance) crash() {
	in.mu.Lock()
	in.dead = true
	in.mu.Unlock()
	in.cancel()
}

func (in *soakInstance) crashed() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.dead
}

// loses reports whether the claim of key is lost with the crash: all are,
// but in lease mode those whose handler acted, whose outcome is written
// (see soakInstance).
func (in *soakInstance) loses(key idemserver.Key, hold bool) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.dead && (hold || !in.acted[key])
}

// attemptErr returns the error of an attempt of req sent to the server:
// once the server has crashed, a reset connection, as a client would see.
func (in *soakInstance) attemptErr(req *http.Request, err error) error {
	if in.ctx.Err() != nil && req.Context().Err() == nil {
		return fmt.Errorf("%w: %w", errCrashed, syscall.ECONNRESET)
	}
	return err
}

// crashStore is the shared store as one server sees it: once the server
// has crashed, its calls fail (see soakInstance).
type crashStore struct {
	idemserver.Store
	in   *soakInstance
	hold bool
}

// newCrashStore returns store as in sees it, keeping its PackedStore
// methods and saying whether it holds responses as the store does.
func newCrashStore(store idemserver.Store, in *soakInstance) idemserver.Store {
	holder, ok := store.(idemserver.ResponseHolder)
	s := crashStore{Store: store, in: in, hold: ok && holder.HoldResponses()}
	if packed, ok := store.(idemserver.PackedStore); ok {
		return packedCrashStore{s, packed}
	}
	return s
}

func (s crashStore) HoldResponses() bool { return s.hold }

func (s crashStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	if s.in.crashed() {
		return idemserver.ClaimResult{}, errCrashed
	}
	return s.Store.Claim(ctx, c)
}

func (s crashStore) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	if s.in.crashed() {
		return idemserver.ClaimResult{}, errCrashed
	}
	return s.Store.TakeOver(ctx, c, expiredToken)
}

func (s crashStore) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	if err := s.lose(ctx, key, token); err != nil {
		return err
	}
	return s.Store.Complete(ctx, key, token, resp, expires)
}

// lose returns an error if the claim of key is lost with a crash, after
// rolling its transaction back if the store holds one.
func (s crashStore) lose(ctx context.Context, key idemserver.Key, token string) error {
	if !s.in.loses(key, s.hold) {
		return nil
	}
	s.in.lost.Add(1)
	if s.hold {
		return errors.Join(fmt.Errorf("%w: %w", errCrashed, idemserver.ErrRolledBack), s.Store.Release(ctx, key, token))
	}
	return errCrashed
}

func (s crashStore) Release(ctx context.Context, key idemserver.Key, token string) error {
	if s.hold {
		// A rollback, as the database does when the session dies.
		if s.in.crashed() {
			s.in.lost.Add(1)
		}
		return s.Store.Release(ctx, key, token)
	}
	if s.in.loses(key, false) {
		s.in.lost.Add(1)
		return errCrashed
	}
	return s.Store.Release(ctx, key, token)
}

func (s crashStore) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	if s.in.loses(key, s.hold) {
		return errCrashed
	}
	return s.Store.Extend(ctx, key, token, leaseExpires)
}

// packedCrashStore is a crashStore of a PackedStore.
type packedCrashStore struct {
	crashStore
	packed idemserver.PackedStore
}

func (s packedCrashStore) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	if s.in.crashed() {
		return idemserver.PackedClaimResult{}, errCrashed
	}
	return s.packed.ClaimPacked(ctx, c)
}

func (s packedCrashStore) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	if err := s.lose(ctx, c.Key, c.Token); err != nil {
		return err
	}
	return s.packed.CompletePacked(ctx, c)
}

// A soakCluster is the servers of a soak over one store, and the load
// balancer in front of them: an http.RoundTripper that sends each attempt
// to the next live server.
type soakCluster struct {
	store idemserver.Store
	start func(*soakInstance) *idemtest.Server
	url   string // what clients send to; the balancer picks the server
	base  *http.Transport

	mu   sync.Mutex
	live []*soakInstance
	all  []*soakInstance // live and crashed, for the ledgers
	next int
}

// newSoakCluster starts n servers over store, each made by start.
func newSoakCluster(t testing.TB, store idemserver.Store, n int, start func(*soakInstance) *idemtest.Server) *soakCluster {
	t.Helper()
	c := &soakCluster{store: store, start: start, url: "http://soak.test", base: &http.Transport{}}
	for range n {
		c.add()
	}
	return c
}

// add starts a server and puts it behind the balancer.
func (c *soakCluster) add() {
	in := &soakInstance{acted: map[idemserver.Key]bool{}, started: make(chan struct{}, 1)}
	in.ctx, in.cancel = context.WithCancel(context.Background())
	in.store = newCrashStore(c.store, in)
	in.srv = c.start(in)
	in.host = strings.TrimPrefix(in.srv.URL, "http://")
	c.mu.Lock()
	c.live = append(c.live, in)
	c.all = append(c.all, in)
	c.mu.Unlock()
}

// restart crashes the oldest live server, with requests in flight, and
// starts another over the same store in its place. It waits, a little, for
// a handler to be running there, so that the crash has one to abandon.
func (c *soakCluster) restart() {
	c.mu.Lock()
	old := c.live[0]
	c.mu.Unlock()
	wait := time.NewTimer(time.Second)
	defer wait.Stop()
waiting:
	for old.running.Load() == 0 {
		select {
		case <-old.started:
		case <-wait.C:
			break waiting
		}
	}
	c.add()
	c.mu.Lock()
	c.live = c.live[1:]
	c.mu.Unlock()
	old.crash()
	old.srv.Close()
}

// client returns a client of the cluster whose Transport is an
// idemhttp.Transport configured by opts.
func (c *soakCluster) client(opts ...idemhttp.Option) *http.Client {
	return &http.Client{Transport: idemhttp.NewTransport(c, opts...)}
}

// RoundTrip sends req to the next live server; the attempt ends, as if
// its connection were reset, if that server crashes.
func (c *soakCluster) RoundTrip(req *http.Request) (*http.Response, error) {
	c.mu.Lock()
	in := c.live[c.next%len(c.live)]
	c.next++
	c.mu.Unlock()
	ctx, cancel := context.WithCancel(req.Context())
	stop := context.AfterFunc(in.ctx, cancel)
	out := req.Clone(ctx)
	out.URL.Host, out.Host = in.host, ""
	resp, err := c.base.RoundTrip(out)
	if err != nil {
		stop()
		cancel()
		return nil, in.attemptErr(req, err)
	}
	resp.Body = &soakBody{ReadCloser: resp.Body, in: in, req: req, done: func() { stop(); cancel() }}
	return resp, nil
}

// soakBody is the body of a response from a server of a soakCluster.
type soakBody struct {
	io.ReadCloser
	in   *soakInstance
	req  *http.Request
	done func()
}

func (b *soakBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		err = b.in.attemptErr(b.req, err)
	}
	return n, err
}

func (b *soakBody) Close() error {
	err := b.ReadCloser.Close()
	b.done()
	return err
}

// close shuts every server down, waiting for their handlers. It is
// idempotent.
func (c *soakCluster) close() {
	c.mu.Lock()
	all := append([]*soakInstance(nil), c.all...)
	c.mu.Unlock()
	for _, in := range all {
		in.srv.Close()
		in.cancel()
	}
	c.base.CloseIdleConnections()
}

// stats returns what each server's fault injector did.
func (c *soakCluster) stats() []idemtest.Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]idemtest.Stats, len(c.all))
	for i, in := range c.all {
		out[i] = in.srv.Stats()
	}
	return out
}

// lost returns how many claims the servers lost in crashes.
func (c *soakCluster) lost() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var n int64
	for _, in := range c.all {
		n += in.lost.Load()
	}
	return n
}

// assertExactlyOnce checks, as idemtest.Server.AssertExactlyOnce does for
// one server, that the servers together executed operations keys, each
// once, and replayed only the answers given.
//
// Each server's ledger knows only the runs it served. A key whose run on
// one server was discarded (rolled back, or released) and that then
// executed on another is, to the first, a key that gave no answer to keep:
// its replays there of the other's answer are not held against it. They
// are checked all the same, by the payers: each saw the one answer kept.
func (c *soakCluster) assertExactlyOnce(t testing.TB, operations int) bool {
	t.Helper()
	if len(c.all) == 1 {
		return c.all[0].srv.AssertExactlyOnce(t, operations)
	}
	ok := true
	runs := make([]map[string]int, len(c.all))
	total := map[string]int{}
	for i, in := range c.all {
		runs[i] = in.srv.Executions()
		for k, n := range runs[i] {
			total[k] += n
		}
	}
	for i, in := range c.all {
		for _, w := range in.srv.WrongReplays() {
			key, _, _ := strings.Cut(w, " (")
			if runs[i][key] == 0 && total[key] > 0 {
				continue // executed by another server
			}
			ok = assert.Fail(t, "replay not the handler's answer", "server %d: %s", i, w) && ok
		}
	}
	for k, n := range total {
		ok = assert.Equal(t, 1, n, "key %s: executions over all servers", k) && ok
	}
	return assert.Len(t, total, operations, "keys executed over all servers") && ok
}
