#!/usr/bin/env bash
# Builds the Debian packages of a release:
#   postgresql-NN-outbox-pg_<version>_<arch>.deb  the extension for PostgreSQL NN (library, control
#                                                 file, install and upgrade scripts), named and laid
#                                                 out like Debian's and PGDG's own
#                                                 postgresql-NN-<extension> packages
#   outbox-consume_<version>_<arch>.deb           the outbox-consume CLI in /usr/bin
# Usage: [PG_MAJOR=NN] bash scripts/package.sh [OUT_DIR]   (default: $OUTBOX_DEB_DIR, else target/debian)
# PG_MAJOR: 15 (default), 16, 17 or 18. The build uses that major's pg_config (scripts/pg-config.sh,
# or $PG_CONFIG); the package installs where Debian's postgresql-NN looks, whatever that pg_config says.
# OUTBOX_PACKAGE_REUSE=1 skips the (slow, release) build when both packages of the current versions
# already exist in OUT_DIR. The last lines of output are the paths of the two packages.
# Installs nothing into PostgreSQL's directories: pgrx stages the files under target/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PG_MAJOR=${PG_MAJOR:-15}
if [ -n "${PG_CONFIG:-}" ]; then
  export "PG_CONFIG_$PG_MAJOR=$PG_CONFIG"
fi
PG_CONFIG=$(bash scripts/pg-config.sh "$PG_MAJOR")
EXT_PKG=postgresql-$PG_MAJOR-outbox-pg
CLI_PKG=outbox-consume
OUT_DIR=$(realpath -m "${1:-${OUTBOX_DEB_DIR:-$ROOT/target/debian}}")

bash scripts/install-deps.sh "$PG_MAJOR"
# dpkg-dev: dpkg-shlibdeps computes the library dependencies; binutils: strip. Both are build-only,
# hence here and not in install-deps.sh.
need_pkgs=()
for pkg in dpkg-dev binutils; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "package: installing Debian packages: ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS  # it would override the link flags pgrx needs

ARCH=$(dpkg --print-architecture)
# Versions come from the crates' Cargo.toml. A Cargo pre-release (0.2.0-rc.1) becomes 0.2.0~rc.1,
# which Debian sorts before 0.2.0 as Cargo does.
crate_version() {
  cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == sys.argv[1]))' "$1"
}
deb_version() { echo "${1/-/\~}"; }
EXT_VERSION=$(deb_version "$(crate_version outbox_pg)")
CLI_VERSION=$(deb_version "$(crate_version outbox-consumer)")
EXT_DEB=$OUT_DIR/${EXT_PKG}_${EXT_VERSION}_${ARCH}.deb
CLI_DEB=$OUT_DIR/${CLI_PKG}_${CLI_VERSION}_${ARCH}.deb

if [ "${OUTBOX_PACKAGE_REUSE:-0}" = 1 ] && [ -f "$EXT_DEB" ] && [ -f "$CLI_DEB" ]; then
  echo "package: OUTBOX_PACKAGE_REUSE=1 and both packages exist, not rebuilding"
  echo "$EXT_DEB"
  echo "$CLI_DEB"
  exit 0
fi

TARGET_DIR=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
STAGE=$TARGET_DIR/debian-stage
rm -rf "$STAGE"
mkdir -p "$STAGE" "$OUT_DIR"

echo "== cargo pgrx package (release build of the extension)"
PGRX_OUT=$STAGE/pgrx
cargo pgrx package --no-default-features --features "pg$PG_MAJOR" --pg-config "$PG_CONFIG" --out-dir "$PGRX_OUT"

echo "== cargo build --release -p outbox-consumer"
# A target directory of its own: cargo pgrx builds the extension with rustflags of its own, and in
# one directory the two release builds rebuilt the dependencies they share (redis, rustls, ring)
# for each other on every run (seen when tests/image.rs ran after tests/package.rs).
CLI_TARGET_DIR=$TARGET_DIR/cli
CARGO_TARGET_DIR=$CLI_TARGET_DIR cargo build --release -p outbox-consumer --bin outbox-consume

# Debian's tree layout (postgresql-common's, which PGDG's packages share): what dpkg-deb packs is
# exactly what lands on disk. pgrx staged the files under the build's pg_config directories (the
# private PyPI tree's, scripts/pg-config.sh), whatever those are.
EXT_ROOT=$STAGE/$EXT_PKG
CLI_ROOT=$STAGE/$CLI_PKG
PKGLIBDIR=/usr/lib/postgresql/$PG_MAJOR/lib
SHAREDIR=/usr/share/postgresql/$PG_MAJOR
install -d "$EXT_ROOT/DEBIAN" "$EXT_ROOT$PKGLIBDIR" "$EXT_ROOT$SHAREDIR/extension"
install -m 0644 "$PGRX_OUT$("$PG_CONFIG" --pkglibdir)"/outbox_pg.so "$EXT_ROOT$PKGLIBDIR/"
install -m 0644 "$PGRX_OUT$("$PG_CONFIG" --sharedir)"/extension/outbox_pg* "$EXT_ROOT$SHAREDIR/extension/"
install -d "$CLI_ROOT/DEBIAN" "$CLI_ROOT/usr/bin"
install -m 0755 "$CLI_TARGET_DIR/release/outbox-consume" "$CLI_ROOT/usr/bin/"

# pgrx copies the hand-written upgrade scripts from sql/ next to the generated install script; a
# package without one of them could not ALTER EXTENSION ... UPDATE, so check rather than trust.
shopt -s nullglob
for script in sql/outbox_pg--*--*.sql; do
  if [ ! -f "$EXT_ROOT$SHAREDIR/extension/$(basename "$script")" ]; then
    echo "package: upgrade script $script is missing from pgrx's output" >&2
    exit 1
  fi
