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
bin=$(mktemp -d)/idemload
go build -o "$bin" ./cmd/idemload
pin() { if command -v taskset >/dev/null; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
GOMAXPROCS=1 pin 0 "$bin" serve -addr 127.0.0.1:18181 -mode bare -work "$WORK" & pids+=($!)
GOMAXPROCS=1 pin 0 "$bin" serve -addr 127.0.0.1:18182 -mode idem -work "$WORK" & pids+=($!)
for port in 18181 18182; do
  until (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; do sleep 0.1; done
done

for round in $(seq "$ROUNDS"); do
  for run in "bare 18181 none" "idem-new 18182 new" "idem-replay 18182 replay" "idem-unkeyed 18182 none"; do
    set -- $run
    GOMAXPROCS=1 pin 1 "$bin" hit -url "http://127.0.0.1:$2/charges" -keys "$3" -c "$C" -d "$DUR" -label "$1"
  done
done
