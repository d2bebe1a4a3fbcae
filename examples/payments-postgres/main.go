// Command payments-postgres runs a payment service whose handler debits an
// account and records the payment in the same PostgreSQL transaction as its
// idempotency record, behind idemserver and pgstore in transactional mode,
// and pays from it through an idemhttp client over a connection that loses
// some responses after the payment was made.
//
// Every lost response is retried with the same key and replayed from the
// table: the account is debited once per payment, however often the client
// had to ask. The program prints each payment and checks the balance.
//
//	go run ./examples/payments-postgres -dsn postgres://user@localhost/db
//
// The DSN may also come from IDEMHTTP_POSTGRES_DSN. Without a database, start
// a throwaway one for the run:
//
//	scripts/with-postgres.sh sh -c 'go run ./examples/payments-postgres -dsn "$IDEMHTTP_TEST_POSTGRES_DSN"'
//
// It works in a schema of its own (-schema, default payments_example), which
// it drops and creates again at the start.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/pgstore"
)

// dsnVariable is where the DSN comes from without -dsn.
const dsnVariable = "IDEMHTTP_POSTGRES_DSN"

func main() {
	dsn := flag.String("dsn", os.Getenv(dsnVariable), "PostgreSQL connection string (default $"+dsnVariable+")")
	schema := flag.String("schema", "payments_example", "schema to (re)create and work in")
	n := flag.Int("n", 10, "number of payments")
	flag.Parse()
	if err := run(context.Background(), os.Stdout, *dsn, *schema, *n); err != nil {
		fmt.Fprintln(os.Stderr, "payments-postgres:", err)
		os.Exit(1)
	}
}

// errNoDatabase says how to get a database.
var errNoDatabase = errors.New("no PostgreSQL to use; pass -dsn or set " + dsnVariable +
	", or start a throwaway server for the run with\n\n" +
	`    scripts/with-postgres.sh sh -c 'go run ./examples/payments-postgres -dsn "$IDEMHTTP_TEST_POSTGRES_DSN"'`)

const (
	startBalance = 10_000
	amount       = 125
)

func run(ctx context.Context, out io.Writer, dsn, schema string, payments int) error {
	if dsn == "" {
		return errNoDatabase
	}
	db, err := open(ctx, dsn, schema)
	if err != nil {
		return err
	}
	defer db.Close()

	store, err := pgstore.New(db, pgstore.WithTransactional())
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	var lost atomic.Int64
	srv := httptest.NewServer(loseEveryThird(idemserver.Middleware(store, idemserver.RequireKey())(http.HandlerFunc(pay)), &lost))
	defer srv.Close()

	client := idemhttp.NewClient(idemhttp.WithMaxAttempts(5))
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PAYMENT\tSTATUS\tREPLAYED\tBALANCE AFTER")
	for i := range payments {
		op := fmt.Sprintf("payment-%02d", i+1)
		r, err := payOnce(idemhttp.WithOperation(ctx, op), client, srv.URL)
		if err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
		fmt.Fprintf(tw, "%s\t%d\t%v\t%d\n", op, r.status, r.replayed, r.Balance)
	}
	if err := tw.Flush(); err != nil {
		return err
	}

	var balance, rows int64
	if err := db.QueryRowContext(ctx, "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil {
		return err
	}
	if err := db.QueryRowContext(ctx, "SELECT count(*) FROM payments").Scan(&rows); err != nil {
		return err
	}
	fmt.Fprintf(out, "\npayments: %d  responses lost after the debit: %d  payment rows: %d  balance: %d (expected %d)\n",
		payments, lost.Load(), rows, balance, startBalance-int64(payments)*amount)
	if rows != int64(payments) || balance != startBalance-int64(payments)*amount {
		return errors.New("the account was not debited exactly once per payment")
	}
	return nil
}

// open connects to dsn, working in schema, which it creates anew with the
// example's tables.
func open(ctx context.Context, dsn, schema string) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("invalid DSN: %w", err)
	}
	cfg.ConnectTimeout = 5 * time.Second
	cfg.RuntimeParams["search_path"] = schema
	db := stdlib.OpenDB(*cfg)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("PostgreSQL at %s:%d does not answer (%v)\n%w", cfg.Host, cfg.Port, err, errNoDatabase)
	}
	quoted := pgx.Identifier{schema}.Sanitize()
	for _, q := range []string{
		"DROP SCHEMA IF EXISTS " + quoted + " CASCADE",
		"CREATE SCHEMA " + quoted,
		"CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL CHECK (balance >= 0))",
		"CREATE TABLE payments (id bigserial PRIMARY KEY, account bigint NOT NULL REFERENCES accounts, amount bigint NOT NULL)",
		fmt.Sprintf("INSERT INTO accounts VALUES (1, %d)", startBalance),
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			db.Close()
			return nil, err
		}
	}
	return db, nil
}

type payment struct {
	Account int64 `json:"account"`
	Amount  int64 `json:"amount"`
}

type receipt struct {
	Payment  int64 `json:"payment"`
	Balance  int64 `json:"balance"`
	status   int
	replayed bool
}

// pay debits the account and records the payment in the transaction of the
// request's idempotency claim: both commit with the stored response, or
// neither does.
func pay(w http.ResponseWriter, r *http.Request) {
	var p payment
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil || p.Amount <= 0 {
		http.Error(w, "a payment is {\"account\": id, \"amount\": positive}", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	tx := pgstore.Tx(ctx)
	var rec receipt
	err := tx.QueryRowContext(ctx, "UPDATE accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1 RETURNING balance",
		p.Amount, p.Account).Scan(&rec.Balance)
	if errors.Is(err, sql.ErrNoRows) {
		http.Error(w, "no such account, or not enough funds", http.StatusUnprocessableEntity)
		return
	}
	if err == nil {
		err = tx.QueryRowContext(ctx, "INSERT INTO payments (account, amount) VALUES ($1, $2) RETURNING id",
			p.Account, p.Amount).Scan(&rec.Payment)
	}
	if err != nil {
		pgstore.Rerun(ctx, err) // a serialization failure or deadlock runs the request again
		http.Error(w, "payment failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(rec)
}

// payOnce makes one payment; the client retries it with the same key.
func payOnce(ctx context.Context, client *http.Client, url string) (receipt, error) {
	body := fmt.Sprintf(`{"account":1,"amount":%d}`, amount)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/payments", strings.NewReader(body))
	if err != nil {
		return receipt{}, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return receipt{}, err
	}
	defer resp.Body.Close()
	var rec receipt
	if resp.StatusCode != http.StatusCreated {
		b, _ := io.ReadAll(resp.Body)
		return rec, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(&rec); err != nil {
		return rec, err
	}
	rec.status = resp.StatusCode
	rec.replayed = resp.Header.Get(idemserver.ReplayedHeader) == "true"
	return rec, nil
}

// loseEveryThird serves every request, but drops the connection instead of
// answering every third one: the payment was made and its response lost.
func loseEveryThird(next http.Handler, lost *atomic.Int64) http.Handler {
	var n atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1)%3 != 0 {
			next.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		if rec.Code == http.StatusCreated && rec.Header().Get(idemserver.ReplayedHeader) == "" {
			lost.Add(1)
		}
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	})
}
