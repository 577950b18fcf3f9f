//! outbox-relay's packaging (outside/packaging/, scripts/package-relay.sh):
//! - the example configuration is one the relay accepts, its database URL asking `verify-full`;
//! - `systemd-analyze verify` accepts the unit (when this machine has systemd-analyze), with its
//!   `ExecStart` pointed at the binary under test, and the unit names the instance's files;
//! - with `OUTBOX_RELAY_PACKAGE=1` (a release build: minutes on 2 cores; `OUTBOX_PACKAGE_REUSE=1`
//!   with `OUTBOX_DEB_DIR` reuses a build), the script's .deb: exactly the expected files, its
//!   control fields (Depends on glibc, libgcc and passwd, no libssl), its maintainer scripts and
//!   conffiles; the unpacked binary runs and needs no OpenSSL, the unpacked unit verifies; the
//!   tarball holds the binary, unit and example.
//!
//! - the postinst, with `useradd` and `getent` replaced by scripts that log their calls, makes the
//!   user once over two runs.
//!
//! Not exercised: installing the .deb (`dpkg -i` would run the postinst's useradd on this
//! machine; `dpkg --root` runs it chrooted into a root with no shell), the postinst's systemctl
//! calls, and the unit under a running systemd (none here): the hardening is checked by
//! `systemd-analyze`, not by a run.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{root, TempDir};
use outbox_relay::config::{self, Command as RelayCommand};
use outbox_relay::tls::{self, SslMode};

const VERSION: &str = env!("CARGO_PKG_VERSION");

fn packaging(file: &str) -> PathBuf {
    root().join("outside/packaging").join(file)
}

/// What `command` printed, standard output then standard error; fails unless it succeeded.
fn output(command: &mut Command, what: &str) -> String {
    let (stdout, stderr) = outputs(command, what);
    stdout + &stderr
}

fn outputs(command: &mut Command, what: &str) -> (String, String) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let [stdout, stderr] = [out.stdout, out.stderr].map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
    assert!(out.status.success(), "{what} failed ({}): {stdout}{stderr}", out.status);
    (stdout, stderr)
}

fn has(program: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {program}")]).output().is_ok_and(|out| out.status.success())
}

#[test]
fn the_example_configuration_is_accepted() {
    let args = vec!["--config".to_string(), packaging("example.conf").display().to_string()];
    let config = match config::parse(&args, &HashMap::new()) {
        Ok(RelayCommand::Run(config)) => config,
        Ok(_) => panic!("--config alone runs the relay"),
        Err(error) => panic!("example.conf: {error}"),
    };
    let (_, settings) = tls::split(&config.database_url, |_| None).unwrap();
    assert_eq!(settings.mode, SslMode::VerifyFull);
    assert!(settings.root_cert.is_some());
}

/// `systemd-analyze verify` of `unit` (the template's text) as instance `test`, its binary being
/// `binary`: what it printed (warnings included).
fn verify_unit(unit: &str, binary: &Path) -> String {
    let dir = TempDir::new("relay-unit");
    let text = unit.replace("/usr/bin/outbox-relay", &binary.display().to_string());
    std::fs::write(dir.path().join("outbox-relay@.service"), text).unwrap();
    let instance = dir.path().join("outbox-relay@test.service");
    output(Command::new("systemd-analyze").arg("verify").arg(&instance), "systemd-analyze verify")
}

#[test]
fn systemd_accepts_the_unit() {
    let unit = std::fs::read_to_string(packaging("outbox-relay@.service")).unwrap();
    for line in [
        "ExecStart=/usr/bin/outbox-relay --config /etc/outbox-relay/%i.conf",
        "EnvironmentFile=-/etc/outbox-relay/%i.env",
        "User=outbox-relay",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit has no line {line:?}");
    }
    if !has("systemd-analyze") {
        eprintln!("systemd-analyze is not installed: the unit's syntax is not checked");
        return;
    }
    let said = verify_unit(&unit, Path::new(env!("CARGO_BIN_EXE_outbox-relay")));
    assert!(said.trim().is_empty(), "systemd-analyze verify: {said}");
}

#[test]
fn the_postinst_makes_the_user_once() {
    // useradd and getent replaced by scripts that log their calls: the real ones would change
    // this machine's /etc/passwd.
    let dir = TempDir::new("relay-postinst");
    let calls = dir.path().join("calls");
    let known = dir.path().join("known");
    let fake = |name: &str, body: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\necho \"{name} $*\" >>'{}'\n{body}\n", calls.display())).unwrap();
        output(Command::new("chmod").arg("755").arg(&path), "chmod");
    };
    fake("useradd", &format!("touch '{}'", known.display()));
    fake("getent", &format!("test -e '{}'", known.display()));
    // On a machine that runs systemd, the postinst would reload it: not from a test.
    fake("systemctl", "true");
    let path = format!("{}:{}", dir.path().display(), std::env::var("PATH").unwrap_or_default());
    for _ in 0..2 {
        output(Command::new("sh").arg(packaging("debian/postinst")).arg("configure").env("PATH", &path), "postinst");
    }
    let log = std::fs::read_to_string(&calls).unwrap();
    let useradds: Vec<&str> = log.lines().filter(|line| line.starts_with("useradd")).collect();
    assert_eq!(useradds.len(), 1, "{log}");
    assert!(useradds[0].contains("--system") && useradds[0].ends_with(" outbox-relay"), "{log}");
    assert_eq!(log.lines().filter(|line| line == &"getent passwd outbox-relay").count(), 2, "{log}");
}

