//! The Debian packages of scripts/package.sh for the PostgreSQL major under test (`PG_MAJOR`; .ci/run
//! runs it on 15, 16, 17 and 18), installed by dpkg into a private root, never into the machine's
//! own /usr:
//! - what the extension package holds and declares (`dpkg-deb -c`, `-f`): the library, control
//!   file, install and upgrade scripts where Debian's and PGDG's `postgresql-NN` look for them
//!   (`/usr/lib/postgresql/NN/lib`, `/usr/share/postgresql/NN/extension`), nothing else but its
//!   docs, `Depends: postgresql-NN` and the C libraries;
//! - `dpkg --root=ROOT -i` of both packages, where ROOT's dpkg database holds stand-ins for what
//!   they depend on: `postgresql-NN` at the version of the tree under test, and `libc6`,
//!   `libgcc-s1` (whatever dpkg-shlibdeps named) at the versions this machine has, so that dpkg's
//!   own dependency check passes or fails as on a real system; then `dpkg -L` and `dpkg --verify`;
//! - a PostgreSQL NN laid out in ROOT as Debian's `postgresql-NN` is (server in
//!   `/usr/lib/postgresql/NN/bin` and `lib`, `/usr/share/postgresql/NN`; a copy of the private
//!   tree under test without the suite's outbox_pg files) runs a cluster that preloads the library
//!   the package put there (its relay has `ROOT/usr/lib/postgresql/NN/lib/outbox_pg.so` mapped):
//!   `CREATE EXTENSION` at the package's version, an event reaches Redis, and the CLI package's
//!   `ROOT/usr/bin/outbox-consume` reads it.
//!
//! Not exercised, against a real `apt install` beside PGDG's `postgresql-NN`: apt's resolution
//! against PGDG's repository (dpkg checks the Depends against the stand-ins, which carry the
//! names a PGDG install has); PGDG's build of the server (the tree is PyPI's build of the same
//! major, so the library's ABI match with PGDG's server rests on PostgreSQL's stable ABI within a
//! major and the magic block, which the loader checks); postgresql-common (pg_ctlcluster, its
//! configuration in /etc/postgresql); and the compiled-in paths: the PyPI server finds its
//! share directory beside its bin directory, so ROOT's `/usr/lib/postgresql/NN/share` is a
//! symbolic link to ROOT's `/usr/share/postgresql/NN`, where Debian's server has that path
//! compiled in. The packages have no maintainer scripts, so none runs under dpkg --root either.
//!
//! It builds the release packages first (a release build of the extension for NN and of the CLI:
//! several minutes on 2 cores; `OUTBOX_PACKAGE_REUSE=1` reuses packages of the current versions
//! already in target/debian). Needs root (dpkg --root).

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::trees::{copy_without_outbox, mapped_file, stdout_of};
use common::{pg_config, Cluster, PgInstall, Redis, TempDir};

const CLI_PKG: &str = "outbox-consume";
const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The regular files a .deb installs, as absolute paths.
fn files_of(deb: &Path) -> Vec<PathBuf> {
    stdout_of(Command::new("dpkg-deb").arg("-c").arg(deb), "dpkg-deb -c")
        .lines()
        .filter(|line| line.starts_with('-'))
        .filter_map(|line| line.split_whitespace().last())
        .map(|path| PathBuf::from(path.trim_start_matches('.')))
        .collect()
}

/// A control field of a .deb.
fn field(deb: &Path, name: &str) -> String {
    stdout_of(Command::new("dpkg-deb").arg("-f").arg(deb).arg(name), "dpkg-deb -f").trim().to_string()
}

/// The package names a Depends field lists (versions and alternatives aside).
fn depended_on(depends: &str) -> Vec<String> {
    depends
        .split([',', '|'])
        .filter_map(|item| item.split_whitespace().next())
        .map(|name| name.split(':').next().unwrap_or(name).to_string())
        .collect()
}

