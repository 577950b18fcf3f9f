//! The Debian packages of scripts/package.sh for the PostgreSQL under test (`PG_MAJOR`):
//! - for every major, what the extension package holds and declares (`dpkg-deb -c`, `-f`): the
//!   library, control file, install and upgrade scripts where Debian's and PGDG's `postgresql-NN`
//!   look for them, `Depends: postgresql-NN`;
//! - installed the way an operator installs them (`apt-get install ./<deb>`) when the server under
//!   test is Debian's own `postgresql-NN` (15 here): the extension's files come from the package,
//!   a cluster preloads the library, `CREATE EXTENSION` works and an enqueued event reaches Redis;
//!   the CLI package's `/usr/bin/outbox-consume` then reads that event back. For the other majors
//!   (PyPI builds, scripts/pg-config.sh) no Debian server exists to install into: only the CLI
//!   package is installed, and reads an event the suite's install relayed.
//!
//! Needs root (apt-get). It builds the release packages first, several minutes on 2 cores;
//! `OUTBOX_PACKAGE_REUSE=1` reuses packages of the current versions already in target/debian.
//! dpkg replaces a file by writing a new one and renaming it over the old, so a running server that
//! has the old library loaded is not disturbed. At the end the test removes the packages and puts
//! back the files they replaced, so that the tests after it run on the same install as before
//! (`OUTBOX_PACKAGE_KEEP=1` leaves the packages installed; packages installed before the test stay).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{pg_config, Env};

const CLI_PKG: &str = "outbox-consume";

/// Runs `cmd`, fails the test unless it succeeds, and returns its stdout.
fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Status}", package])
        .output()
        .is_ok_and(|out| out.status.success() && out.stdout == b"installed")
}

/// The regular files a .deb installs, as absolute paths.
fn files_of(deb: &Path) -> Vec<PathBuf> {
    run(Command::new("dpkg-deb").arg("-c").arg(deb), "dpkg-deb -c")
        .lines()
        .filter(|line| line.starts_with('-'))
        .filter_map(|line| line.split_whitespace().last())
        .map(|path| PathBuf::from(path.trim_start_matches('.')))
        .collect()
}

/// Undoes the installation when dropped, also when the test fails: purges the packages the test
/// installed, then puts back the files they had replaced (by rename, as dpkg does).
struct Installation {
    packages: Vec<&'static str>,
    backup_dir: PathBuf,
    replaced: Vec<PathBuf>,
}

