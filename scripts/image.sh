#!/usr/bin/env bash
# Builds the extension image of outbox_pg for PostgreSQL 18, laid out the way CloudNativePG mounts
# an extension image as a volume (cloudnative-pg/postgres-extensions-containers: one image per
# extension, FROM scratch) and PostgreSQL 18's extension_control_path and dynamic_library_path
# read it:
#   share/extension/outbox_pg.control, outbox_pg--<version>.sql, the upgrade scripts of sql/
#   lib/outbox_pg.so
#   licenses/outbox_pg/copyright
# written as an OCI image layout (oci-layout, index.json, blobs/sha256/...): one gzip layer, its
# config and manifest, tagged <version>-18-bookworm in index.json. No registry and no container
# engine: tar, gzip, sha256sum and python3 for the JSON. Push it with any OCI tool, e.g.
#   skopeo copy oci:target/image/outbox_pg:0.3.0-18-bookworm docker://registry.example/outbox_pg:0.3.0-18-bookworm
# Usage: bash scripts/image.sh [OUT_DIR]   (default: $OUTBOX_IMAGE_DIR, else target/image/outbox_pg)
# The build uses PostgreSQL 18's pg_config (scripts/pg-config.sh 18, or PG_CONFIG_18). The last line
# of output is the layout's directory. Installs nothing into PostgreSQL's directories.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PG_MAJOR=18 # extension_control_path and dynamic_library_path's use for extensions start with 18
PG_CONFIG=$(bash scripts/pg-config.sh "$PG_MAJOR")
OUT_DIR=$(realpath -m "${1:-${OUTBOX_IMAGE_DIR:-$ROOT/target/image/outbox_pg}}")

bash scripts/install-deps.sh "$PG_MAJOR"
command -v strip >/dev/null || {
  echo "image: installing binutils (strip)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends binutils >/dev/null
}
export PATH="$HOME/.cargo/bin:$PATH"
unset RUSTFLAGS # it would override the link flags pgrx needs

VERSION=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "outbox_pg"))')
# The tag names the extension's version, the PostgreSQL major and the Debian release whose glibc the
# library was built against (CloudNativePG's images are named the same way: 0.8.4-18-trixie).
CODENAME=$(. /etc/os-release && echo "${VERSION_CODENAME:-linux}")
TAG=$VERSION-$PG_MAJOR-$CODENAME
TARGET_DIR=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
STAGE=$TARGET_DIR/image-stage
rm -rf "$STAGE"
mkdir -p "$STAGE"

# The same release build as the Debian package of 18 (scripts/package.sh): cargo reuses it when
# that ran first.
echo "== cargo pgrx package (release build of the extension for PostgreSQL $PG_MAJOR)"
cargo pgrx package --no-default-features --features "pg$PG_MAJOR" --pg-config "$PG_CONFIG" --out-dir "$STAGE/pgrx"

FILES=$STAGE/files
install -d "$FILES/lib" "$FILES/share/extension" "$FILES/licenses/outbox_pg"
install -m 0644 "$STAGE/pgrx$("$PG_CONFIG" --pkglibdir)/outbox_pg.so" "$FILES/lib/"
install -m 0644 "$STAGE/pgrx$("$PG_CONFIG" --sharedir)"/extension/outbox_pg* "$FILES/share/extension/"
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$FILES/lib/outbox_pg.so"
for script in sql/outbox_pg--*--*.sql "outbox_pg--$VERSION.sql"; do
  if [ ! -f "$FILES/share/extension/$(basename "$script")" ]; then
    echo "image: $(basename "$script") is missing from pgrx's output" >&2
    exit 1
  fi
done
cat >"$FILES/licenses/outbox_pg/copyright" <<EOF
outbox_pg $VERSION, built from commit $(git describe --always --dirty).
License: PostgreSQL (the licence its Cargo.toml files declare).
EOF

