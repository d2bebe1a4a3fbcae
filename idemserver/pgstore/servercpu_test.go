package pgstore

import (
	"database/sql"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// serverCPU returns the CPU time, user and system, that the PostgreSQL
// server behind db has used so far: its postmaster's, its exited children's
// (which the postmaster has reaped) and its running children's. It reads
// the server's postmaster.pid and /proc, so it reports false unless the
// server runs on this Linux machine and this process may read its data
// directory, as it may under scripts/with-postgres.sh run by root or by
// the server's own user.
func serverCPU(db *sql.DB) (time.Duration, bool) {
	var dir string
	if err := db.QueryRow("SHOW data_directory").Scan(&dir); err != nil {
		return 0, false
	}
	pidFile, err := os.ReadFile(filepath.Join(dir, "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	first, _, _ := strings.Cut(string(pidFile), "\n")
	postmaster, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return 0, false
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, false
	}
	var ticks int64
	found := false
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		st, ok := procStat(pid)
		switch {
		case !ok:
		case pid == postmaster:
			ticks += st.utime + st.stime + st.cutime + st.cstime
			found = true
		case st.ppid == postmaster:
			ticks += st.utime + st.stime
		}
	}
	// /proc counts in USER_HZ, which Linux fixes at 100 per second.
	return time.Duration(ticks) * 10 * time.Millisecond, found
}

// stat holds the fields of /proc/<pid>/stat that serverCPU reads.
type stat struct {
	ppid                         int
	utime, stime, cutime, cstime int64
}

// procStat reads /proc/<pid>/stat; it reports false for a process that
// has gone or a line it cannot parse.
func procStat(pid int) (stat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return stat{}, false
	}
	// The command name, in parentheses, may hold spaces: the fields
	// that follow start after its last ')', with the state (field 3).
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return stat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return stat{}, false
	}
	var st stat
	var errs [5]error
	st.ppid, errs[0] = strconv.Atoi(f[1])
	st.utime, errs[1] = strconv.ParseInt(f[11], 10, 64)
	st.stime, errs[2] = strconv.ParseInt(f[12], 10, 64)
	st.cutime, errs[3] = strconv.ParseInt(f[13], 10, 64)
	st.cstime, errs[4] = strconv.ParseInt(f[14], 10, 64)
	for _, err := range errs {
		if err != nil {
			return stat{}, false
		}
	}
	return st, true
}

func TestProcStatReadsThisProcess(t *testing.T) {
	st, ok := procStat(os.Getpid())
	if !ok {
		t.Skip("no /proc on this machine")
	}
	assert.Equal(t, os.Getppid(), st.ppid)
	_, ok = procStat(-1)
	assert.False(t, ok, "a process that does not exist")
}

func TestServerCPUCountsTheServersWork(t *testing.T) {
	db := newTestDB(t, 2)
	before, ok := serverCPU(db.DB)
	if !ok {
		t.Skip("the server's CPU time cannot be read from here")
	}
	// Work that takes the server far more CPU than /proc's 10 ms tick.
	var n int64
	require.NoError(t, db.QueryRow("SELECT count(*) FROM generate_series(1, 5000000)").Scan(&n))
	after, ok := serverCPU(db.DB)
	require.True(t, ok)
	assert.Greater(t, after-before, 50*time.Millisecond, "the server counted 5,000,000 rows")
}
