package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// listenerFD is the descriptor of the listening socket a server child
// inherits from the parent, the first of exec.Cmd.ExtraFiles, so that a
// restarted server listens on the same address.
const listenerFD = 3

// serve is the server child: a payment handler behind idemserver.Middleware
// that appends every payment it executes to the ledger before it answers.
func serve(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleServer, flag.ContinueOnError)
	ledgerPath := fs.String("ledger", "", "the ledger file")
	storeName := fs.String("store", "memory", "the store")
	unsafe := fs.Bool("unsafe-no-middleware", false, "serve without the middleware")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ledger, err := openLineLog(*ledgerPath)
	if err != nil {
		return err
	}
	defer ledger.Close()
	ln, err := net.FileListener(os.NewFile(listenerFD, "listener"))
	if err != nil {
		return fmt.Errorf("inherited listener: %w", err)
	}
	store, closeStore, err := openStore(ctx, *storeName)
	if err != nil {
		return err
	}
	defer closeStore()

	var handler http.Handler = payments(ledger)
	if !*unsafe {
		handler = idemserver.Middleware(store, idemserver.RequireKey())(handler)
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

// payments is the payment handler: it records the payment in the ledger,
// durably, and answers 201 with a receipt.
func payments(ledger *lineLog) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op := r.PathValue("op")
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		key := r.Header.Get(idemserver.DefaultKeyHeader)
		if err := ledger.append(true, "executed", op, key); err != nil {
			http.Error(w, "ledger: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"op":%q,"status":"paid"}`, op)
	})
}
