#!/usr/bin/env bash
# Prints outbox_pg's SQL-only install on standard output: the schema, outbox_enqueue and the rest
# of the SQL API in SQL and PL/pgSQL, for servers that cannot load the library (managed
# PostgreSQL). A database owner with CREATEROLE runs it (docs/sql-only.md):
#   bash scripts/sql-only.sh > outbox_pg.sql && psql -d app -f outbox_pg.sql
# --pg-tle prints the same SQL as a pgtle.install_extension(...) call instead, for RDS, Aurora
# and Supabase (then CREATE EXTENSION outbox_pg). --uninstall prints the plain install's removal
# (its functions in schema public, then the schema outbox and everything in it).
# Made by scripts/sql.py from the same src/sql/ files the extension is built from.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") exec python3 scripts/sql.py sql-only ;;
  --pg-tle | --uninstall) exec python3 scripts/sql.py sql-only "$1" ;;
  *) echo "usage: bash scripts/sql-only.sh [--pg-tle | --uninstall]" >&2; exit 2 ;;
esac