/// The paths of the regular files and symbolic links a .deb installs.
fn files_of(deb: &Path) -> Vec<String> {
    output(Command::new("dpkg-deb").arg("-c").arg(deb), "dpkg-deb -c")
        .lines()
        .filter(|line| !line.starts_with('d'))
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(|path| path.trim_start_matches('.').to_string())
        .collect()
}

#[test]
fn the_debian_package_holds_the_relay_and_its_unit() {
    if std::env::var_os("OUTBOX_RELAY_PACKAGE").is_none_or(|v| v != "1") {
        eprintln!("OUTBOX_RELAY_PACKAGE=1 builds and checks the package (a release build); skipped");
        return;
    }
    let scratch = TempDir::new("relay-package");
    let out_dir = std::env::var_os("OUTBOX_DEB_DIR").map_or_else(|| scratch.path().to_path_buf(), PathBuf::from);
    let mut script = Command::new("bash");
    script.arg(root().join("scripts/package-relay.sh")).arg(&out_dir);
    // What cargo sets for this test, not for a shell: a build script of the release build tracks
    // CARGO_MANIFEST_DIR, and the build made here would be redone by the next one from a shell.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let set_by_cargo = ["CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_"]
            .iter()
            .any(|prefix| name.starts_with(prefix));
        if set_by_cargo || name == "CARGO_TARGET_TMPDIR" {
            script.env_remove(name);
        }
    }
    let (log, _) = outputs(&mut script, "scripts/package-relay.sh");
    let mut last = log.lines().rev();
    let tarball = PathBuf::from(last.next().unwrap());
    let deb = PathBuf::from(last.next().unwrap());
    let arch = output(Command::new("dpkg").arg("--print-architecture"), "dpkg --print-architecture");
    assert_eq!(deb.file_name().unwrap().to_string_lossy(), format!("outbox-relay_{VERSION}_{}.deb", arch.trim()));

    let mut files = files_of(&deb);
    files.sort();
    let doc = "/usr/share/doc/outbox-relay";
    let mut expected = vec![
        "/etc/outbox-relay/example.conf".to_string(),
        "/lib/systemd/system/outbox-relay@.service".to_string(),
        "/usr/bin/outbox-relay".to_string(),
        format!("{doc}/CHANGELOG.md.gz"),
        format!("{doc}/changelog.gz"),
        format!("{doc}/copyright"),
        format!("{doc}/outside-relay.md.gz"),
        format!("{doc}/sql-only.md.gz"),
        "/usr/share/outbox-relay/outbox_pg--pg-tle.sql".to_string(),
        "/usr/share/outbox-relay/outbox_pg.sql".to_string(),
    ];
    expected.sort();
    assert_eq!(files, expected);

    let field = |name: &str| output(Command::new("dpkg-deb").arg("-f").arg(&deb).arg(name), "dpkg-deb -f");
    assert_eq!(field("Package").trim(), "outbox-relay");
    assert_eq!(field("Version").trim(), VERSION.replace('-', "~"));
    let depends = field("Depends");
    assert!(depends.contains("libc6") && depends.contains("passwd"), "{depends}");
    assert!(!depends.contains("libssl"), "{depends}");

    let unpacked = TempDir::new("relay-unpacked");
    let control = unpacked.path().join("DEBIAN");
    output(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control), "dpkg-deb -e");
    output(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(unpacked.path()), "dpkg-deb -x");
    let conffiles = std::fs::read_to_string(control.join("conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/outbox-relay/example.conf");
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("useradd --system") && postinst.contains("outbox-relay"), "{postinst}");
    for script in ["postinst", "prerm", "postrm"] {
        output(Command::new("sh").arg("-n").arg(control.join(script)), &format!("sh -n {script}"));
    }

    let binary = unpacked.path().join("usr/bin/outbox-relay");
    let version = output(Command::new(&binary).arg("--version"), "outbox-relay --version");
    assert_eq!(version.trim(), format!("outbox-relay {VERSION}"));
    let ldd = output(Command::new("ldd").arg(&binary), "ldd");
    assert!(!ldd.contains("libssl") && !ldd.contains("libcrypto"), "{ldd}");
    if has("systemd-analyze") {
        let unit = std::fs::read_to_string(unpacked.path().join("lib/systemd/system/outbox-relay@.service")).unwrap();
        let said = verify_unit(&unit, &binary);
        assert!(said.trim().is_empty(), "systemd-analyze verify: {said}");
    }

    let listing = output(Command::new("tar").arg("-tzf").arg(&tarball), "tar -tzf");
    for file in ["outbox-relay", "outbox-relay@.service", "example.conf", "outbox_pg.sql"] {
        let path = format!("outbox-relay-{VERSION}/{file}");
        assert!(listing.lines().any(|line| line == path), "{path} not in {listing}");
    }
}
