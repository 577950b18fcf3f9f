# Sourced by the bench scripts that start servers of their own (profile-drain.sh, notify-cost.sh):
# a private PostgreSQL and Redis through testkit's outbox-servers, the psql to reach them, and a
# wait with a deadline. The caller sets PG_CONFIG and calls stop_servers at exit (its EXIT trap).

# start_servers DIR [outbox-servers up arguments...]: stops what an earlier run left in DIR, starts
# the servers there, and sets PG_PORT, PG_BIN, PG_LOG and REDIS_PORT.
start_servers() {
  cargo build -q -p outbox-testkit --bin outbox-servers
  SERVERS=${CARGO_TARGET_DIR:-target}/debug/outbox-servers
  SERVERS_DIR=$1
  shift
  "$SERVERS" down --dir "$SERVERS_DIR" >/dev/null 2>&1 || true
  rm -rf "$SERVERS_DIR"
  local servers
  # An assignment, not `eval "$(...)"`: set -e sees a failed `up` only this way.
  servers=$("$SERVERS" up --dir "$SERVERS_DIR" --pg-config "$PG_CONFIG" "$@")
  eval "$servers"
}

stop_servers() {
  [ -n "${SERVERS_DIR:-}" ] || return 0  # the script stopped before start_servers
  "$SERVERS" down --dir "$SERVERS_DIR" >/dev/null
}

# psql as postgres on the private server: unaligned, quiet, stopping at the first error.
psql() { "$PG_BIN/psql" -X -q -At -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 "$@"; }

# wait_for SECONDS WHAT COMMAND: polls COMMAND (evaluated) until it succeeds; after SECONDS the
# script stops, saying it was waiting for WHAT.
wait_for() {
  local deadline=$((SECONDS + $1))
  until eval "$3"; do
    [ $SECONDS -lt $deadline ] || { echo "$(basename "$0"): timed out waiting for $2" >&2; exit 1; }
    sleep 0.01
  done
}
