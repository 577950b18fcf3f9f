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

SERVERS_DIR=${DEMO_DIR:-/tmp/opg-demo}
source scripts/private-servers.sh

if [ "${DEMO_SKIP_INSTALL:-0}" = 1 ]; then
  cargo build -q -p outbox-demo
  DEMO_BIN=target/debug/payments-demo
else
  echo "== building and installing outbox_pg (release) and the demo"
  cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null
  cargo build -q --release -p outbox-demo
  DEMO_BIN=target/release/payments-demo
fi

start_private_servers

"$DEMO_BIN" --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pg-log "$PG_LOG" --payments "${DEMO_PAYMENTS:-2000}"
echo "   logs: $PG_LOG, $SERVERS_DIR/redis.log"
