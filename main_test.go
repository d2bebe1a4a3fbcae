package idemhttp

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(benchServerEnv) != "" {
		serveForBenchmark() // this process is a benchmark's server, not a test run
		return
	}
	goleak.VerifyTestMain(m)
}
