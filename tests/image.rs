//! The extension image of scripts/image.sh, used as CloudNativePG uses an extension image on
//! PostgreSQL 18: the OCI image layout is read the way a registry client reads it (index.json, the
//! manifest, the config and the layer, each blob's size and sha256 digest checked, the config's
//! diff_id against the uncompressed layer); the layer holds only `lib/`, `share/extension/` and
//! `licenses/`, and is unpacked where CloudNativePG mounts the image (`/extensions/outbox_pg`, here
//! under a temporary directory). A PostgreSQL 18 whose own directories hold no outbox_pg file (a
//! copy of the private tree without them) then runs with only
//!   extension_control_path = '$system:<mount>/share'
//!   dynamic_library_path   = '$libdir:<mount>/lib'
//!   shared_preload_libraries = 'outbox_pg'
//! (the first two are what CloudNativePG writes for an image volume): the server preloads the
//! image's library (its relay has `<mount>/lib/outbox_pg.so` mapped), `CREATE EXTENSION outbox_pg`
//! finds the control file and install script there and resolves `module_pathname =
//! '$libdir/outbox_pg'` through dynamic_library_path (PostgreSQL 18 strips the `$libdir/`), and an
//! enqueued event reaches a real redis-server.
//!
//! Not exercised: a container runtime, a registry, Kubernetes and CloudNativePG itself (the mount is
//! a directory); the image's glibc requirement is Debian 12's, which CloudNativePG's bookworm and
//! trixie images meet.
//!
//! Runs when the major under test is 18 (`PG_MAJOR=18`); on 15-17 it says so and passes, since
//! those servers have no extension_control_path. The release build is the one scripts/package.sh
//! makes for 18, so after tests/package.rs (or before it) cargo builds it once.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::trees::{copy_without_outbox, last_line, mapped_file, stdout_of};
use common::{pg_config, run, Cluster, PgInstall, Redis, TempDir};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The OCI layout directory, read and checked blob by blob.
struct Layout {
    dir: PathBuf,
}

impl Layout {
    /// The blob a descriptor names, after checking its size and digest.
    fn blob(&self, descriptor: &Value, media_type: &str) -> PathBuf {
        assert_eq!(descriptor["mediaType"], media_type, "descriptor {descriptor}");
        let digest = descriptor["digest"].as_str().unwrap_or_else(|| panic!("no digest in {descriptor}"));
        let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
        let path = self.dir.join("blobs/sha256").join(hex);
        let size = fs::metadata(&path).unwrap_or_else(|e| panic!("blob {}: {e}", path.display())).len();
        assert_eq!(Some(size), descriptor["size"].as_u64(), "size of blob {digest}");
        assert_eq!(sha256_of(&path), hex, "digest of blob {}", path.display());
        path
    }

