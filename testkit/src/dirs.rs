//! Directories for servers and their files, under one short root: a PostgreSQL data directory's
//! parent is also its socket directory, and a Unix socket path must stay under 108 bytes.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::os::chown_to_server_user;

/// `/tmp/opg-it`, created on first use and open to every user (the `postgres` OS user must be
/// able to enter it when the tests run as root).
pub fn scratch_root() -> PathBuf {
    let root = PathBuf::from("/tmp/opg-it");
    fs::create_dir_all(&root).unwrap_or_else(|e| panic!("create {}: {e}", root.display()));
    // Only the first creator owns it; another user's root already is 0755 or wider.
    let _ = fs::set_permissions(&root, fs::Permissions::from_mode(0o755));
    root
}

/// A fresh, empty directory under [`scratch_root`], removed with its contents on drop unless
/// kept. Named after a label, the process and a counter, so that parallel tests and parallel
/// suites never share one.
pub struct TempDir {
    path: PathBuf,
    remove: bool,
}

impl TempDir {
    /// A directory owned by this process's user.
    pub fn new(label: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path =
            scratch_root().join(format!("{label}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst)));
        // A leftover of an earlier process with the same pid.
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        TempDir { path, remove: true }
    }

    /// A directory owned by PostgreSQL's OS user (when root), for a cluster's data and sockets.
    pub fn for_server_user(label: &str) -> TempDir {
        let dir = TempDir::new(label);
        chown_to_server_user(&dir.path);
        dir
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Leaves the directory in place when dropped (a failed test's logs, servers left running).
    pub fn keep(&mut self) {
        self.remove = false;
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}
