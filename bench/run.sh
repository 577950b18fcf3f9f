#!/usr/bin/env bash
# Runs every benchmark side by side in one go and writes bench/results/{report.md,results.json,latency.svg}:
#   bash bench/run.sh            # full run (about 5 minutes)
#   bash bench/run.sh --quick    # smaller numbers, for a smoke test
# Builds and installs the release extension, starts a private PostgreSQL (fsync on, default
# synchronous_commit) with outbox_pg preloaded and a private Redis on free loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS

PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
PG_BIN=$($PG_CONFIG --bindir)
WORK=${BENCH_DIR:-/tmp/opg-bench}
OUT=${BENCH_OUT:-bench/results}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

echo "== building (release): extension and benchmark"
cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null
cargo build --release -p outbox-bench >/dev/null 2>&1 || cargo build --release -p outbox-bench

PG_PORT=$(free_port)
REDIS_PORT=$(free_port)
rm -rf "$WORK"; mkdir -p "$WORK"
[ "$(id -u)" = 0 ] && chown postgres:postgres "$WORK"
cleanup() {
  as_pg "$PG_BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
}
trap cleanup EXIT

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --dir "$WORK" --logfile "$WORK/redis.log"
as_pg "$PG_BIN/initdb" -A trust -U postgres -E UTF8 --locale=C -D "$WORK/data" >/dev/null
cat >> "$WORK/data/postgresql.conf" <<CONF
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$WORK'
shared_preload_libraries = 'outbox_pg'
outbox.database = 'postgres'
outbox.redis_url = 'redis://127.0.0.1:$REDIS_PORT'
max_worker_processes = 16
shared_buffers = '512MB'
max_wal_size = '4GB'
CONF
as_pg "$PG_BIN/pg_ctl" -D "$WORK/data" -l "$WORK/postgres.log" -w start >/dev/null
psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c "CREATE EXTENSION outbox_pg"

./target/release/outbox-bench all --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pgbench "$PG_BIN/pgbench" --out "$OUT" "$@"
echo "== $OUT/report.md"
cat "$OUT/report.md"
