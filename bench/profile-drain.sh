#!/usr/bin/env bash
# A controlled drain with a profile of the relay, for the build installed in PostgreSQL now:
#   bash bench/profile-drain.sh NAME [AGGREGATES]     # AGGREGATES: 10000 (default) or 1
# Starts a private PostgreSQL (the relay off) and Redis, enqueues 100,000 events over AGGREGATES
# aggregates, then switches the relay on under `perf record -F 2000 -g` until the stream holds them
# all; three times. Prints events/s per run; the profiles are /tmp/opg-profile-NAME-RUN.data
# (`perf report -i ...`: the sample count at 2,000 Hz is the relay's CPU). Used for the A/B in
# bench/results/ab-restructure.md, where bench/run.sh's figures spread with the machine's load.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: bash bench/profile-drain.sh NAME [AGGREGATES]}
aggregates=${2:-10000}
export PATH="$HOME/.cargo/bin:$PATH"
PG_CONFIG=${PG_CONFIG:-$(bash scripts/pg-config.sh "${PG_MAJOR:-15}")}
command -v perf >/dev/null || apt-get install -y -q linux-perf >/dev/null
source bench/servers.sh
trap stop_servers EXIT
start_servers "/tmp/opg-profile-$name" --setting "shared_buffers = '512MB'" --setting "max_wal_size = '4GB'" \
  --setting "outbox.enabled = off"
psql -c "ALTER SYSTEM SET outbox.redis_url = 'redis://127.0.0.1:$REDIS_PORT'" -c "SELECT pg_reload_conf()" >/dev/null
psql -c "CREATE EXTENSION IF NOT EXISTS outbox_pg" 2>/dev/null
for run in 1 2 3; do
  for first in $(seq 0 10000 90000); do
    psql -c "SELECT count(outbox_enqueue('bench', (i % $aggregates)::text, 'bench.created',
               jsonb_build_object('n', i, 'pad', repeat('x', 48)))) FROM generate_series($first, $first + 9999) i" >/dev/null
  done
  pid=""
  wait_for 300 "the relay" 'pid=$(psql -c "SELECT outbox.relay_pid()"); [ -n "$pid" ]'
  perf record -q -F 2000 -g -p "$pid" -o "/tmp/opg-profile-$name-$run.data" 2>/dev/null &
  perf_pid=$!
  wait_for 300 "perf to record" '[ -s "/tmp/opg-profile-$name-$run.data" ]'
  started=$(date +%s.%N)
  psql -c "ALTER SYSTEM SET outbox.enabled = on" -c "SELECT pg_reload_conf()" >/dev/null
  wait_for 300 "the drain" '[ "$(redis-cli -p "$REDIS_PORT" XLEN outbox:bench)" -ge $((run * 100000)) ]'
  ended=$(date +%s.%N)
  kill -INT "$perf_pid"; wait "$perf_pid" || true
  echo "$name run $run: $(echo "100000 / ($ended - $started)" | bc -l | cut -d. -f1) events/s"
  psql -c "ALTER SYSTEM SET outbox.enabled = off" -c "SELECT pg_reload_conf()" >/dev/null
  wait_for 300 "the last finish" '[ "$(psql -c "SELECT outbox.oldest_pending_age() IS NULL")" = t ]'
done
