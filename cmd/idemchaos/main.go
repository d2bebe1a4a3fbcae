// Command idemchaos proves the idemhttp client and the idemserver middleware
// exactly-once end to end, with real processes and real sockets: it runs a
// payment scenario through faults and client kills and checks that every
// payment was executed exactly once.
//
// It starts, as child processes of its own binary, a payment server behind
// idemserver.Middleware, whose handler appends every payment it executes to
// a ledger file (fsynced, outside the server process), and a client worker
// that makes the payments through idemhttp with a FileKeyStore, each named
// with idemhttp.WithOperation. Between them runs an idemtest.Proxy that
// resets connections, drops responses after the server acted, answers 503
// and 429, delays and stalls requests. During the run the client is killed
// with SIGKILL at random moments and started again; each new worker first
// drives every operation its key store has pending to a final outcome, then
// makes the payments not yet made. The worker records each payment it saw
// succeed (fsynced) before it lets the key go.
//
// At the end every payment must have been driven to completion, so the
// ledger must hold each operation exactly once: an operation executed more
// than once is a duplicate, one executed never is lost. The report has lines
// that read "duplicates: N" and "lost: N", and counts the attempts (requests
// that reached the proxy), the retries (attempts beyond one per operation),
// the replays served (responses marked Idempotent-Replayed that passed the
// proxy, including those it then dropped), the faults injected, the client
// kills, the server restarts, the seed and the wall time. idemchaos exits
// with status 1, naming the operations, if there are duplicates or lost
// operations, or operations the client never saw succeed; with status 2 if
// the scenario could not be run.
//
// Usage:
//
//	idemchaos [flags]
//
// With no flags it runs a short scenario: 300 operations through 20% of
// faulted requests, 3 client kills, the memory store. The flags are:
//
//	-ops N              operations to make (default 300)
//	-workers N          operations the client makes at once (default 8)
//	-client-kills N     times the client is killed with SIGKILL (default 3)
//	-server-restarts N  times the server is killed and restarted (default 0;
//	                    persistent stores only: the memory store would lose
//	                    every key)
//	-faults P           share of requests the proxy faults (default 0.2)
//	-store NAME         the server's store: memory, postgres, postgres-tx, redis
//	-seed N             seed of the faults and the kill moments (default random)
//	-timeout D          bound on the whole run (default 5m)
//	-dir PATH           keep the run's files (ledger, key store, client log)
//	                    in PATH instead of a temporary directory
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// roleEnv names the role of a child process: roleServer or roleClient.
const roleEnv = "IDEMCHAOS_ROLE"

const (
	roleServer = "server"
	roleClient = "client"
)

// Exit statuses.
const (
	exitFailed = 1 // duplicates, lost or unfinished operations
	exitError  = 2 // the scenario could not be run
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch role := os.Getenv(roleEnv); role {
	case "":
		os.Exit(runScenario(ctx, os.Args[1:], os.Stdout, os.Stderr))
	case roleServer:
		err = serve(ctx, os.Args[1:])
	case roleClient:
		err = work(ctx, os.Args[1:])
	default:
		err = fmt.Errorf("unknown %s %q", roleEnv, role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "idemchaos %s: %v\n", os.Getenv(roleEnv), err)
		os.Exit(exitError)
	}
}
