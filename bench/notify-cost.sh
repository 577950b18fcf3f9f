#!/usr/bin/env bash
# What the SQL-only install's commit wake-up (a NOTIFY from outbox_enqueue, docs/sql-only.md) costs
# the writers: pgbench against a private server without the library, with the NOTIFY and without.
#   bash bench/notify-cost.sh [SECONDS]          # SECONDS per run: 30 (default)
# Starts a private PostgreSQL (bench settings: fsync on, synchronous_commit on) that does not load
# the library, and installs `bash scripts/sql-only.sh` twice: in database `notify` as it is, in
# database `silent` without outbox_enqueue's wake-up (nothing else differs). Then, for a
# transaction of one outbox_enqueue and one of ten, with no relay asleep (writers share the wake
# key and do not notify) and with one, an idle session that holds the key, LISTENs and never reads
# (every writer notifies): pgbench -c 8 -j 2 -T SECONDS, alternating notify / silent /
# notify / silent, the log emptied and checkpointed before each run. Prints one line per run: tps,
# latency, the WAL flushes and their average time (pg_stat_wal), and with a listener the notify
# queue's use, the listener's wait event and the bytes unread in its socket. Last, what 200 MB of
# notifications do with such a listener. bench/results/notify-cost.md has two runs' figures and
# what they say.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
export PATH="$HOME/.cargo/bin:$PATH"
PG_CONFIG=${PG_CONFIG:-$(bash scripts/pg-config.sh "${PG_MAJOR:-15}")}
source bench/servers.sh
DIR=/tmp/opg-notify-cost
listener_pid=""
cleanup() {
  if [ -n "$listener_pid" ]; then
    exec 3>&- || true
    wait "$listener_pid" || true
  fi
  stop_servers
}
trap cleanup EXIT
start_servers "$DIR" --sql-only --setting "shared_buffers = '512MB'" --setting "max_wal_size = '4GB'" \
  --setting "track_wal_io_timing = on"
bash scripts/sql-only.sh >"$DIR/notify.sql"
gate="IF NOT pg_try_advisory_xact_lock_shared(outbox._wake_key())"
grep -cF "$gate" "$DIR/notify.sql" | grep -qx 1 ||
  { echo "notify-cost.sh: outbox_enqueue's wake-up is not where this script looks for it" >&2; exit 1; }
# silent: neither the wake key nor the NOTIFY.
sed "s/$gate/IF false/" "$DIR/notify.sql" >"$DIR/silent.sql"
for db in notify silent; do
  psql -d postgres -c "CREATE DATABASE $db"
  psql -d "$db" -f "$DIR/$db.sql"
