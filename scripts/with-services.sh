#!/usr/bin/env bash
# Runs a command beside a throwaway PostgreSQL and a throwaway Redis, with
# IDEMHTTP_TEST_POSTGRES_DSN and IDEMHTTP_TEST_REDIS_ADDR set, and removes
# both servers when it ends. It fails, without running the command, when
# either server cannot be started or reached. With no command it runs the
# whole test suite:
#
#	scripts/with-services.sh                      # go test -race -count=1 ./...
#	scripts/with-services.sh go test ./idemserver/...
set -euo pipefail
here=$(dirname "$0")
if [ $# -eq 0 ]; then
  set -- go test -race -count=1 ./...
fi
# The check inside makes sure neither service's tests can skip.
exec "$here/with-postgres.sh" "$here/with-redis.sh" bash -c '
  test -n "${IDEMHTTP_TEST_POSTGRES_DSN:-}" || { echo "with-services: IDEMHTTP_TEST_POSTGRES_DSN not set" >&2; exit 1; }
  test -n "${IDEMHTTP_TEST_REDIS_ADDR:-}" || { echo "with-services: IDEMHTTP_TEST_REDIS_ADDR not set" >&2; exit 1; }
  exec "$@"' with-services "$@"
