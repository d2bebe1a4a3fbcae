#!/usr/bin/env bash
# with-postgres.sh runs a command beside a throwaway PostgreSQL server.
#
#   scripts/with-postgres.sh go test -race -count=1 ./...
#
# It creates a cluster in a new temporary directory, starts it on a free
# loopback port with its socket in that directory, exports
# IDEMHTTP_TEST_POSTGRES_DSN naming it, runs the command, and on exit stops
# the server and removes the directory. It exits with the command's status,
# or non-zero without running the command if the server cannot be started or
# reached: a run that needed PostgreSQL never passes by skipping it.
#
# PostgreSQL 15 is looked for in /usr/lib/postgresql/15/bin (or $PGBIN) and
# installed with apt-get when missing and running as root. The server runs as
# the postgres user when started by root, since PostgreSQL refuses to run as
# root. IDEMHTTP_PG_OPTS adds server settings ("-c name=value ...").
set -euo pipefail

PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}

if [ $# -eq 0 ]; then
  echo "usage: $0 command [args...]" >&2
  exit 2
fi

if [ ! -x "$PGBIN/initdb" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "with-postgres: $PGBIN/initdb not found; install PostgreSQL 15 (apt-get install postgresql) or set PGBIN" >&2
    exit 1
  fi
  echo "with-postgres: installing PostgreSQL" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
  if [ ! -x "$PGBIN/initdb" ]; then
    echo "with-postgres: installed PostgreSQL, but $PGBIN/initdb is still missing; set PGBIN" >&2
    exit 1
  fi
fi

# as_pg runs a command as the user that owns the cluster.
as_pg() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

dir=$(mktemp -d "${TMPDIR:-/tmp}/idemhttp-pg.XXXXXX")
data="$dir/data"
started=
cleanup() {
  status=$?
  if [ -n "$started" ]; then
    as_pg "$PGBIN/pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$(id -u)" -eq 0 ]; then
  chown postgres: "$dir"
fi
chmod 700 "$dir"
as_pg "$PGBIN/initdb" -D "$data" -A trust -U postgres --no-sync >"$dir/initdb.log" 2>&1 || {
  cat "$dir/initdb.log" >&2
  echo "with-postgres: initdb failed" >&2
  exit 1
}

# port_free reports whether nothing accepts connections on 127.0.0.1:$1.
port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# A port that is free now may be taken before the server binds it, so a
# failed start is tried again on another port.
port=
for _ in 1 2 3 4 5 6 7 8; do
  candidate=$((20000 + RANDOM % 40000))
  port_free "$candidate" || continue
  # shellcheck disable=SC2086 # IDEMHTTP_PG_OPTS is a list of options
  if as_pg "$PGBIN/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 30 start \
    -o "-p $candidate -k $dir -c listen_addresses=127.0.0.1 -c max_connections=300 ${IDEMHTTP_PG_OPTS:-}" >/dev/null; then
    port=$candidate
    started=1
    break
  fi
done
if [ -z "$port" ]; then
  cat "$dir/server.log" >&2 || true
  echo "with-postgres: could not start PostgreSQL" >&2
  exit 1
fi

if ! "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$port" -U postgres -t 10; then
  cat "$dir/server.log" >&2 || true
  echo "with-postgres: PostgreSQL started but does not answer on 127.0.0.1:$port" >&2
  exit 1
fi

export IDEMHTTP_TEST_POSTGRES_DSN="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
echo "with-postgres: PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$port" >&2

# Not exec: the trap must stop the server when the command ends.
set +e
"$@"
status=$?
set -e
exit "$status"
