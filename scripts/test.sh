#!/usr/bin/env bash
# Runs every test: formatting and lints, unit tests, the #[pg_test]s of the SQL API inside a
# pgrx-managed PostgreSQL, and the integration tests in tests/ that start their own PostgreSQL
# clusters (as the `postgres` OS user) and redis-servers on free loopback ports.
# Installs whatever is missing first (Debian packages, cargo-pgrx), so it works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# PG_MAJOR (15, 16, 17 or 18; default 15) picks the server to build and test against, PG_CONFIG
# another installation of it (scripts/pg-config.sh says where each major lives). tests/pg_upgrade.rs
# upgrades a cluster of PG_UPGRADE_FROM (default 15) to PG_MAJOR, so that major is installed too.
export PG_MAJOR=${PG_MAJOR:-15}
if [ -n "${PG_CONFIG:-}" ]; then
  export "PG_CONFIG_$PG_MAJOR=$PG_CONFIG"
fi
export PG_UPGRADE_FROM=${PG_UPGRADE_FROM:-15}
bash scripts/install-deps.sh "$PG_MAJOR" "$PG_UPGRADE_FROM"
# REDIS_VERSION (7.0, Debian's, the default; or 8.2, scripts/install-redis.sh) picks the
# redis-server every test starts; TLS tests stay on 7.0 (the 8.2 binary has no TLS).
export REDIS_VERSION=${REDIS_VERSION:-7.0}
REDIS_SERVER=$(bash scripts/install-redis.sh "$REDIS_VERSION")
REDIS_TLS_SERVER=$(bash scripts/install-redis.sh 7.0)
export REDIS_SERVER REDIS_TLS_SERVER
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS  # it would override the link flags pgrx needs
PG_CONFIG=$(bash scripts/pg-config.sh "$PG_MAJOR")
export PG_CONFIG
echo "== PostgreSQL $PG_MAJOR: $("$PG_CONFIG" --version), $PG_CONFIG"
echo "== Redis $REDIS_VERSION: $("$REDIS_SERVER" --version), $REDIS_SERVER"
# fault-injection: outbox.fault_injection exists only in builds with it (src/faults.rs); the tests
# and the demo use it, packages and plain installs leave it out.
FEATURES="pg$PG_MAJOR pg_test fault-injection"
# PostgreSQL refuses to run as root: the pgrx test instance runs as `postgres`, in a directory it
# owns with a short path (it is also the socket directory).
PGRX_TEST_DATA=${PGRX_TEST_DATA:-/tmp/opg-pgrx}
if [ "$(id -u)" = 0 ]; then
  install -d -o postgres -g postgres "$PGRX_TEST_DATA"
  export CARGO_PGRX_TEST_RUNAS=postgres
fi
export CARGO_PGRX_TEST_PGDATA="$PGRX_TEST_DATA"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --all-targets --no-default-features --features "$FEATURES" -- -D warnings
cargo clippy --no-default-features --features "pg$PG_MAJOR" -- -D warnings  # a production build
cargo clippy -p outbox-sink -p outbox-round -p outbox-protocol -p outbox-relay -p outbox-consumer -p outbox-bench -p outbox-demo -p outbox-testkit -p outbox-pgxn --all-targets -- -D warnings

# OUTBOX_TESTS names a part of the suite (.ci/run on 16 and 17): "lib" (the unit tests, the sink
# crate's too, and the #[pg_test]s), integration test files of tests/ by name, and "pgxn"
# (META.json, pgxn/) and "outside" (outbox-relay, the relay outside the server: outside/), e.g.
# "lib relay faults". Default: all, with the consumer crate's tests, pgxn and outside.
targets=()
lib=0
pgxn=0
outside=0
for name in ${OUTBOX_TESTS:-}; do
  case "$name" in
    lib) targets+=(--lib); lib=1 ;;
    pgxn) pgxn=1 ;;
    outside) outside=1 ;;
    *) targets+=(--test "$name") ;;
  esac
done

# tests/moving.rs runs outbox-relay (outside/) against a server with the library: built first, its
# path given to the tests.
cargo build -p outbox-relay
OUTBOX_RELAY_BIN="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/debug/outbox-relay"
export OUTBOX_RELAY_BIN

# The lib test binary runs first: it installs the extension (test build) into PostgreSQL's
# directories and runs the unit tests and #[pg_test]s. The integration tests then use that install.
if [ -z "${OUTBOX_TESTS:-}" ] || [ ${#targets[@]} -gt 0 ]; then
  echo "== cargo test"
  # --no-fail-fast: one failing test binary does not hide the results of the others.
  cargo test --no-fail-fast --no-default-features --features "$FEATURES" "${targets[@]}" -- --test-threads="${TEST_THREADS:-2}" "$@"
fi

# The crates the relay shares with the consumers and the outside relay (sink/, round/ and protocol/, no
# pgrx, hence no PostgreSQL feature): their unit tests and proptests, part of "lib".
if [ -z "${OUTBOX_TESTS:-}" ] || [ "$lib" = 1 ]; then
  echo "== cargo test -p outbox-sink -p outbox-round -p outbox-protocol"
  cargo test -p outbox-sink -p outbox-round -p outbox-protocol -- "$@"
fi

# The consumer library and CLI (no pgrx), against their own redis-servers; the test servers' own
# unit tests; META.json against the PGXN meta spec (a crate of its own: its validator's
# dependencies stay out of the extension's builds).
if [ -z "${OUTBOX_TESTS:-}" ]; then
  echo "== cargo test -p outbox-consumer -p outbox-testkit -p outbox-pgxn"
  cargo test -p outbox-consumer -p outbox-testkit -p outbox-pgxn -- "$@"
elif [ "$pgxn" = 1 ]; then
  echo "== cargo test -p outbox-pgxn"
  cargo test -p outbox-pgxn -- "$@"
fi

# outbox-relay (outside/, no pgrx): its unit tests, and its integration tests against servers that
# do not preload the library, with the SQL-only install (PG_CONFIG's installation).
if [ -z "${OUTBOX_TESTS:-}" ] || [ "$outside" = 1 ]; then
  echo "== cargo test -p outbox-relay"
  cargo test -p outbox-relay -- "$@"
fi
