#!/usr/bin/env bash
# Runs every benchmark side by side in one go and writes bench/results/{report.md,results.json,latency.svg}:
#   bash bench/run.sh            # full run (about 16 minutes)
#   bash bench/run.sh --quick    # smaller numbers, for a smoke test
#   BENCH_MODE=drain bash bench/run.sh [--quick]   # the drain figures only, twice (A/B of two builds)
#   BENCH_MODE=payload bash bench/run.sh [--quick] # one worker's drain of 2 KiB and 16 KiB payloads, twice
#   BENCH_MODE=sustained bash bench/run.sh --rate 5000 --minutes 30 [--retention 5min]   # latency, rate reached
#                                    # and table size minute by minute
#   BENCH_MODE=steady bash bench/run.sh [--quick] [--minutes 10] [--retention 2min]   # the producers' ceiling,
#                                    # then a window a minute at 75% of it: p99, pending, log size, relay memory
#   BENCH_SETTING="outbox.linger = '2ms'" BENCH_MODE=... # one more postgresql.conf line for the run
#   BENCH_MODE=cdc bash bench/run.sh [--quick]     # issue 39 alone: outbox_pg, the polling relay and the CDC
#                                    # relay (drain, latency, writers' throughput, WAL, the slot's retained WAL)
#   BENCH_MODE=outside bash bench/run.sh [--quick] # issue 37 alone: outbox-relay beside the worker and the seeds'
#                                    # relay (drain 1/2 processes, latency at 1,000/s, PL/pgSQL enqueue ratio);
#                                    # OUTBOX_LOG_MIN_DURATION=50ms (any OUTBOX_* setting) reaches outbox-relay;
#                                    # BENCH_NOTE="..." goes into outside.md
#   BENCH_MODE=outside-latency bash bench/run.sh [--quick]  # only outbox-relay's latency at 1,000/s, three
#                                    # runs printed (for trying a change to its loop; no report written)
# Builds and installs the release extension, starts a private PostgreSQL (fsync on, default
# synchronous_commit, wal_level = logical for the CDC relay's slot) with outbox_pg preloaded and a private Redis on free loopback ports; their logs
# (slow autovacuums and lock waits included) stay in $BENCH_DIR (default /tmp/opg-bench) afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS

SERVERS_DIR=${BENCH_DIR:-/tmp/opg-bench}
OUT=${BENCH_OUT:-bench/results}
PG_CONFIG=${PG_CONFIG:-$(bash scripts/pg-config.sh "${PG_MAJOR:-15}")}

echo "== building (release): extension and benchmark"
cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null
cargo build --release -p outbox-bench >/dev/null 2>&1 || cargo build --release -p outbox-bench
# The relay outside the server (issue 37), for the full run and BENCH_MODE=outside: about 3 minutes
# (fat LTO), built once before any measurement.
outside=0
case "${BENCH_MODE:-all}" in all | outside | outside-latency) outside=1 ;; esac
if [ $outside = 1 ]; then
  echo "== building (release): outbox-relay"
  cargo build --release -p outbox-relay >/dev/null 2>&1 || cargo build --release -p outbox-relay
fi
# The servers: outbox-testkit's, started the way the tests start theirs.
cargo build -q -p outbox-testkit --bin outbox-servers
TARGET=${CARGO_TARGET_DIR:-target}  # where cargo put the binaries
SERVERS=$TARGET/debug/outbox-servers

# With every benchmark, a three-master Redis Cluster (no replicas) for the drain into a cluster
# beside the single node.
cluster=()
[ "${BENCH_MODE:-all}" = all ] && cluster=(--redis-cluster 3)
[ "${KEEP:-0}" = 1 ] || trap '"$SERVERS" down --dir "$SERVERS_DIR"' EXIT
# An assignment, not `eval "$(...)"`: set -e sees a failed `up` only this way.
servers=$("$SERVERS" up --dir "$SERVERS_DIR" --pg-config "$PG_CONFIG" "${cluster[@]}" \
  --setting "max_worker_processes = 16" --setting "shared_buffers = '512MB'" --setting "max_wal_size = '4GB'" \
  --setting "wal_level = logical" \
  --setting "log_autovacuum_min_duration = '1s'" --setting "log_lock_waits = on" \
  ${BENCH_SETTING:+--setting "$BENCH_SETTING"})
eval "$servers"
echo "== redis-server on 127.0.0.1:$REDIS_PORT, PostgreSQL on 127.0.0.1:$PG_PORT (outbox_pg preloaded), in $SERVERS_DIR"
# The outside relay's scenarios: the binary, and the SQL-only install they put in a second database.
outside_args=()
if [ $outside = 1 ]; then
  bash scripts/sql-only.sh >"$SERVERS_DIR/sql-only.sql"
  outside_args=(--relay "$(realpath "$TARGET/release/outbox-relay")" --sql-only "$SERVERS_DIR/sql-only.sql")
fi

# The reports name the command that made them.
export BENCH_COMMAND="${BENCH_SETTING:+BENCH_SETTING=\"$BENCH_SETTING\" }${BENCH_MODE:+BENCH_MODE=$BENCH_MODE }bash bench/run.sh${*:+ $*}"
"$TARGET"/release/outbox-bench "${BENCH_MODE:-all}" --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pgbench "$PG_BIN/pgbench" --out "$OUT" \
  $([ "${BENCH_MODE:-all}" = all ] && echo "--cluster $CLUSTER_URL") "${outside_args[@]}" "$@"
if [ "${BENCH_MODE:-all}" = all ]; then
  echo "== $OUT/report.md"
  cat "$OUT/report.md"
fi
