#!/usr/bin/env bash
# Throughput of the idemserver middleware over loopback, measured from a
# second process: a bare server and one behind the middleware, each pinned
# to one core, hit in turn by idemload on the other core.
#
#   bench/server-throughput.sh            # trivial handler
#   WORK=1ms bench/server-throughput.sh   # handler that waits 1ms, as on a database
#
# ROUNDS (default 3), DUR (default 10s) and C (default 16) tune the run.
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-3} DUR=${DUR:-10s} C=${C:-16} WORK=${WORK:-0s}
dir=$(mktemp -d)
bin=$dir/idemload
go build -o "$bin" ./cmd/idemload
# taskset pins a process to one core; without it the processes float.
pin=()
command -v taskset >/dev/null && pin=(taskset -c)
on() { if [ ${#pin[@]} -gt 0 ]; then echo "${pin[@]} $1"; fi; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"' EXIT
for port in 18181 18182; do
  if (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then
    echo "port $port is taken; stop what listens there first" >&2; exit 1
  fi
done
GOMAXPROCS=1 $(on 0) "$bin" serve -addr 127.0.0.1:18181 -mode bare -work "$WORK" & pids+=($!)
GOMAXPROCS=1 $(on 0) "$bin" serve -addr 127.0.0.1:18182 -mode idem -work "$WORK" & pids+=($!)
for port in 18181 18182; do
  until (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; do sleep 0.1; done
done

for round in $(seq "$ROUNDS"); do
  for run in "bare 18181 none" "idem-unkeyed 18182 none" "idem-replay 18182 replay" "idem-new 18182 new"; do
    set -- $run
    GOMAXPROCS=1 $(on 1) "$bin" hit -url "http://127.0.0.1:$2/charges" -keys "$3" -c "$C" -d "$DUR" -label "$1"
  done
done