done
channel=$(psql -d notify -c "SELECT outbox._wake_channel()")
# The bytes the kernel holds for the listener's psql, unread (its socket's Recv-Q).
unread_bytes() { ss -Htnp state established 2>/dev/null | awk -v pid="pid=$listener_pid," 'index($0, pid) { print $1 }'; }
# An idle session of database $1 that sleeps as a relay outside the server does (holds the wake
# key, LISTENs), and never reads: every writer then notifies. psql waits on its input (the fifo,
# fd 3 here), not on its socket. Returns once it listens; closing fd 3 ends it.
start_listener() {
  rm -f "$DIR/listen.fifo"
  mkfifo "$DIR/listen.fifo"
  "$PG_BIN/psql" -X -h 127.0.0.1 -p "$PG_PORT" -U postgres -d "$1" <"$DIR/listen.fifo" >"$DIR/listener.out" 2>&1 &
  listener_pid=$!
  exec 3>"$DIR/listen.fifo"
  echo "SELECT pg_advisory_lock(outbox._wake_key()) WHERE '$1' = 'notify'; LISTEN $channel;" >&3
  wait_for 60 "the listener to LISTEN" listening
}
listening() {
  [ "$(psql -d postgres -c "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND state = 'idle'")" = 1 ]
}
# One transaction of one enqueue (autocommit), and one of ten; aggregates drawn from 100,000, so
# that the 8 clients' order locks rarely meet.
cat >"$DIR/one.sql" <<'EOF'
\set aggregate random(1, 100000)
SELECT outbox_enqueue('bench', :aggregate::text, 'bench.created', '{"n": 1, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}');
EOF
cat >"$DIR/ten.sql" <<'EOF'
\set aggregate random(1, 100000)
SELECT count(outbox_enqueue('bench', (:aggregate + n)::text, 'bench.created', '{"n": 1, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}')) FROM generate_series(1, 10) n;
EOF
echo "PostgreSQL: $("$PG_BIN/postgres" --version); $(nproc) cores; $(uname -r); pgbench -c 8 -j 2 -T $seconds"
for listening in no yes; do
  for script in one ten; do
    for db in notify silent notify silent; do
      if [ "$listening" = yes ]; then
        start_listener "$db"
      fi
      psql -d "$db" -c "TRUNCATE outbox.events_0, outbox.events_1, outbox.events_2" -c "CHECKPOINT" \
        -c "SELECT pg_stat_reset_shared('wal')" >/dev/null
      out=$("$PG_BIN/pgbench" -n -c 8 -j 2 -T "$seconds" -f "$DIR/$script.sql" -h 127.0.0.1 -p "$PG_PORT" -U postgres "$db" 2>&1)
      tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
      latency=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' <<<"$out")
      [ -n "$tps" ] || { echo "$out" >&2; exit 1; }
      # The WAL flushes: a notifying commit flushes alone, holding the lock; others share flushes.
      flushes=$(psql -d "$db" -c "SELECT format('wal_syncs=%s sync_ms=%s', wal_sync, round((wal_sync_time / nullif(wal_sync, 0))::numeric, 3)) FROM pg_stat_wal")
      line="listener=$listening enqueues=$script db=$db tps=$tps latency_ms=$latency $flushes"
      if [ "$listening" = yes ]; then
        usage=$(psql -d "$db" -c "SELECT pg_notification_queue_usage()")
        wait_event=$(psql -d postgres -c "SELECT coalesce(wait_event, '-') FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
        unread=$(unread_bytes)
        line="$line queue_usage=$usage listener_wait=$wait_event unread_bytes=$unread"
        exec 3>&-
        wait "$listener_pid" || true
        listener_pid=""
      fi
      echo "$line"
    done
  done
done
# What a listener that never reads does with more than its socket buffers hold: one transaction of
# 200,000 notifications of 1,000 bytes each (distinct, so not folded), 200 MB.
start_listener notify
psql -d notify -c "SELECT count(pg_notify('$channel', n || repeat('x', 1000))) FROM generate_series(1, 200000) n" >/dev/null
# Until the listener's backend blocks writing to it (the socket buffers full), or 30 s.
deadline=$((SECONDS + 30))
until [ "$(psql -d postgres -c "SELECT wait_event FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")" = ClientWrite ] ||
  [ $SECONDS -ge $deadline ]; do
  sleep 0.1
done
echo "a listener that never reads, 200 MB of notifications later: queue_usage=$(psql -d notify -c "SELECT pg_notification_queue_usage()") listener_wait=$(psql -d postgres -c "SELECT coalesce(wait_event, '-') FROM pg_stat_activity WHERE query LIKE 'LISTEN %'") unread_bytes=$(unread_bytes)"
exec 3>&-
wait "$listener_pid" || true
listener_pid=""
deadline=$((SECONDS + 60))
until [ "$(psql -d notify -c "SELECT pg_notification_queue_usage() = 0")" = t ]; do
  [ $SECONDS -lt $deadline ] || { echo "notify-cost.sh: the queue was not emptied" >&2; break; }
  sleep 0.1
done
echo "once it disconnected: queue_usage=$(psql -d notify -c "SELECT pg_notification_queue_usage()")"
grep "NOTIFY queue" "$PG_LOG" || echo "server log: no line about the NOTIFY queue"