impl Installation {
    /// Backs up the files that `debs` would replace, then installs them with apt-get.
    fn install(debs: &[(&'static str, &Path)]) -> Installation {
        let backup_dir = PathBuf::from(format!("/tmp/opg-it/pkg-backup-{}", std::process::id()));
        let _ = fs::remove_dir_all(&backup_dir);
        let mut installation = Installation { packages: Vec::new(), backup_dir, replaced: Vec::new() };
        for (package, deb) in debs {
            if installed(package) || std::env::var_os("OUTBOX_PACKAGE_KEEP").is_some() {
                continue;
            }
            installation.packages.push(package);
            for path in files_of(deb).into_iter().filter(|path| path.exists()) {
                let backup = installation.backup_dir.join(path.strip_prefix("/").unwrap());
                fs::create_dir_all(backup.parent().unwrap()).unwrap();
                fs::copy(&path, &backup).unwrap_or_else(|e| panic!("back up {}: {e}", path.display()));
                installation.replaced.push(path);
            }
        }
        let mut apt = Command::new("apt-get");
        // Waits up to a minute for another apt or dpkg run to release its lock.
        apt.args(["install", "-y", "--reinstall", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=60"])
            .args(debs.iter().map(|(_, deb)| deb))
            .env("DEBIAN_FRONTEND", "noninteractive");
        run(&mut apt, "apt-get install of the packages");
        installation
    }
}

impl Drop for Installation {
    fn drop(&mut self) {
        if self.packages.is_empty() {
            return;
        }
        let purged = Command::new("apt-get")
            .args(["purge", "-y", "-o", "DPkg::Lock::Timeout=60"])
            .args(&self.packages)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output();
        if !purged.is_ok_and(|out| out.status.success()) {
            eprintln!("could not purge {:?}; the replaced files are in {}", self.packages, self.backup_dir.display());
            return;
        }
        for path in &self.replaced {
            let backup = self.backup_dir.join(path.strip_prefix("/").unwrap());
            let temporary = PathBuf::from(format!("{}.opg-restore", path.display()));
            if let Err(e) = fs::copy(&backup, &temporary).and_then(|_| fs::rename(&temporary, path)) {
                eprintln!("could not restore {} from {}: {e}", path.display(), backup.display());
                return;
            }
        }
        let _ = fs::remove_dir_all(&self.backup_dir);
    }
}

#[test]
fn debian_packages_install_and_relay() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "installing Debian packages needs root (CI runs the tests as root)");

    let root = env!("CARGO_MANIFEST_DIR");
    let built = run(
        Command::new("bash").arg(format!("{root}/scripts/package.sh")).current_dir(root),
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
    // Named and laid out like Debian's own extension packages, by the server's major version.
    let major = std::env::var("PG_MAJOR").unwrap_or_else(|_| "15".into());
    let ext_pkg: &'static str = format!("postgresql-{major}-outbox-pg").leak();
    let (ext_deb, cli_deb) = (deb_of(ext_pkg), deb_of(CLI_PKG));
    let libdir = PathBuf::from(format!("/usr/lib/postgresql/{major}/lib"));
    let extension_dir = PathBuf::from(format!("/usr/share/postgresql/{major}/extension"));
    let mut expected = vec![libdir.join("outbox_pg.so"), extension_dir.join("outbox_pg.control")];
    expected.push(extension_dir.join(format!("outbox_pg--{}.sql", env!("CARGO_PKG_VERSION"))));
    for script in fs::read_dir(format!("{root}/sql")).unwrap() {
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
    let control = |field: &str| {
        run(Command::new("dpkg-deb").arg("-f").arg(&ext_deb).arg(field), "dpkg-deb -f").trim().to_string()
    };
    assert_eq!(control("Package"), ext_pkg);
    assert_eq!(control("Version"), env!("CARGO_PKG_VERSION").replacen('-', "~", 1));
    let depends = control("Depends");
    assert!(depends.starts_with(&format!("postgresql-{major}, ")) && depends.contains("libc6"), "Depends: {depends}");

    // Only Debian's own server of this major can take the extension package.
    let debian_server = pg_config("--bindir") == Path::new(&format!("/usr/lib/postgresql/{major}/bin"))
        && installed(&format!("postgresql-{major}"));
    if !debian_server {
        eprintln!("PostgreSQL {major} under test is not Debian's postgresql-{major}: {ext_pkg} checked, not installed");
        let _installation = Installation::install(&[(CLI_PKG, &cli_deb)]);
        let env = Env::start(&[]);
        let mut client = env.pg.connect();
        let event_id: String = client
            .query_one("SELECT outbox_enqueue('payment', '1', 'payment.created', '{}'::jsonb)::text", &[])
            .unwrap()
            .get(0);
        env.redis.wait_for_entries("outbox:payment", 1);
        consume_one(&env, &event_id);
        return;
    }
    let _installation = Installation::install(&[(ext_pkg, &ext_deb), (CLI_PKG, &cli_deb)]);

    // The files the server loads belong to the package, unmodified.
    let owned = run(Command::new("dpkg").args(["-L", ext_pkg]), "dpkg -L");
    let owned: Vec<&Path> = owned.lines().map(Path::new).collect();
    for path in &expected {
        assert!(owned.contains(&path.as_path()), "{ext_pkg} does not install {}:\n{owned:?}", path.display());
    }
    let modified = run(Command::new("dpkg").args(["--verify", ext_pkg, CLI_PKG]), "dpkg --verify");
    assert!(modified.is_empty(), "installed files differ from the packages':\n{modified}");

    // A private cluster preloading the installed library; Env creates the extension.
    let env = Env::start(&[]);
    let mut client = env.pg.connect();
    let version: String =
        client.query_one("SELECT extversion FROM pg_extension WHERE extname = 'outbox_pg'", &[]).unwrap().get(0);
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    let event_id: String = client
        .query_one("SELECT outbox_enqueue('payment', '1', 'payment.created', '{}'::jsonb)::text", &[])
        .unwrap()
        .get(0);
    // The default outbox.stream template is outbox:{aggregate_type}.
    let entries = env.redis.wait_for_entries("outbox:payment", 1);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["event_id"], event_id);
    assert_eq!(entries[0]["aggregate_id"], "1");
    assert_eq!(entries[0]["event_type"], "payment.created");

    consume_one(&env, &event_id);
}

/// The CLI from the package reads the event back. --idle-exit-ms is its deadline.
fn consume_one(env: &Env, event_id: &str) {
    let help = run(Command::new("/usr/bin/outbox-consume").arg("--help"), "outbox-consume --help");
    assert!(help.starts_with("usage: outbox-consume"), "{help}");
    let consumed = run(
        Command::new("/usr/bin/outbox-consume").args([
            "--redis",
            &env.redis.url(),
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
    assert!(consumed.contains(event_id), "outbox-consume printed no event {event_id}:\n{consumed}");
}