/// A private root with an empty dpkg database, in which `stand_ins` (name, version) count as
/// installed: dpkg checks the packages' Depends against them.
fn dpkg_root(root: &Path, stand_ins: &[(String, String)]) {
    let arch = stdout_of(Command::new("dpkg").arg("--print-architecture"), "dpkg --print-architecture");
    let admin = root.join("var/lib/dpkg");
    for dir in ["info", "updates", "triggers"] {
        fs::create_dir_all(admin.join(dir)).unwrap();
    }
    let mut status = String::new();
    for (name, version) in stand_ins {
        status.push_str(&format!(
            "Package: {name}\nStatus: install ok installed\nPriority: optional\nSection: misc\n\
             Maintainer: outbox_pg tests <root@localhost>\nArchitecture: {}\nVersion: {version}\n\
             Description: stand-in for the system's {name} (tests/package.rs)\n\n",
            arch.trim()
        ));
        // An installed package's file list; dpkg warns without one.
        fs::write(admin.join(format!("info/{name}.list")), "").unwrap();
    }
    fs::write(admin.join("status"), status).unwrap();
    fs::write(admin.join("available"), "").unwrap();
}

#[test]
fn debian_packages_install_into_a_private_root_and_relay() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "dpkg --root needs root (CI runs the tests as root)");
    let major = std::env::var("PG_MAJOR").unwrap_or_else(|_| "15".into());
    let tree = PgInstall::under_test();
    assert!(
        tree.version().starts_with(&format!("PostgreSQL {major}.")),
        "PG_MAJOR={major}, PG_CONFIG: {}",
        tree.version()
    );

    let built = stdout_of(
        Command::new("bash").arg(format!("{ROOT}/scripts/package.sh")).current_dir(ROOT).env("PG_MAJOR", &major),
        "bash scripts/package.sh",
    );
    // The script ends with the paths of the packages it built.
    let deb_of = |package: &str| -> PathBuf {
        built
            .lines()
            .map(PathBuf::from)
            .find(|path| {
                path.file_name().and_then(|name| name.to_str()).is_some_and(|name| {
                    name.starts_with(&format!("{package}_")) && name.ends_with(".deb") && path.is_absolute()
                })
            })
            .unwrap_or_else(|| panic!("scripts/package.sh printed no path of package {package}:\n{built}"))
    };
    let ext_pkg = format!("postgresql-{major}-outbox-pg");
    let (ext_deb, cli_deb) = (deb_of(&ext_pkg), deb_of(CLI_PKG));

    // Named, laid out and declared like Debian's and PGDG's extension packages.
    let libdir = PathBuf::from(format!("/usr/lib/postgresql/{major}/lib"));
    let extension_dir = PathBuf::from(format!("/usr/share/postgresql/{major}/extension"));
    let mut expected = vec![libdir.join("outbox_pg.so"), extension_dir.join("outbox_pg.control")];
    expected.push(extension_dir.join(format!("outbox_pg--{VERSION}.sql")));
    for script in fs::read_dir(format!("{ROOT}/sql")).unwrap() {
        let name = script.unwrap().file_name().into_string().unwrap();
        if name.starts_with("outbox_pg--") && name.ends_with(".sql") {
            expected.push(extension_dir.join(name));
        }
    }
    let packed = files_of(&ext_deb);
    for path in &expected {
        assert!(packed.contains(path), "{} does not hold {}:\n{packed:?}", ext_deb.display(), path.display());
    }
    let docs = PathBuf::from(format!("/usr/share/doc/{ext_pkg}"));
    let strays: Vec<&PathBuf> = packed.iter().filter(|p| !expected.contains(p) && !p.starts_with(&docs)).collect();
    assert!(strays.is_empty(), "{} holds files outside the extension's directories: {strays:?}", ext_deb.display());
    assert_eq!(field(&ext_deb, "Package"), ext_pkg);
    let deb_version = VERSION.replacen('-', "~", 1);
    assert_eq!(field(&ext_deb, "Version"), deb_version);
    let ext_depends = field(&ext_deb, "Depends");
    assert!(
        ext_depends.starts_with(&format!("postgresql-{major}, ")) && ext_depends.contains("libc6"),
        "Depends: {ext_depends}"
    );
    assert_eq!(files_of(&cli_deb).iter().filter(|p| !p.starts_with("/usr/share/doc")).count(), 1);
    assert!(files_of(&cli_deb).contains(&PathBuf::from("/usr/bin/outbox-consume")));

    // ROOT: PostgreSQL NN where Debian's postgresql-NN has it, without outbox_pg's files.
    let scratch = TempDir::new("deb");
    let root = scratch.path().join("root");
    let prefix = pg_config("--bindir").parent().unwrap().to_path_buf();
    let server = root.join(format!("usr/lib/postgresql/{major}"));
    let share = root.join(format!("usr/share/postgresql/{major}"));
    copy_without_outbox(&prefix.join("bin"), &server.join("bin"));
    copy_without_outbox(&prefix.join("lib"), &server.join("lib"));
    copy_without_outbox(&prefix.join("share"), &share);
    symlink(format!("../../../share/postgresql/{major}"), server.join("share")).unwrap();

    // dpkg's database of ROOT: stand-ins for what the packages depend on.
    let cli_depends = field(&cli_deb, "Depends");
    let mut stand_ins: Vec<(String, String)> = Vec::new();
    let server_version = tree.version().trim_start_matches("PostgreSQL ").to_string();
    for name in depended_on(&ext_depends).into_iter().chain(depended_on(&cli_depends)) {
        if stand_ins.iter().any(|(known, _)| *known == name) {
            continue;
        }
        let version = if name == format!("postgresql-{major}") {
            format!("{server_version}-0private")
        } else {
            // The machine's own version of that library, which the package was built against.
            stdout_of(Command::new("dpkg-query").args(["-W", "-f=${Version}", &name]), &format!("dpkg-query {name}"))
        };
        stand_ins.push((name, version));
    }
    dpkg_root(&root, &stand_ins);

    // Installed as dpkg installs them.
    let dpkg = || {
        let mut dpkg = Command::new("dpkg");
        dpkg.arg(format!("--root={}", root.display()));
        dpkg
    };
    stdout_of(dpkg().arg("-i").arg(&ext_deb).arg(&cli_deb), "dpkg --root -i of both packages");
    let owned = stdout_of(dpkg().args(["-L", &ext_pkg]), "dpkg -L");
    let owned: Vec<&Path> = owned.lines().map(Path::new).collect();
    for path in &expected {
        assert!(owned.contains(&path.as_path()), "{ext_pkg} does not install {}:\n{owned:?}", path.display());
        assert!(root.join(path.strip_prefix("/").unwrap()).is_file(), "{} is not in ROOT", path.display());
    }
    let modified = stdout_of(dpkg().args(["--verify", &ext_pkg, CLI_PKG]), "dpkg --verify");
    assert!(modified.is_empty(), "installed files differ from the packages':\n{modified}");

    // The server of ROOT finds the package's files where its pg_config says.
    let install = PgInstall::at(server.join("bin/pg_config"));
    assert_eq!(install.pkglibdir(), root.join(libdir.strip_prefix("/").unwrap()));
    assert_eq!(
        fs::canonicalize(install.extension_dir()).unwrap(),
        fs::canonicalize(root.join(extension_dir.strip_prefix("/").unwrap())).unwrap()
    );

    let redis = Redis::start();
    let pg = Cluster::builder(&install)
        .for_tests()
        .outbox_relaying_to(&redis.url())
        .setting("outbox.redis_timeout = '2s'")
        .start();
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap_or_else(|e| panic!("CREATE EXTENSION: {e}"));
    let version: String =
        client.query_one("SELECT extversion FROM pg_extension WHERE extname = 'outbox_pg'", &[]).unwrap().get(0);
    assert_eq!(version, VERSION);
    let relay = pg.relay_pid(&mut client);
    assert_eq!(
        mapped_file(relay, "outbox_pg.so"),
        Some(install.pkglibdir().join("outbox_pg.so")),
        "the relay runs the packaged library"
    );
    let event_id: String = client
        .query_one("SELECT outbox_enqueue('payment', '1', 'payment.created', '{}'::jsonb)::text", &[])
        .unwrap()
        .get(0);
    // The default outbox.stream template is outbox:{aggregate_type}.
    let entries = redis.wait_for_entries("outbox:payment", 1);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["event_id"], event_id);
    assert_eq!(entries[0]["event_type"], "payment.created");

    // The CLI from its package reads the event back; --idle-exit-ms is its deadline.
    let consume = root.join("usr/bin/outbox-consume");
    let help = stdout_of(Command::new(&consume).arg("--help"), "outbox-consume --help");
    assert!(help.starts_with("usage: outbox-consume"), "{help}");
    let consumed = stdout_of(
        Command::new(&consume).args([
            "--redis",
            &redis.url(),
            "--stream",
            "outbox:payment",
            "--group",
            "package-test",
            "--max-events",
            "1",
            "--block-ms",
            "100",
            "--idle-exit-ms",
            &Duration::from_secs(30).as_millis().to_string(),
        ]),
        "outbox-consume",
    );
    assert!(consumed.contains(&event_id), "outbox-consume printed no event {event_id}:\n{consumed}");
}
