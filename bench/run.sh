#!/usr/bin/env bash
# Runs every benchmark side by side in one go and writes bench/results/{report.md,results.json,latency.svg}:
#   bash bench/run.sh            # full run (about 10 minutes)
#   bash bench/run.sh --quick    # smaller numbers, for a smoke test
#   BENCH_MODE=drain bash bench/run.sh [--quick]   # the drain figures only, twice (A/B of two builds)
#   BENCH_MODE=sustained bash bench/run.sh --rate 5000 --minutes 30 [--retention 5min]   # latency, rate reached
#                                    # and table size minute by minute
# Builds and installs the release extension, starts a private PostgreSQL (fsync on, default
# synchronous_commit) with outbox_pg preloaded and a private Redis on free loopback ports; their logs
# (slow autovacuums and lock waits included) stay in $BENCH_DIR (default /tmp/opg-bench) afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS

SERVERS_DIR=${BENCH_DIR:-/tmp/opg-bench}
OUT=${BENCH_OUT:-bench/results}
source scripts/private-servers.sh

echo "== building (release): extension and benchmark"
cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null
cargo build --release -p outbox-bench >/dev/null 2>&1 || cargo build --release -p outbox-bench

start_private_servers "max_worker_processes = 16" "shared_buffers = '512MB'" "max_wal_size = '4GB'" \
  "log_autovacuum_min_duration = '1s'" "log_lock_waits = on"

# A three-master Redis Cluster (no replicas) for the drain into a cluster beside the single node;
# stopped at exit with the other servers.
CLUSTER_PORTS=()
stop_cluster() {
  if [ "${KEEP:-0}" != 1 ]; then
    for port in "${CLUSTER_PORTS[@]}"; do redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; done
  fi
}
trap 'stop_cluster; stop_private_servers' EXIT
for n in 1 2 3; do
  port=$(free_port) bus=$(free_port)
  CLUSTER_PORTS+=("$port")
  mkdir -p "$SERVERS_DIR/cluster-$n"
  redis-server --port "$port" --cluster-port "$bus" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --dir "$SERVERS_DIR/cluster-$n" --logfile "$SERVERS_DIR/cluster-$n/redis.log" \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000
done
for port in "${CLUSTER_PORTS[@]}"; do
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
done
redis-cli --cluster create "${CLUSTER_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >/dev/null
for port in "${CLUSTER_PORTS[@]}"; do
  for _ in $(seq 200); do redis-cli -p "$port" cluster info | grep -q 'cluster_state:ok' && break; sleep 0.05; done
done
CLUSTER_URL="redis://$(printf '127.0.0.1:%s,' "${CLUSTER_PORTS[@]}" | sed 's/,$//')"

# The reports name the command that made them.
export BENCH_COMMAND="${BENCH_MODE:+BENCH_MODE=$BENCH_MODE }bash bench/run.sh${*:+ $*}"
./target/release/outbox-bench "${BENCH_MODE:-all}" --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pgbench "$PG_BIN/pgbench" --out "$OUT" \
  $([ "${BENCH_MODE:-all}" = all ] && echo "--cluster $CLUSTER_URL") "$@"
if [ "${BENCH_MODE:-all}" = all ]; then
  echo "== $OUT/report.md"
  cat "$OUT/report.md"
fi
