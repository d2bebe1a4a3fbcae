package main

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// persistentStores are the stores that outlive the server process, with
// the variable whose value the tests need; a test of a store skips when it
// is unset (scripts/with-services.sh sets both).
var persistentStores = []struct {
	name, variable string
}{
	{"postgres", "IDEMHTTP_TEST_POSTGRES_DSN"},
	{"postgres-tx", "IDEMHTTP_TEST_POSTGRES_DSN"},
	{"redis", "IDEMHTTP_TEST_REDIS_ADDR"},
}

// storeArgs returns the flags that run a scenario on store, or skips t.
func storeArgs(t *testing.T, store, variable string) []string {
	t.Helper()
	v := os.Getenv(variable)
	if v == "" {
		t.Skipf("%s is not set; scripts/with-services.sh runs the tests beside PostgreSQL and Redis", variable)
	}
	if store == "redis" {
		return []string{"-store", store, "-redis", v}
	}
	return []string{"-store", store, "-dsn", v}
}

// TestServerRestarts runs a short scenario on each persistent store through
// faults, a client kill and server kills with SIGKILL, each landing just
// after a handler's effect: every payment takes effect exactly once, the
// restarted servers serve on the same socket, and the run's schema or key
// prefix is gone afterwards.
func TestServerRestarts(t *testing.T) {
	for _, s := range persistentStores {
		t.Run(s.name, func(t *testing.T) {
			args := append(storeArgs(t, s.name, s.variable), "-ops", "120", "-workers", "6",
				"-client-kills", "1", "-server-restarts", "2", "-seed", "11")
			status, report := chaos(t, args...)
			assert.Equal(t, 0, status)
			assert.Equal(t, 0, count(t, report, "duplicates"))
			assert.Equal(t, 0, count(t, report, "lost"))
			assert.Equal(t, 120, count(t, report, "operations"))
			assert.Equal(t, 2, count(t, report, "server restarts"))
			assert.Equal(t, 1, count(t, report, "client kills"))
			assert.Equal(t, 0, count(t, report, "new keys after cut bodies"))
			assert.Contains(t, report, "PASS: every operation took effect exactly once")
			assertSpaceRemoved(t, s.name, report)
		})
	}
}

// TestUnsafeEffectCaught runs the scenarios of TestServerRestarts with a
// handler whose effect the guarantee does not cover: in lease mode it
// forwards no key to the provider, and with postgres-tx it pays outside the
// claim's transaction. Server kills between the payment and the stored
// response then pay twice, and idemchaos must say so; this shows that the
// kills land mid-handler and that the checks of TestServerRestarts could
// fail.
func TestUnsafeEffectCaught(t *testing.T) {
	for _, s := range persistentStores {
		t.Run(s.name, func(t *testing.T) {
			args := append(storeArgs(t, s.name, s.variable), "-"+unsafeEffectFlag, "-ops", "80", "-workers", "6",
				"-client-kills", "0", "-server-restarts", "3", "-seed", "12")
			status, report := chaos(t, args...)
			assert.Equal(t, exitFailed, status)
			assert.Positive(t, count(t, report, "duplicates"))
			assert.Equal(t, 0, count(t, report, "lost"))
			// An operation whose handler more than one server kill
			// interrupted is paid once more for each.
			assert.Regexp(t, `(?m)^duplicated operations: op-\d\d \([2-9] executions\)`, report)
			assert.Contains(t, report, "FAIL")
		})
	}
}

// assertSpaceRemoved checks that the schema or key prefix the report names
// no longer exists.
func assertSpaceRemoved(t *testing.T, store, report string) {
	t.Helper()
	m := regexp.MustCompile(`\((?:schema|key prefix) (idemchaos_[0-9a-f]+):?, `).FindStringSubmatch(report)
	require.NotNil(t, m, "the report names no schema or key prefix")
	spec := storeSpec{name: store, space: m[1],
		dsn: os.Getenv("IDEMHTTP_TEST_POSTGRES_DSN"), redisAddr: os.Getenv("IDEMHTTP_TEST_REDIS_ADDR")}
	ctx := context.Background()
	if strings.HasPrefix(store, "postgres") {
		db, err := openDB(ctx, spec.dsn)
		require.NoError(t, err)
		defer db.Close()
		var n int
		require.NoError(t, db.QueryRowContext(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", spec.space).Scan(&n))
		assert.Zero(t, n, "schema %s still exists", spec.space)
		return
	}
	client, err := spec.redis(ctx)
	require.NoError(t, err)
	defer client.Close()
	keys, err := prefixed(ctx, client, spec.redisPrefix())
	require.NoError(t, err)
	assert.Empty(t, keys, "keys with prefix %s remain", spec.redisPrefix())
}

// TestTooFewRestartsIncomplete runs, on each persistent store, a scenario
// whose one operation is done before a second server restart could follow
// progress made since the first: the run reports INCOMPLETE and exits
// with exitIncomplete.
func TestTooFewRestartsIncomplete(t *testing.T) {
	for _, s := range persistentStores {
		t.Run(s.name, func(t *testing.T) {
			args := append(storeArgs(t, s.name, s.variable), "-ops", "1", "-workers", "1",
				"-client-kills", "0", "-server-restarts", "2", "-faults", "0", "-seed", "9")
			status, report := chaos(t, args...)
			assert.Equal(t, exitIncomplete, status)
			assert.Less(t, count(t, report, "server restarts"), 2)
			assert.Equal(t, 0, count(t, report, "duplicates"))
			assert.Equal(t, 0, count(t, report, "lost"))
			assert.Regexp(t, `(?m)^INCOMPLETE: asked for 0 client kills and 2 server restarts, made 0 client kills and [01] server restarts?`, report)
			assert.NotContains(t, report, "PASS")
			assertSpaceRemoved(t, s.name, report)
		})
	}
}
