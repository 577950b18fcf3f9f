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
PG_CONFIG=${PG_CONFIG:-$(bash scripts/pg-config.sh "${PG_MAJOR:-15}")}
# The servers: outbox-testkit's, started the way the tests start theirs.
cargo build -q -p outbox-testkit --bin outbox-servers
TARGET=${CARGO_TARGET_DIR:-target}  # where cargo put the binaries
SERVERS=$TARGET/debug/outbox-servers

if [ "${DEMO_SKIP_INSTALL:-0}" = 1 ]; then
  cargo build -q -p outbox-demo
  DEMO_BIN=$TARGET/debug/payments-demo
else
  echo "== building and installing outbox_pg (release) and the demo"
  # With outbox.fault_injection (src/faults.rs): the demo makes the relay die after publishing.
  cargo pgrx install --release --features fault-injection --pg-config "$PG_CONFIG" >/dev/null
  cargo build -q --release -p outbox-demo
  DEMO_BIN=$TARGET/release/payments-demo
fi

[ "${KEEP:-0}" = 1 ] || trap '"$SERVERS" down --dir "$SERVERS_DIR"' EXIT
# An assignment, not `eval "$(...)"`: set -e sees a failed `up` only this way.
servers=$("$SERVERS" up --dir "$SERVERS_DIR" --pg-config "$PG_CONFIG")
eval "$servers"
echo "== redis-server on 127.0.0.1:$REDIS_PORT, PostgreSQL on 127.0.0.1:$PG_PORT (outbox_pg preloaded), in $SERVERS_DIR"

"$DEMO_BIN" --pg "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" \
  --redis "redis://127.0.0.1:$REDIS_PORT" --pg-log "$PG_LOG" --payments "${DEMO_PAYMENTS:-2000}"
echo "   logs: $PG_LOG, $REDIS_LOG"
