# Sourced by scripts/demo.sh and bench/run.sh: a private redis-server and a private PostgreSQL 15
# cluster with outbox_pg preloaded, on free loopback ports, in directory $SERVERS_DIR, stopped when
# the sourcing script exits (unless KEEP=1). PostgreSQL runs as the `postgres` OS user when root.
#   start_private_servers [extra postgresql.conf lines...]
# sets PG_PORT, REDIS_PORT, PG_BIN and PG_LOG, and creates the extension in database postgres.

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PG_BIN=$($PG_CONFIG --bindir)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

stop_private_servers() {
  if [ "${KEEP:-0}" != 1 ]; then
    as_pg "$PG_BIN/pg_ctl" -D "$SERVERS_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  fi
}

start_private_servers() {
  PG_PORT=$(free_port)
  REDIS_PORT=$(free_port)
  PG_LOG="$SERVERS_DIR/postgres.log"
  rm -rf "$SERVERS_DIR"
  mkdir -p "$SERVERS_DIR"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$SERVERS_DIR"
  trap stop_private_servers EXIT

  echo "== starting redis-server on 127.0.0.1:$REDIS_PORT and PostgreSQL on 127.0.0.1:$PG_PORT (outbox_pg preloaded)"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --dir "$SERVERS_DIR" --logfile "$SERVERS_DIR/redis.log"
  as_pg "$PG_BIN/initdb" -A trust -U postgres -E UTF8 --locale=C -D "$SERVERS_DIR/data" >/dev/null
  {
    echo "port = $PG_PORT"
    echo "listen_addresses = '127.0.0.1'"
    echo "unix_socket_directories = '$SERVERS_DIR'"
    echo "shared_preload_libraries = 'outbox_pg'"
    echo "outbox.redis_url = 'redis://127.0.0.1:$REDIS_PORT'"
    for line in "$@"; do echo "$line"; done
  } >> "$SERVERS_DIR/data/postgresql.conf"
  as_pg "$PG_BIN/pg_ctl" -D "$SERVERS_DIR/data" -l "$PG_LOG" -w start >/dev/null
  psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c "CREATE EXTENSION outbox_pg"
}
