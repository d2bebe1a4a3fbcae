#!/usr/bin/env bash
# with-redis.sh runs a command beside a throwaway Redis server.
#
#   scripts/with-redis.sh go test -race -count=1 ./...
#
# It starts redis-server on a free loopback port with its files in a new
# temporary directory, exports IDEMHTTP_TEST_REDIS_ADDR (host:port) and
# IDEMHTTP_TEST_REDIS_SERVER (the redis-server binary, for tests that start
# servers of their own), runs the command, and on exit stops the server and
# removes the directory. It exits with the command's status, or non-zero
# without running the command if the server cannot be started or reached:
# a run that needed Redis never passes by skipping it.
#
# The server keeps nothing on disk (--save "" --appendonly no) unless
# IDEMHTTP_REDIS_AOF=1, which turns on the append-only file with
# appendfsync always. IDEMHTTP_REDIS_OPTS adds server options
# ("--name value ..."). redis-server is looked for on PATH (or $REDIS_SERVER)
# and installed with apt-get when missing and running as root.
set -euo pipefail

if [ $# -eq 0 ]; then
  echo "usage: $0 command [args...]" >&2
  exit 2
fi

server=${REDIS_SERVER:-$(command -v redis-server || true)}
if [ -z "$server" ] || [ ! -x "$server" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "with-redis: redis-server not found; install it (apt-get install redis-server) or set REDIS_SERVER" >&2
    exit 1
  fi
  echo "with-redis: installing redis-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq redis-server >&2
  server=$(command -v redis-server || true)
  if [ -z "$server" ]; then
    echo "with-redis: installed redis-server, but it is not on PATH; set REDIS_SERVER" >&2
    exit 1
  fi
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/idemhttp-redis.XXXXXX")
pid=
cleanup() {
  status=$?
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$dir"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

persistence=(--save "" --appendonly no)
if [ "${IDEMHTTP_REDIS_AOF:-}" = 1 ]; then
  persistence=(--save "" --appendonly yes --appendfsync always)
fi

# port_free reports whether nothing accepts connections on 127.0.0.1:$1.
port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# answers reports whether the server on 127.0.0.1:$1 answers PING, over
# bash's own /dev/tcp so that redis-cli is not needed.
answers() {
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'PING\r\n' >&3
  IFS= read -r -t 2 reply <&3 || reply=
  exec 3<&- 3>&-
  [ "${reply%$'\r'}" = "+PONG" ]
}

# A port that is free now may be taken before the server binds it, so a
# failed start is tried again on another port.
port=
for _ in 1 2 3 4 5 6 7 8; do
  candidate=$((20000 + RANDOM % 40000))
  port_free "$candidate" || continue
  # shellcheck disable=SC2086 # IDEMHTTP_REDIS_OPTS is a list of options
  "$server" --port "$candidate" --bind 127.0.0.1 --dir "$dir" \
    --logfile "$dir/server.log" --daemonize no "${persistence[@]}" \
    ${IDEMHTTP_REDIS_OPTS:-} &
  pid=$!
  for _ in $(seq 100); do
    if answers "$candidate" 2>/dev/null; then
      port=$candidate
      break 2
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=
done
if [ -z "$port" ]; then
  cat "$dir/server.log" >&2 || true
  echo "with-redis: could not start redis-server" >&2
  exit 1
fi

export IDEMHTTP_TEST_REDIS_ADDR="127.0.0.1:$port"
export IDEMHTTP_TEST_REDIS_SERVER="$server"
echo "with-redis: Redis $("$server" --version | sed -n 's/.* v=\([^ ]*\).*/\1/p') on $IDEMHTTP_TEST_REDIS_ADDR" >&2

# Not exec: the trap must stop the server when the command ends.
set +e
"$@"
status=$?
set -e
exit "$status"
