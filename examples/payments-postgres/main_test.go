package main

import (
	"bytes"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestPaymentsDebitOnce(t *testing.T) {
	dsn := os.Getenv("IDEMHTTP_TEST_POSTGRES_DSN")
	if dsn == "" {
		t.Skip("IDEMHTTP_TEST_POSTGRES_DSN is not set; scripts/with-postgres.sh runs the tests with a throwaway PostgreSQL")
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "example_" + hex.EncodeToString(b)
	t.Cleanup(func() {
		db, err := sql.Open("pgx", dsn)
		require.NoError(t, err)
		defer db.Close()
		_, err = db.Exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE")
		assert.NoError(t, err)
	})

	var out bytes.Buffer
	require.NoError(t, run(t.Context(), &out, dsn, schema, 9), out.String())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 12, out.String())
	replayed := 0
	for _, line := range lines[1:10] {
		fields := strings.Fields(line)
		require.Len(t, fields, 4, line)
		assert.Equal(t, "201", fields[1])
		if fields[2] == "true" {
			replayed++
		}
	}
	m := regexp.MustCompile(`payments: 9  responses lost after the debit: (\d+)  payment rows: 9  balance: 8875 \(expected 8875\)`).
		FindStringSubmatch(out.String())
	require.NotNil(t, m, out.String())
	assert.Equal(t, m[1], strconv.Itoa(replayed), "every lost response was replayed on the retry")
	assert.Positive(t, replayed)
}

func TestSaysHowToGetADatabase(t *testing.T) {
	for _, dsn := range []string{"", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"} {
		err := run(t.Context(), &bytes.Buffer{}, dsn, "payments_example", 1)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "scripts/with-postgres.sh")
		assert.Contains(t, err.Error(), dsnVariable)
	}
}
