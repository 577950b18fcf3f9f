#!/usr/bin/env bash
# Builds outbox-relay, the relay outside the server (docs/outside-relay.md), for hosts beside a
# managed PostgreSQL:
#   outbox-relay_<version>_<arch>.deb           /usr/bin/outbox-relay; the systemd template
#                                               /lib/systemd/system/outbox-relay@.service (instance
#                                               NAME reads /etc/outbox-relay/NAME.conf and NAME.env);
#                                               /etc/outbox-relay/example.conf; the SQL-only install
#                                               in /usr/share/outbox-relay; docs; a postinst that
#                                               makes the system user outbox-relay
#   outbox-relay-<version>-<target>.tar.gz      the same binary, unit, example and SQL in one folder
# Usage: bash scripts/package-relay.sh [OUT_DIR]   (default: $OUTBOX_DEB_DIR, else target/debian)
# OUTBOX_PACKAGE_REUSE=1 skips the build when both files of the current version exist in OUT_DIR.
# The last two lines of output are their paths.
#
# Apart from scripts/package.sh, which builds the extension's packages: the relay needs no
# PostgreSQL, pg_config or pgrx to build (package.sh installs them), and one package serves every
# PostgreSQL major. This script installs nothing and reaches no network but cargo's own (set
# CARGO_NET_OFFLINE=true to build from cargo's cache only); it needs cargo, dpkg-dev, binutils
# and python3. The binary links no OpenSSL (TLS is rustls): it is checked to need only glibc and
# libgcc_s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PKG=outbox-relay
OUT_DIR=$(realpath -m "${1:-${OUTBOX_DEB_DIR:-$ROOT/target/debian}}")
export PATH="$HOME/.cargo/bin:$PATH"

for tool in cargo dpkg-deb dpkg-shlibdeps strip readelf python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "package-relay: $tool is missing (apt-get install dpkg-dev binutils python3)" >&2
    exit 1
  fi
done

ARCH=$(dpkg --print-architecture)
TARGET=$(rustc -vV | sed -n 's/^host: //p')
metadata() { cargo metadata --no-deps --format-version 1 --offline; }
# A Cargo pre-release (0.5.0-rc.1) becomes 0.5.0~rc.1, which Debian sorts before 0.5.0.
CRATE_VERSION=$(metadata | python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "outbox-relay"))')
VERSION=${CRATE_VERSION/-/\~}
DEB=$OUT_DIR/${PKG}_${VERSION}_${ARCH}.deb
TARBALL=$OUT_DIR/$PKG-$CRATE_VERSION-$TARGET.tar.gz

if [ "${OUTBOX_PACKAGE_REUSE:-0}" = 1 ] && [ -f "$DEB" ] && [ -f "$TARBALL" ]; then
  echo "package-relay: OUTBOX_PACKAGE_REUSE=1 and both files exist, not rebuilding"
  echo "$DEB"
  echo "$TARBALL"
  exit 0
fi

TARGET_DIR=$(metadata | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
echo "== cargo build --release -p $PKG"
cargo build --release --locked -p "$PKG" --bin "$PKG"
BINARY=$TARGET_DIR/release/$PKG

# "Static enough": what the dynamic loader must find is glibc's and libgcc_s's, on every Debian
# and Ubuntu; no libssl, whose soname changes between releases.
echo "== ldd $BINARY"
ldd "$BINARY"
needed=$(readelf -d "$BINARY" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
for lib in $needed; do
  case "$lib" in
    libc.so.6 | libm.so.6 | libgcc_s.so.1 | libpthread.so.0 | libdl.so.2 | librt.so.1 | ld-linux*.so.*) ;;
    *)
      echo "package-relay: $BINARY needs $lib; only glibc and libgcc_s are expected" >&2
      exit 1
      ;;
  esac
done

STAGE=$TARGET_DIR/relay-package-stage
PKG_ROOT=$STAGE/$PKG
rm -rf "$STAGE"
mkdir -p "$STAGE" "$OUT_DIR"