# The layer: a reproducible tar (sorted, numeric root ownership, the commit's time) of the
# directories above, gzip without a name or time. Mode 0755/0644: the image's user (65532, as
# CloudNativePG's images) and PostgreSQL's only read it.
EPOCH=$(git log -1 --format=%ct)
find "$FILES" -type d -exec chmod 0755 {} +
find "$FILES" -type f -exec chmod 0644 {} +
LAYER_TAR=$STAGE/layer.tar
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$EPOCH" --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -C "$FILES" -cf "$LAYER_TAR" lib share licenses
gzip -9n -c "$LAYER_TAR" >"$LAYER_TAR.gz"

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR/blobs/sha256"
# Writes a blob under its digest and prints "sha256:<hex> <size>".
blob() { # file
  local hex size
  hex=$(sha256sum "$1" | cut -d' ' -f1)
  size=$(stat -c %s "$1")
  cp "$1" "$OUT_DIR/blobs/sha256/$hex"
  echo "sha256:$hex $size"
}
read -r LAYER_DIGEST LAYER_SIZE < <(blob "$LAYER_TAR.gz")
DIFF_ID=sha256:$(sha256sum "$LAYER_TAR" | cut -d' ' -f1)
CREATED=$(date -u -d "@$EPOCH" +%Y-%m-%dT%H:%M:%SZ)

# Config, manifest and index (OCI image spec v1.1), in that order since each names the previous
# one's digest. Labels and annotations as CloudNativePG's extension images carry them.
python3 - "$STAGE" "$VERSION" "$TAG" "$CREATED" "$DIFF_ID" "$(dpkg --print-architecture)" <<'EOF'
import json, sys
stage, version, tag, created, diff_id, arch = sys.argv[1:]
description = ("outbox_pg, the transactional outbox relayed to Redis Streams, for PostgreSQL 18's "
               "extension_control_path and dynamic_library_path")
labels = {
    "org.opencontainers.image.title": "outbox_pg",
    "org.opencontainers.image.version": version,
    "org.opencontainers.image.description": description,
    "org.opencontainers.image.licenses": "PostgreSQL",
    "org.opencontainers.image.created": created,
}
config = {
    "created": created,
    "architecture": arch,
    "os": "linux",
    "config": {"User": "65532:65532", "Labels": labels},
    "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    "history": [{"created": created, "created_by": "scripts/image.sh: lib/, share/extension/, licenses/ (FROM scratch)"}],
}
with open(f"{stage}/config.json", "w") as f:
    json.dump(config, f, separators=(",", ":"), sort_keys=True)
EOF
read -r CONFIG_DIGEST CONFIG_SIZE < <(blob "$STAGE/config.json")

python3 - "$STAGE" "$VERSION" "$CREATED" "$CONFIG_DIGEST" "$CONFIG_SIZE" "$LAYER_DIGEST" "$LAYER_SIZE" <<'EOF'
import json, sys
stage, version, created, config_digest, config_size, layer_digest, layer_size = sys.argv[1:]
manifest = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": int(config_size)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": int(layer_size)}],
    "annotations": {"org.opencontainers.image.title": "outbox_pg", "org.opencontainers.image.version": version,
                    "org.opencontainers.image.created": created},
}
with open(f"{stage}/manifest.json", "w") as f:
    json.dump(manifest, f, separators=(",", ":"), sort_keys=True)
EOF
read -r MANIFEST_DIGEST MANIFEST_SIZE < <(blob "$STAGE/manifest.json")

python3 - "$OUT_DIR" "$TAG" "$MANIFEST_DIGEST" "$MANIFEST_SIZE" "$(dpkg --print-architecture)" <<'EOF'
import json, sys
out, tag, digest, size, arch = sys.argv[1:]
index = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest, "size": int(size),
                   "platform": {"architecture": arch, "os": "linux"},
                   "annotations": {"org.opencontainers.image.ref.name": tag}}],
}
with open(f"{out}/index.json", "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
with open(f"{out}/oci-layout", "w") as f:
    json.dump({"imageLayoutVersion": "1.0.0"}, f)
EOF

echo "== image outbox_pg:$TAG ($((LAYER_SIZE / 1024)) KiB layer, manifest $MANIFEST_DIGEST)"
echo "$OUT_DIR"
