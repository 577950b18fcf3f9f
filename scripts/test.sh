#!/usr/bin/env bash
# Runs every test: formatting and lints, unit tests, the #[pg_test]s of the SQL API inside a
# pgrx-managed PostgreSQL, and the integration tests in tests/ that start their own PostgreSQL
# clusters (as the `postgres` OS user) and redis-servers on free loopback ports.
# Installs whatever is missing first (Debian packages, cargo-pgrx), so it works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS  # it would override the link flags pgrx needs

# PG_MAJOR (default 15, the supported version) picks the server to build and test against.
export PG_MAJOR=${PG_MAJOR:-15}
export PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/$PG_MAJOR/bin/pg_config}
FEATURES="pg$PG_MAJOR pg_test"
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
cargo clippy -p outbox-consumer -p outbox-bench -p outbox-demo --all-targets -- -D warnings

# The lib test binary runs first: it installs the extension (test build) into PostgreSQL's
# directories and runs the unit tests and #[pg_test]s. The integration tests then use that install.
echo "== cargo test"
# --no-fail-fast: one failing test binary does not hide the results of the others.
cargo test --no-fail-fast --no-default-features --features "$FEATURES" -- --test-threads="${TEST_THREADS:-2}" "$@"

# The consumer library and CLI (no pgrx), against their own redis-servers.
echo "== cargo test -p outbox-consumer"
cargo test -p outbox-consumer -- "$@"
