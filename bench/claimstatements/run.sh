#!/usr/bin/env bash
# run.sh measures, on PostgreSQL and on Redis alone (no Go client), what
# one replay's claim costs the server, beside a plain read of the record:
#
#   bench/claimstatements/run.sh
#
# PostgreSQL (pgbench -M prepared, 16 clients, 6 s each, twice), on tables
# shaped like pgstore's and the benchmark floor's, ten completed rows:
# select.sql, transactional mode's replay; floor.sql, the floor's
# claim-or-read; lease.sql, lease mode's claim; function.sql, the same
# claim as a PL/pgSQL function that inserts only when its SELECT finds
# nothing (setup.sql creates it; pgstore does not use it).
#
# Redis (redis-benchmark, 16 clients, 200,000 calls each): SET NX GET PX
# answering an existing record, against GET of it, with the server's own
# time per call from INFO commandstats.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

"$root/scripts/with-postgres.sh" bash -c '
set -euo pipefail
export PATH="'"$PG_BIN"':$PATH"
psql "$IDEMHTTP_TEST_POSTGRES_DSN" -q -v ON_ERROR_STOP=1 -f "'"$here"'/setup.sql" >/dev/null
for s in select floor lease function; do
  for round in 1 2; do
    tps=$(pgbench -n -M prepared -c 16 -j 2 -T 6 -f "'"$here"'/$s.sql" "$IDEMHTTP_TEST_POSTGRES_DSN" 2>/dev/null | sed -n "s/^tps = \([0-9.]*\).*/\1/p")
    echo "postgres $s round $round: $tps tps"
  done
done'

"$root/scripts/with-redis.sh" bash -c '
set -euo pipefail
port=${IDEMHTTP_TEST_REDIS_ADDR##*:}
cli() { redis-cli -p "$port" "$@"; }
record=$(head -c 135 /dev/zero | tr "\0" r)
value=$(head -c 74 /dev/zero | tr "\0" v)
cli set rec "$record" >/dev/null
for cmd in "SET rec $value NX GET PX 60000" "GET rec"; do
  cli config resetstat >/dev/null
  rps=$(redis-benchmark -p "$port" -c 16 -n 200000 -q $cmd | tr "\r" "\n" | sed -n "s/.*: \([0-9.]*\) requests per second.*/\1/p" | tail -1)
  name=$(echo "$cmd" | cut -d" " -f1 | tr A-Z a-z)
  usec=$(cli info commandstats | tr -d "\r" | sed -n "s/^cmdstat_$name:.*usec_per_call=\([0-9.]*\).*/\1/p")
  echo "redis $cmd: $rps calls/s, ${usec} µs per call in the server"
done'
