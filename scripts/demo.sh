#!/usr/bin/env bash
# The main job: the payments demo. Builds and installs outbox_pg, starts a private PostgreSQL
# cluster with the extension preloaded and a private redis-server (free loopback ports), then runs
# demo/ (payments-demo): a burst of PIX payments with their events, some rolled back; a
# deduplicating notification service; the relay crashing between publish and mark; the relay
# paused while payments continue (age alert); and a report. Exits non-zero if an event was lost or
# a rolled-back payment produced one.
#   DEMO_PAYMENTS=N     how many payments (default 2000)
#   KEEP=1              leave PostgreSQL and Redis running afterwards
#   DEMO_SKIP_INSTALL=1 use the outbox_pg already installed (the test suite's), debug build of the demo
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS

PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
PG_BIN=$($PG_CONFIG --bindir)
DEMO_DIR=${DEMO_DIR:-/tmp/opg-demo}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

if [ "${DEMO_SKIP_INSTALL:-0}" = 1 ]; then
  cargo build -q -p outbox-demo
  DEMO_BIN=target/debug/payments-demo
else
  echo "== building and installing outbox_pg (release) and the demo"
  cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null
  cargo build -q --release -p outbox-demo
  DEMO_BIN=target/release/payments-demo
fi

PG_PORT=$(free_port)
REDIS_PORT=$(free_port)
rm -rf "$DEMO_DIR"
mkdir -p "$DEMO_DIR"
[ "$(id -u)" = 0 ] && chown postgres:postgres "$DEMO_DIR"

cleanup() {
  if [ "${KEEP:-0}" != 1 ]; then
    as_pg "$PG_BIN/pg_ctl" -D "$DEMO_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

echo "== starting redis-server on 127.0.0.1:$REDIS_PORT and PostgreSQL on 127.0.0.1:$PG_PORT (outbox_pg preloaded)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --dir "$DEMO_DIR" --logfile "$DEMO_DIR/redis.log"
as_pg "$PG_BIN/initdb" -A trust -U postgres -E UTF8 --locale=C -D "$DEMO_DIR/data" >/dev/null
cat >> "$DEMO_DIR/data/postgresql.conf" <<CONF
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DEMO_DIR'
shared_preload_libraries = 'outbox_pg'
outbox.database = 'postgres'
outbox.redis_url = 'redis://127.0.0.1:$REDIS_PORT'
CONF
as_pg "$PG_BIN/pg_ctl" -D "$DEMO_DIR/data" -l "$DEMO_DIR/postgres.log" -w start >/dev/null
psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c "CREATE EXTENSION outbox_pg"

"$DEMO_BIN" --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pg-log "$DEMO_DIR/postgres.log" --payments "${DEMO_PAYMENTS:-2000}"
echo "   logs: $DEMO_DIR/postgres.log, $DEMO_DIR/redis.log"