# The SQL-only install of this version: the relay expects the schema of its own version.
SQL_DIR=$PKG_ROOT/usr/share/$PKG
install -d "$SQL_DIR"
bash scripts/sql-only.sh >"$SQL_DIR/outbox_pg.sql"
bash scripts/sql-only.sh --pg-tle >"$SQL_DIR/outbox_pg--pg-tle.sql"
chmod 0644 "$SQL_DIR"/*.sql

install -d "$PKG_ROOT/DEBIAN" "$PKG_ROOT/usr/bin" "$PKG_ROOT/lib/systemd/system" "$PKG_ROOT/etc/$PKG"
install -m 0755 "$BINARY" "$PKG_ROOT/usr/bin/$PKG"
# As dh_strip would: the symbol tables are most of the file and nobody debugs from them here.
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$PKG_ROOT/usr/bin/$PKG"
install -m 0644 outside/packaging/outbox-relay@.service "$PKG_ROOT/lib/systemd/system/"
install -m 0644 outside/packaging/example.conf "$PKG_ROOT/etc/$PKG/example.conf"
for script in postinst prerm postrm; do
  install -m 0755 "outside/packaging/debian/$script" "$PKG_ROOT/DEBIAN/$script"
done
# Files in /etc are the administrator's once installed: dpkg keeps their edits on upgrade.
echo "/etc/$PKG/example.conf" >"$PKG_ROOT/DEBIAN/conffiles"

# The commit built, its date (the tarball's files carry it): a source tree without git has neither.
COMMIT=$(git describe --always --dirty 2>/dev/null || echo "an unknown commit")
COMMIT_DATE=$(git log -1 --format=%aD 2>/dev/null || date -R)
COMMIT_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)
MAINTAINER=${DEB_MAINTAINER:-"$(git config user.name || echo outbox_pg maintainers) <$(git config user.email || echo root@localhost)>"}

# Documentation: Debian wants a copyright file and a changelog (in its own format) in every
# package; the project's CHANGELOG.md ships as it is beside them.
DOC=$PKG_ROOT/usr/share/doc/$PKG
install -d "$DOC"
install -m 0644 docs/outside-relay.md docs/sql-only.md CHANGELOG.md "$DOC/"
cat >"$DOC/changelog" <<EOF
$PKG ($VERSION) unstable; urgency=medium

  * Built from outbox_pg commit $COMMIT; the changes are listed in
    /usr/share/doc/$PKG/CHANGELOG.md.gz.

 -- $MAINTAINER  $COMMIT_DATE
EOF
gzip -9n "$DOC/outside-relay.md" "$DOC/sql-only.md" "$DOC/CHANGELOG.md" "$DOC/changelog"
if [ -f LICENSE ]; then
  install -m 0644 LICENSE "$DOC/copyright"
else
  cat >"$DOC/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: outbox_pg
Comment: built from the outbox_pg source tree, which carries no LICENSE file;
 the licence below is the one its Cargo.toml files declare.

Files: *
License: PostgreSQL
EOF
  chmod 0644 "$DOC/copyright"
fi

# dpkg-shlibdeps turns the binary's DT_NEEDED entries into versioned Depends (libc6, libgcc-s1);
# it wants a source package's debian/control in the current directory: a minimal one. passwd:
# the postinst's useradd.
SHLIBS=$STAGE/shlibdeps
mkdir -p "$SHLIBS/debian"
printf 'Source: %s\n\nPackage: %s\nArchitecture: any\n' "$PKG" "$PKG" >"$SHLIBS/debian/control"
SHLIBS_DEPENDS=$(cd "$SHLIBS" && dpkg-shlibdeps -O -e"$PKG_ROOT/usr/bin/$PKG" | sed -n 's/^shlibs:Depends=//p')
if [ -z "$SHLIBS_DEPENDS" ]; then
  echo "package-relay: dpkg-shlibdeps found no dependencies" >&2
  exit 1
fi

cat >"$PKG_ROOT/DEBIAN/control" <<EOF
Package: $PKG
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $(du -sk --exclude=DEBIAN "$PKG_ROOT" | cut -f1)
Depends: $SHLIBS_DEPENDS, passwd
Section: database
Priority: optional
Description: outbox_pg's relay for managed PostgreSQL, to Redis Streams
 outbox-relay publishes the events of outbox_pg's transactional outbox to
 Redis Streams from outside the database server, over a client connection
 (TLS as libpq's sslmode says): for RDS, Aurora, Cloud SQL, Azure, Supabase
 or Neon, where the extension's library cannot be loaded.
 .
 Install the schema with /usr/share/outbox-relay/outbox_pg.sql, then run one
 instance per database: systemctl enable --now outbox-relay@NAME reads
 /etc/outbox-relay/NAME.conf (see example.conf there) and NAME.env.
EOF
# dpkg --verify checks installed files against these sums.
(cd "$PKG_ROOT" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) >"$PKG_ROOT/DEBIAN/md5sums"
chmod 0644 "$PKG_ROOT/DEBIAN/control" "$PKG_ROOT/DEBIAN/md5sums" "$PKG_ROOT/DEBIAN/conffiles"
find "$PKG_ROOT" -type d -exec chmod 0755 {} +
# --root-owner-group: files owned by root without fakeroot, whoever builds.
dpkg-deb --root-owner-group -Zxz --build "$PKG_ROOT" "$DEB" >/dev/null

# The tarball: one folder, files owned by root, dated by the commit.
TAR_DIR=$STAGE/$PKG-$CRATE_VERSION
install -d "$TAR_DIR"
install -m 0755 "$PKG_ROOT/usr/bin/$PKG" "$TAR_DIR/"
install -m 0644 outside/packaging/outbox-relay@.service outside/packaging/example.conf "$SQL_DIR"/*.sql \
  docs/outside-relay.md docs/sql-only.md "$TAR_DIR/"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$COMMIT_EPOCH" \
  -C "$STAGE" -cf - "$PKG-$CRATE_VERSION" | gzip -9n >"$TARBALL"

echo "== packages"
echo "$DEB"
echo "$TARBALL"
