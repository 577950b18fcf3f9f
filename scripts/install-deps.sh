#!/usr/bin/env bash
# Installs everything the build, the tests and the demo need on a fresh Debian 12 machine:
# Debian packages (PostgreSQL $PG_MAJOR server + headers, default 15, clang for bindgen,
# redis-server, sudo, openssl for the TLS tests; a PG_MAJOR Debian does not carry comes from the
# PostgreSQL project's apt repository, apt.postgresql.org),
# the pinned cargo-pgrx, and its one-time `init` against the system PostgreSQL.
# Idempotent: each step is skipped when already done, so it is cheap to call from every script.
set -euo pipefail

PGRX_VERSION=0.18.1
PG_MAJOR=${PG_MAJOR:-15}
PG_CONFIG=/usr/lib/postgresql/$PG_MAJOR/bin/pg_config

# Debian 12 carries PostgreSQL 15 only; other majors come from PGDG (the GitHub workflow's matrix).
if ! apt-cache show "postgresql-$PG_MAJOR" >/dev/null 2>&1 && [ ! -f /etc/apt/sources.list.d/pgdg.list ]; then
  echo "install-deps: adding apt.postgresql.org for PostgreSQL $PG_MAJOR"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends curl ca-certificates gnupg lsb-release >/dev/null
  curl -fsSL https://www.postgresql.org/media/keys/ACCC4CF8.asc | gpg --dearmor -o /usr/share/keyrings/pgdg.gpg
  echo "deb [signed-by=/usr/share/keyrings/pgdg.gpg] https://apt.postgresql.org/pub/repos/apt $(lsb_release -cs)-pgdg main" \
    > /etc/apt/sources.list.d/pgdg.list
fi

need_pkgs=()
for pkg in postgresql-$PG_MAJOR postgresql-server-dev-$PG_MAJOR libclang-dev clang pkg-config \
           redis-server sudo ca-certificates openssl python3; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "install-deps: installing Debian packages: ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
  echo "install-deps: installing cargo-pgrx $PGRX_VERSION (takes a few minutes)"
  cargo install cargo-pgrx --version "=$PGRX_VERSION" --locked
fi

# Re-running init rewrites config.toml and forces a rebuild of pgrx-pg-sys: only do it once.
PGRX_HOME=${PGRX_HOME:-$HOME/.pgrx}
if [ ! -f "$PGRX_HOME/config.toml" ] || ! grep -q "pg$PG_MAJOR" "$PGRX_HOME/config.toml"; then
  cargo pgrx init --pg$PG_MAJOR "$PG_CONFIG"
fi
