//! PostgreSQL trees for the packaging tests (tests/package.rs, tests/image.rs): a copy of the
//! installation under test laid out where a package or an image volume puts it, without the
//! outbox_pg files the suite installed there, so that the server can load only the copy under
//! test; and which library file a running server process has mapped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_testkit::run;

/// Copies directory `from` to `to` (created with its parents) with `cp -a`, then removes every
/// `outbox_pg*` file from it: the suite's own test build lives in the installation under test.
pub fn copy_without_outbox(from: &Path, to: &Path) {
    fs::create_dir_all(to.parent().unwrap_or(Path::new("/")))
        .unwrap_or_else(|e| panic!("create the parent of {}: {e}", to.display()));
    let mut copy = Command::new("cp");
    copy.arg("-a").arg(from).arg(to);
    run(copy, &format!("cp -a {} {}", from.display(), to.display()));
    for path in super::extension_files(to) {
        fs::remove_file(&path).unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
    }
}

/// The file `pid` has mapped whose name is `file_name` (from /proc/PID/maps; readable as root or
/// as the process's user), if any.
pub fn mapped_file(pid: i32, file_name: &str) -> Option<PathBuf> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_else(|e| panic!("read /proc/{pid}/maps: {e}"));
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|path| path.file_name().is_some_and(|name| name == file_name))
}

/// Runs `cmd`, fails the test unless it succeeds, and returns its stdout alone (cargo, run by the
/// packaging scripts, writes its progress to stderr).
pub fn stdout_of(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The last line of a script's stdout: the packaging scripts end with the path of what they built.
pub fn last_line(stdout: &str) -> PathBuf {
    PathBuf::from(stdout.lines().last().unwrap_or_default().trim())
}