done
shopt -u nullglob
if [ ! -f "$EXT_ROOT$SHAREDIR/extension/outbox_pg--$(crate_version outbox_pg).sql" ]; then
  echo "package: the install script outbox_pg--$(crate_version outbox_pg).sql is missing" >&2
  exit 1
fi

# As dh_strip would: the symbol tables are half the size and nobody debugs from them here.
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$EXT_ROOT$PKGLIBDIR/outbox_pg.so"
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$CLI_ROOT/usr/bin/outbox-consume"

MAINTAINER=${DEB_MAINTAINER:-"$(git config user.name || echo outbox_pg maintainers) <$(git config user.email || echo root@localhost)>"}

# Documentation: Debian wants a copyright file and a changelog in every package. The crates
# declare the PostgreSQL licence; a LICENSE file is shipped when the tree has one.
# The project's CHANGELOG.md is not in Debian's changelog format, which a native package's
# changelog.gz must be: ship it as it is, beside a one-entry Debian changelog dated by the commit.
add_docs() { # root package readme version
  local doc=$1/usr/share/doc/$2
  install -d "$doc"
  install -m 0644 "$3" "$doc/README.md"
  install -m 0644 CHANGELOG.md "$doc/CHANGELOG.md"
  cat >"$doc/changelog" <<EOF
$2 ($4) unstable; urgency=medium

  * Built from outbox_pg commit $(git describe --always --dirty); the changes are listed in
    /usr/share/doc/$2/CHANGELOG.md.gz.

 -- $MAINTAINER  $(git log -1 --format=%aD)
EOF
  gzip -9n "$doc/README.md" "$doc/CHANGELOG.md" "$doc/changelog"
  if [ -f LICENSE ]; then
    install -m 0644 LICENSE "$doc/copyright"
  else
    cat >"$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: outbox_pg
Comment: built from the outbox_pg source tree, which carries no LICENSE file;
 the licence below is the one its Cargo.toml files declare.

Files: *
License: PostgreSQL
EOF
  fi
}
add_docs "$EXT_ROOT" "$EXT_PKG" README.md "$EXT_VERSION"
add_docs "$CLI_ROOT" "$CLI_PKG" consumer/README.md "$CLI_VERSION"

# dpkg-shlibdeps turns the ELF files' DT_NEEDED entries into versioned Depends (libc6, libgcc-s1).
# It wants a debian/control of a source package in the current directory: give it a minimal one.
# The extension's references to the server's own symbols are resolved by the postgres binary at
# load time, hence the dependency on postgresql-NN and -e on a library (no unresolved-symbol check).
shlibs_depends() { # elf-file
  local dir=$STAGE/shlibdeps depends
  mkdir -p "$dir/debian"
  printf 'Source: outbox-pg\n\nPackage: outbox-pg\nArchitecture: any\n' >"$dir/debian/control"
  depends=$(cd "$dir" && dpkg-shlibdeps -O -e"$1" | sed -n 's/^shlibs:Depends=//p')
  if [ -z "$depends" ]; then
    echo "package: dpkg-shlibdeps found no dependencies for $1" >&2
    exit 1
  fi
  echo "$depends"
}
EXT_DEPENDS="postgresql-$PG_MAJOR, $(shlibs_depends "$EXT_ROOT$PKGLIBDIR/outbox_pg.so")"
CLI_DEPENDS=$(shlibs_depends "$CLI_ROOT/usr/bin/outbox-consume")

write_control() { # root package version depends short-description long-description
  cat >"$1/DEBIAN/control" <<EOF
Package: $2
Version: $3
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $(du -sk --exclude=DEBIAN "$1" | cut -f1)
Depends: $4
Section: database
Priority: optional
Description: $5
$6
EOF
  # dpkg --verify checks installed files against these sums.
  (cd "$1" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) >"$1/DEBIAN/md5sums"
  chmod 0644 "$1/DEBIAN/control" "$1/DEBIAN/md5sums"
}
write_control "$EXT_ROOT" "$EXT_PKG" "$EXT_VERSION" "$EXT_DEPENDS" \
  "transactional outbox for PostgreSQL $PG_MAJOR, relayed to Redis Streams" \
  " outbox_pg lets an application write an event in the same transaction as its
 data (outbox_enqueue); a background worker inside PostgreSQL publishes every
 committed event to a Redis stream, at least once and in commit order per
 aggregate.
 .
 The server must preload the library (shared_preload_libraries = 'outbox_pg')
 and be restarted; then CREATE EXTENSION outbox_pg in the relayed database."
write_control "$CLI_ROOT" "$CLI_PKG" "$CLI_VERSION" "$CLI_DEPENDS" \
  "idempotent Redis Streams consumer for outbox_pg events" \
  " outbox-consume reads the events outbox_pg relays to a Redis stream as a member
 of a consumer group, drops duplicates by event_id, reclaims stale entries,
 dead-letters entries that keep failing, and prints each event as a JSON line."

# --root-owner-group: files owned by root without fakeroot, whoever builds.
find "$STAGE/$EXT_PKG" "$STAGE/$CLI_PKG" -type d -exec chmod 0755 {} +
dpkg-deb --root-owner-group -Zxz --build "$EXT_ROOT" "$EXT_DEB" >/dev/null
dpkg-deb --root-owner-group -Zxz --build "$CLI_ROOT" "$CLI_DEB" >/dev/null

echo "== packages"
echo "$EXT_DEB"
echo "$CLI_DEB"
