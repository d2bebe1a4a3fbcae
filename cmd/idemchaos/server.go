package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/pgstore"
)

// listenerFD is the descriptor of the listening socket a server child
// inherits from the parent, the first of exec.Cmd.ExtraFiles, so that a
// restarted server listens on the same address.
const listenerFD = 3

// afterEffect is the work the handler does between its effect and its
// answer (a receipt to write): it gives a server kill a window in which to
// land between the payment and the stored response, the moment that tests
// the store.
const afterEffect = 10 * time.Millisecond

// serve is the server child: a payment handler behind idemserver.Middleware
// that records every payment it executes in the ledger before it answers.
func serve(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleServer, flag.ContinueOnError)
	ledgerPath := fs.String("ledger", "", "the ledger file")
	spec := storeSpec{dsn: os.Getenv(dsnEnv)}
	fs.StringVar(&spec.name, "store", "memory", "the store")
	fs.StringVar(&spec.space, "space", "", "the run's schema or key prefix")
	fs.StringVar(&spec.redisAddr, "redis", "", "the Redis server")
	number := fs.Int("server", 0, "this server process's number: 0, then 1 after the first restart...")
	unsafe := fs.Bool(unsafeFlag, false, "serve without the middleware")
	unsafeEffect := fs.Bool(unsafeEffectFlag, false, "no forwarded key; with postgres-tx, no transaction")
	ttl := fs.Duration(unsafeTTLFlag, 0, "the middleware's retention of outcomes (0: its default)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ln, err := net.FileListener(os.NewFile(listenerFD, "listener"))
	if err != nil {
		return fmt.Errorf("inherited listener: %w", err)
	}
	store, closeStore, err := spec.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()

	var handler http.Handler
	opts := []idemserver.Option{idemserver.RequireKey(), idemserver.WithLease(serverLease), idemserver.WithTTL(*ttl)}
	if spec.transactional() {
		runs, err := openLineLog(*ledgerPath)
		if err != nil {
			return err
		}
		defer runs.Close()
		var outside *sql.DB // the pool: the payment commits at once
		if *unsafeEffect {
			if outside, err = openDB(ctx, spec.dsn); err != nil {
				return err
			}
			defer outside.Close()
		}
		handler = insertPayment(spec.paymentsTable(), runs, *number, outside)
	} else {
		p, err := openProvider(*ledgerPath, *number)
		if err != nil {
			return err
		}
		defer p.Close()
		handler = chargePayment(p, !*unsafeEffect)
		opts = append(opts, idemserver.WithObserver(observe(p)))
	}
	if !*unsafe {
		handler = idemserver.Middleware(store, opts...)(handler)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /pay/{op}", handler)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	fmt.Println("ready") // the parent waits for this line
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// chargePayment is the handler of the memory, postgres and redis stores:
// it charges the payment at the provider, under a key derived from the
// claimed one (if forward; otherwise under none), and answers 201 with a
// receipt.
func chargePayment(p *provider, forward bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op := r.PathValue("op")
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		key := noKey
		if k, ok := idemserver.KeyFrom(r.Context()); ok && forward {
			key = k.Derive("charge")
		}
		if err := p.charge(op, key); err != nil {
			http.Error(w, "ledger: "+err.Error(), http.StatusInternalServerError)
			return
		}
		receipt(w, op)
	})
}

// observe returns the observer that records in the ledger each claim the
// middleware left in progress while its server went on: one whose outcome
// the store failed to keep, or whose lease was lost. A retry takes it over
// once its lease has ended and runs the handler again, in the same server
// process, as lease mode allows. It also records each outcome the store
// kept, after which no server may run the handler for the key again.
func observe(p *provider) func(idemserver.Event) {
	return func(ev idemserver.Event) {
		var err error
		switch {
		case ev.Outcome == idemserver.OutcomeExecuted && ev.Err == nil:
			err = p.stored(ev.Request.PathValue("op"), ev.Key.Derive("charge"))
		case ev.Outcome == idemserver.OutcomeExecuted, errors.Is(ev.Err, idemserver.ErrLeaseLost):
			err = p.unsettled(ev.Request.PathValue("op"), ev.Key.Derive("charge"))
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "idemchaos server: ledger:", err)
		}
	}
}

// insertPayment is the handler of the postgres-tx store: it inserts the
// payment into the payments table in the claim's transaction, so that it
// commits with the stored response or not at all, and answers 201 with a
// receipt. It notes each run in runs, after the insert, so that a server
// kill that follows the note lands inside the transaction. Given outside,
// it inserts there instead, outside the transaction: an effect that the
// store cannot undo.
func insertPayment(table string, runs *lineLog, server int, outside *sql.DB) http.Handler {
	insert := "INSERT INTO " + table + " (op, key, server) VALUES ($1, $2, $3)"
	number := strconv.Itoa(server)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op := r.PathValue("op")
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ctx := r.Context()
		k, _ := idemserver.KeyFrom(ctx)
		var db interface {
			ExecContext(context.Context, string, ...any) (sql.Result, error)
		} = outside
		if outside == nil {
			tx := pgstore.Tx(ctx)
			if tx == nil {
				http.Error(w, "no transaction: the request was not claimed", http.StatusInternalServerError)
				return
			}
			db = tx
		}
		if _, err := db.ExecContext(ctx, insert, op, k.Key, server); err != nil {
			pgstore.Rerun(ctx, err)
			http.Error(w, "payments: "+err.Error(), http.StatusInternalServerError)
			return
		}
		if err := runs.append(false, kindRan, op, k.Key, number); err != nil {
			http.Error(w, "runs: "+err.Error(), http.StatusInternalServerError)
			return
		}
		receipt(w, op)
	})
}

// receipt waits afterEffect and answers 201 with the receipt of op.
func receipt(w http.ResponseWriter, op string) {
	time.Sleep(afterEffect)
	w.Header().Set("Content-Type", receiptType)
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, receiptOf(op))
}

// receiptType is the Content-Type of every receipt, first or replayed.
const receiptType = "application/json"

// receiptOf is the body of op's receipt: every answer to op, first or
// replayed, must be exactly this.
func receiptOf(op string) string { return fmt.Sprintf(`{"op":%q,"status":"paid"}`, op) }
