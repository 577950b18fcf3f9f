#!/usr/bin/env bash
# Prints the pg_config of PostgreSQL major NN, the one every script and test builds and runs against:
# the relocatable PyPI build scripts/install-deps.sh unpacks under /opt/postgresql/NN (15 too: the
# tests and the demo install their builds there, never into a server the machine's user runs, such
# as Debian's postgresql-15).
# PG_CONFIG_NN (e.g. PG_CONFIG_15=/opt/other/15/bin/pg_config) names another installation of that
# major; PG_PREFIX (default /opt/postgresql) moves the PyPI builds. The path is printed whether or
# not it exists yet (install-deps.sh uses it to know where to install).
# Usage: bash scripts/pg-config.sh NN
set -euo pipefail

major=${1:?usage: pg-config.sh MAJOR (15, 16, 17 or 18)}
override=PG_CONFIG_$major
if [ -n "${!override:-}" ]; then
  echo "${!override}"
  exit 0
fi
case "$major" in
  15 | 16 | 17 | 18) echo "${PG_PREFIX:-/opt/postgresql}/$major/bin/pg_config" ;;
  *)
    echo "pg-config.sh: PostgreSQL $major is not supported (15, 16, 17, 18; README, \"Installing\")" >&2
    exit 1
    ;;
esac
