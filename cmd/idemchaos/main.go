// Command idemchaos proves the idemhttp client and the idemserver middleware
// exactly-once end to end, with real processes and real sockets: it runs a
// payment scenario through faults, client kills and server kills, and
// checks that every payment took effect exactly once.
//
// It starts, as child processes of its own binary, a payment server behind
// idemserver.Middleware and a client worker that makes the payments through
// idemhttp with a FileKeyStore, each named with idemhttp.WithOperation.
// Between them runs an idemtest.Proxy that resets connections, drops
// responses after the server acted, cuts the body of some of them after
// the server stored the outcome, answers 503 and 429, delays and stalls
// requests. A 201 whose body the worker cannot read to its end must leave
// the operation's key pending (the Transport releases it only once the
// body is read to EOF): the worker calls the operation again at once and
// must be answered under the same key, by a replay; a new key there means
// the key was released on the header, and the call pays again. A cut
// never answered again means the same (the worker was killed before it
// called again, and its successor found the key no longer pending).
// During the run the client is killed with SIGKILL at random moments and
// started again; each new worker first drives every operation its key
// store has pending to a final outcome, then makes the payments not yet
// made. The worker records each payment it saw succeed (fsynced) before
// it lets the key go. With a store that outlives the server process, the
// server is killed with SIGKILL too, each time just after a handler made
// its payment and before it answered, and started again on the same
// listening socket, which the parent holds, so that the proxy keeps
// forwarding to it.
//
// The server's handler records each payment in a ledger outside the server
// process. With the memory, postgres and redis stores (lease mode) it
// charges a payment provider, played by a ledger file, under a key derived
// from the claimed one (idemserver.KeyFrom, Key.Derive), and the provider
// makes one charge per key: a server killed between the charge and the
// stored response leaves its claim in progress, a retry takes it over once
// its lease has ended and runs the handler again, and the provider replays
// the charge. Those runs are counted, and allowed, as are runs again by
// the same server after the middleware reported a claim left in progress
// (the store failed to keep the outcome, or the lease was lost). With
// postgres-tx the handler inserts the payment into a payments table in the
// claim's transaction, and the table is the ledger.
//
// At the end every payment must have been driven to completion, so the
// ledger must hold each operation exactly once: an operation paid more than
// once, or whose handler one server process ran twice without cause, or a
// later server ran again after its outcome was stored, is a duplicate; one paid never is lost. Every answer the client accepts, first
// or replayed, must be the operation's own receipt, body and Content-Type;
// one that is not is a wrong answer. Once the client is done, every operation is sent once more,
// straight to the server, with the key the client completed it with, and
// must be answered 201 with its receipt; one answered by a run of the
// handler rather than a replay had its outcome forgotten, unless the ledger
// shows a run that lease mode allows (see replaycheck.go). The report has
// lines that read "duplicates: N", "lost: N", "wrong answers: N", "wrong
// answers at the end: N", "new keys after cut bodies: N" and "cut bodies
// never answered again: N", and counts the attempts (requests that reached
// the proxy), the retries (attempts beyond one per operation), the replays served
// (responses marked Idempotent-Replayed that passed the proxy, including
// those it then dropped), the faults injected, the re-executions after
// server kills (lease mode) or the handler runs rolled back (postgres-tx),
// the client kills, the server restarts, the seed and the wall time.
// idemchaos exits with status 1, naming the operations, if there are
// duplicates, lost operations, wrong answers (during the run or at its
// end), new keys after cut bodies or cut bodies never answered again, or
// operations the client never saw succeed; with status 2 if the
// scenario could not be run, or if it ran but made fewer client kills or
// server restarts than asked (each is due once a share of the operations
// is done, only while some are left and after progress since the last
// one, so a short run can end first): a line "INCOMPLETE: asked for ...,
// made ..." then says so, in place of the PASS line, since such a run
// proves nothing about the kills it did not make.
//
// Each run with PostgreSQL works in a schema of its own, and with Redis
// under a key prefix of its own; both are named in the report and removed
// at the end.
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
//	-store NAME         the server's store: memory, postgres (lease mode),
//	                    postgres-tx (transactional mode), redis
//	-dsn DSN            PostgreSQL connection string (default
//	                    $IDEMHTTP_POSTGRES_DSN, else $IDEMHTTP_TEST_POSTGRES_DSN)
//	-redis HOST:PORT    Redis server (default $IDEMHTTP_TEST_REDIS_ADDR)
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
	// exitIncomplete: the scenario ran, but made fewer client kills or
	// server restarts than asked, so it proves less than it claims.
	exitIncomplete = 2
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