    fn json(&self, descriptor: &Value, media_type: &str) -> Value {
        let path = self.blob(descriptor, media_type);
        serde_json::from_slice(&fs::read(&path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }
}

fn sha256_of(path: &Path) -> String {
    let mut sum = Command::new("sha256sum");
    sum.arg(path);
    run(sum, "sha256sum").split_whitespace().next().unwrap_or_default().to_string()
}

/// sha256 of what `command` (a shell pipeline) writes to stdout.
fn sha256_of_stdout(command: &str) -> String {
    let mut sh = Command::new("bash");
    sh.args(["-c", &format!("set -o pipefail; {command} | sha256sum")]);
    run(sh, command).split_whitespace().next().unwrap_or_default().to_string()
}

#[test]
fn extension_image_runs_on_postgresql_18_from_its_mount() {
    let major = std::env::var("PG_MAJOR").unwrap_or_else(|_| "15".into());
    if major != "18" {
        eprintln!("PostgreSQL {major} has no extension_control_path: the extension image is tested on 18 only");
        return;
    }
    let built = stdout_of(
        Command::new("bash").arg(format!("{ROOT}/scripts/image.sh")).current_dir(ROOT),
        "bash scripts/image.sh",
    );
    let layout = Layout { dir: last_line(&built) };

    // The layout, as a registry client reads it.
    let oci_layout: Value = serde_json::from_slice(&fs::read(layout.dir.join("oci-layout")).unwrap()).unwrap();
    assert_eq!(oci_layout["imageLayoutVersion"], "1.0.0");
    let index: Value = serde_json::from_slice(&fs::read(layout.dir.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["schemaVersion"], 2);
    let manifests = index["manifests"].as_array().expect("index.json has manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    let tag = manifests[0]["annotations"]["org.opencontainers.image.ref.name"].as_str().unwrap_or_default();
    assert!(tag.starts_with(&format!("{VERSION}-18-")), "tag {tag}");
    assert_eq!(manifests[0]["platform"]["os"], "linux");
    let manifest = layout.json(&manifests[0], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(manifest["schemaVersion"], 2);
    let config = layout.json(&manifest["config"], "application/vnd.oci.image.config.v1+json");
    assert_eq!(config["config"]["Labels"]["org.opencontainers.image.version"], VERSION);
    let layers = manifest["layers"].as_array().expect("the manifest has layers");
    assert_eq!(layers.len(), 1, "one layer, FROM scratch: {manifest}");
    let layer = layout.blob(&layers[0], "application/vnd.oci.image.layer.v1.tar+gzip");
    let diff_id = sha256_of_stdout(&format!("gzip -dc '{}'", layer.display()));
    assert_eq!(config["rootfs"]["diff_ids"], serde_json::json!([format!("sha256:{diff_id}")]), "{config}");

    // What the layer holds: the extension's directories and nothing else.
    let mut list = Command::new("tar");
    list.arg("-tzf").arg(&layer);
    let entries = run(list, "tar -tzf of the layer");
    let files: Vec<&str> = entries.lines().filter(|line| !line.ends_with('/')).collect();
    let mut expected = vec![
        "lib/outbox_pg.so".to_string(),
        "licenses/outbox_pg/copyright".to_string(),
        "share/extension/outbox_pg.control".to_string(),
        format!("share/extension/outbox_pg--{VERSION}.sql"),
    ];
    for script in fs::read_dir(format!("{ROOT}/sql")).unwrap() {
        let name = script.unwrap().file_name().into_string().unwrap();
        if name.starts_with("outbox_pg--") && name.ends_with(".sql") {
            expected.push(format!("share/extension/{name}"));
        }
    }
    let mut sorted_files: Vec<String> = files.iter().map(|f| f.to_string()).collect();
    sorted_files.sort();
    expected.sort();
    assert_eq!(sorted_files, expected, "the layer's files");

    // Mounted where CloudNativePG mounts it: /extensions/<name>, read-only for the server.
    let scratch = TempDir::new("img");
    let mount = scratch.path().join("extensions/outbox_pg");
    fs::create_dir_all(&mount).unwrap();
    let mut untar = Command::new("tar");
    untar.arg("-xzf").arg(&layer).arg("-C").arg(&mount);
    run(untar, "tar -xzf of the layer");
    let control = fs::read_to_string(mount.join("share/extension/outbox_pg.control")).unwrap();
    assert!(control.contains(&format!("default_version = '{VERSION}'")), "{control}");
    assert!(control.contains("module_pathname = '$libdir/outbox_pg'"), "{control}");

    // PostgreSQL 18 whose own directories hold no outbox_pg file: only the image can provide it.
    let tree = scratch.path().join("pg18");
    let prefix = pg_config("--bindir").parent().unwrap().to_path_buf();
    copy_without_outbox(&prefix, &tree);
    let install = PgInstall::at(tree.join("bin/pg_config"));
    assert!(install.version().starts_with("PostgreSQL 18."), "{}", install.version());
    assert!(!install.pkglibdir().join("outbox_pg.so").exists());
    assert!(!install.extension_dir().join("outbox_pg.control").exists());

    let redis = Redis::start();
    let pg = Cluster::builder(&install)
        .for_tests()
        .setting(format!("extension_control_path = '$system:{}'", mount.join("share").display()))
        .setting(format!("dynamic_library_path = '$libdir:{}'", mount.join("lib").display()))
        .setting("shared_preload_libraries = 'outbox_pg'")
        .setting(format!("outbox.redis_url = '{}'", redis.url()))
        .start();
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap_or_else(|e| panic!("CREATE EXTENSION: {e}"));
    let version: String =
        client.query_one("SELECT extversion FROM pg_extension WHERE extname = 'outbox_pg'", &[]).unwrap().get(0);
    assert_eq!(version, VERSION);
    let relay = pg.relay_pid(&mut client);
    assert_eq!(
        mapped_file(relay, "outbox_pg.so"),
        Some(mount.join("lib/outbox_pg.so")),
        "the relay runs the image's library"
    );
    let event_id: String = client
        .query_one("SELECT outbox_enqueue('payment', '1', 'payment.created', '{}'::jsonb)::text", &[])
        .unwrap()
        .get(0);
    // This backend called outbox_enqueue, a C function of the image's library: it has it mapped too.
    let backend: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(mapped_file(backend, "outbox_pg.so"), Some(mount.join("lib/outbox_pg.so")));
    let entries: Vec<HashMap<String, String>> = redis.wait_for_entries("outbox:payment", 1);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["event_id"], event_id);
}
