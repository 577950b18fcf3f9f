#!/usr/bin/env bash
# The main job: builds and installs outbox_pg, starts a private PostgreSQL cluster with the
# extension preloaded and a private redis-server (both on free loopback ports), commits a few
# payments with their events and rolls a few back, then shows what reached the Redis stream.
# Exits non-zero if a committed event is missing or a rolled-back one appeared.
# Set KEEP=1 to leave both servers running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS

PG_BIN=$(/usr/lib/postgresql/15/bin/pg_config --bindir)
DEMO_DIR=${DEMO_DIR:-/tmp/opg-demo}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

echo "== building and installing outbox_pg (release)"
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/dev/null

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

echo "== starting redis-server on 127.0.0.1:$REDIS_PORT"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --dir "$DEMO_DIR" --logfile "$DEMO_DIR/redis.log"

echo "== starting PostgreSQL on 127.0.0.1:$PG_PORT with outbox_pg preloaded"
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

psql_demo() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres "$@"; }

psql_demo <<'SQL'
CREATE EXTENSION outbox_pg;
CREATE TABLE payments (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payer       text NOT NULL,
    amount      numeric(12, 2) NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
SQL

echo "== committing 5 payments and rolling back 2, each INSERT + outbox_enqueue in one transaction"
for i in 1 2 3 4 5 6 7; do
  if [ "$i" = 3 ] || [ "$i" = 6 ]; then ending=ROLLBACK; else ending=COMMIT; fi
  psql_demo <<SQL
BEGIN;
WITH p AS (INSERT INTO payments (payer, amount) VALUES ('payer-$i', $((i * 1050)) / 100.0) RETURNING id, payer, amount)
SELECT outbox_enqueue('payment', p.id, 'payment.created',
                      jsonb_build_object('payment_id', p.id, 'payer', p.payer, 'amount', p.amount::text),
                      jsonb_build_object('demo_txn', $i))
  FROM p;
$ending;
SQL
  echo "   payment transaction $i: $ending"
done

committed=$(psql_demo -At -c "SELECT count(*) FROM payments")
deadline=$((SECONDS + 30))
until [ "$(redis-cli -p "$REDIS_PORT" XLEN outbox:payment)" -ge "$committed" ] || [ $SECONDS -ge $deadline ]; do
  sleep 0.05
done

echo "== stream outbox:payment in Redis"
redis-cli -p "$REDIS_PORT" --no-raw XRANGE outbox:payment - + | sed 's/^/   /'
echo "== outbox.messages"
psql_demo -c "SELECT id, aggregate_id, event_type, status, attempts, published_at - created_at AS commit_to_published FROM outbox.messages ORDER BY id"

delivered=$(redis-cli -p "$REDIS_PORT" XLEN outbox:payment)
from_rollbacks=$(redis-cli -p "$REDIS_PORT" XRANGE outbox:payment - + | grep -c '"demo_txn":[36]\b' || true)
echo "== report: payments committed: $committed, rolled back: 2, events delivered: $delivered, events from rolled-back payments: $from_rollbacks"
if [ "$delivered" != "$committed" ] || [ "$from_rollbacks" != 0 ]; then
  echo "FAILED: every committed payment must produce exactly one event and rolled-back ones none" >&2
  exit 1
fi
echo "OK: every committed payment reached Redis once; rolled-back payments produced nothing."
echo "   Logs: $DEMO_DIR/postgres.log (KEEP=1 leaves PostgreSQL on port $PG_PORT and Redis on $REDIS_PORT running)"
