package pgstore

import (
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
)

// A privateServer is a PostgreSQL server of one test's own, which the test
// can crash and start again, as a server whose machine lost its power, or
// whose container was killed, comes back. It listens on a socket in its
// directory only.
type privateServer struct {
	t    testing.TB
	bin  string // PostgreSQL's programs
	dir  string
	data string
	dsn  string
}

// privatePort is the port that names the private server's socket.
const privatePort = "5432"

// startPrivateServer creates and starts a private server, stopped and
// removed when the test ends. It skips the test where the shared server
// is not named either (scripts/with-postgres.sh names one, and makes sure
// PostgreSQL's programs are there), and fails it where they are missing.
// Run by root, the server runs as the postgres user.
func startPrivateServer(t testing.TB) *privateServer {
	t.Helper()
	if os.Getenv(dsnVariable) == "" {
		t.Skipf("%s is not set; scripts/with-postgres.sh runs the tests with a throwaway PostgreSQL", dsnVariable)
	}
	bin := os.Getenv("PGBIN")
	if bin == "" {
		bin = "/usr/lib/postgresql/15/bin" // where scripts/with-postgres.sh looks
	}
	dir, err := os.MkdirTemp("", "pgstore-server-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	srv := &privateServer{t: t, bin: bin, dir: dir, data: filepath.Join(dir, "data"),
		dsn: fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable", dir, privatePort)}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		require.NoError(t, err, "PostgreSQL does not run as root")
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		require.NoError(t, os.Chown(dir, uid, gid))
	}
	srv.run("initdb", "-D", srv.data, "-A", "trust", "-U", "postgres", "--no-sync")
	srv.start()
	t.Cleanup(func() { srv.run("pg_ctl", "-D", srv.data, "-m", "immediate", "-w", "stop") })
	return srv
}

// run runs one of PostgreSQL's programs as the server's user.
func (srv *privateServer) run(program string, args ...string) {
	srv.t.Helper()
	path := filepath.Join(srv.bin, program)
	cmd := exec.Command(path, args...)
	if os.Geteuid() == 0 {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	out, err := cmd.CombinedOutput()
	require.NoError(srv.t, err, "%s: %s", program, out)
}

// start starts the server. Autovacuum is off, so that no transaction but
// the test's takes a transaction id, and the WAL writer waits 10 s between
// rounds, so that a transaction that has not committed for less than that
// has its WAL in the server's memory only, and a crash loses it.
func (srv *privateServer) start() {
	srv.t.Helper()
	srv.run("pg_ctl", "-D", srv.data, "-l", filepath.Join(srv.dir, "server.log"), "-w", "-t", "30", "start",
		"-o", "-p "+privatePort+" -k "+srv.dir+" -c listen_addresses='' -c autovacuum=off -c wal_writer_delay=10s")
}

// crash stops the server at once, as a power loss does (nothing is
// flushed, and the next start recovers from the WAL), and starts it again.
func (srv *privateServer) crash() {
	srv.t.Helper()
	srv.run("pg_ctl", "-D", srv.data, "-m", "immediate", "-w", "stop")
	srv.start()
}

// crashProcess kills a process of the server, as the kernel's OOM killer
// does, and waits for the server to be back: the server ends every other
// session too, and recovers from the WAL, without restarting itself.
func (srv *privateServer) crashProcess() {
	srv.t.Helper()
	victim, witness := srv.open(srv.t, 1), srv.open(srv.t, 1)
	var pid int
	require.NoError(srv.t, victim.QueryRowContext(srv.t.Context(), "SELECT pg_backend_pid()").Scan(&pid))
	require.NoError(srv.t, witness.PingContext(srv.t.Context()))
	require.NoError(srv.t, syscall.Kill(pid, syscall.SIGKILL))
	require.Eventually(srv.t, func() bool {
		return witness.QueryRowContext(srv.t.Context(), "SELECT").Scan() != nil
	}, 30*time.Second, 10*time.Millisecond, "the server ends every session")
	require.Eventually(srv.t, func() bool {
		pool := srv.open(srv.t, 1)
		defer pool.Close()
		return pool.PingContext(srv.t.Context()) == nil
	}, 30*time.Second, 10*time.Millisecond, "the server recovers")
}

// setNextXid makes the server's next transaction id xid of epoch epoch, as
// on a server that has run that many transactions: it freezes every row,
// whose creators' ids would otherwise seem to come after it, and restarts
// the server with pg_resetwal's new counter. xid must be the first of a
// commit log segment (a multiple of 2^20), whose file the server then
// creates.
func (srv *privateServer) setNextXid(epoch, xid uint32) {
	srv.t.Helper()
	srv.run("vacuumdb", "-h", srv.dir, "-p", privatePort, "-U", "postgres", "--all", "--freeze", "--quiet")
	srv.run("pg_ctl", "-D", srv.data, "-m", "fast", "-w", "stop")
	x := strconv.FormatUint(uint64(xid), 10)
	srv.run("pg_resetwal", "-D", srv.data, "-e", strconv.FormatUint(uint64(epoch), 10), "-x", x, "-u", x)
	srv.start()
}

// open returns a pool on the server, closed when the test ends.
func (srv *privateServer) open(t testing.TB, maxConns int) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(srv.dsn)
	require.NoError(t, err)
	pool := stdlib.OpenDB(*cfg)
	pool.SetMaxOpenConns(maxConns)
	pool.SetMaxIdleConns(maxConns)
	t.Cleanup(func() { _ = pool.Close() })
	return pool
}
