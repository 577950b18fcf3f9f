//! What the servers need from the operating system: free loopback ports, the `postgres` OS user
//! when running as root, and commands run to completion with their output in the failure message.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::thread;
use std::time::{Duration, Instant};

/// A loopback port the kernel had free a moment ago. Another process may take it before the
/// server binds it: callers that can, start again on another (see `Redis`).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind an ephemeral port: {e}"));
    listener.local_addr().unwrap_or_else(|e| panic!("the ephemeral port's address: {e}")).port()
}

/// Whether this process runs as root, where PostgreSQL refuses to run.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `program` run as PostgreSQL's OS user `postgres` when this process is root, else as itself.
pub fn as_server_user(program: &Path) -> Command {
    if running_as_root() {
        let mut cmd = Command::new("runuser");
        cmd.arg("-u").arg("postgres").arg("--").arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// Gives `path` (recursively) to the `postgres` OS user when root, so that a server running as
/// that user can write it; without root the caller already owns it.
pub fn chown_to_server_user(path: &Path) {
    if running_as_root() {
        let mut chown = Command::new("chown");
        chown.arg("-R").arg("postgres:postgres").arg(path);
        run(chown, &format!("chown -R postgres {}", path.display()));
    }
}

/// Runs `cmd` to completion and returns its stdout and stderr together; fails with `what` and that
/// output unless it succeeded.
pub fn run(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}): {text}", out.status);
    text
}

/// Waits for `child` to exit and collects what it wrote to its piped stdout and stderr; kills it
/// and fails with `what` and its stderr when it is still running after `timeout`. The pipes are
/// drained while it runs, so a child that writes a lot cannot block on a full pipe.
pub fn output_within(mut child: Child, timeout: Duration, what: &str) -> Output {
    fn drain(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    }
    let collect = |handle: Option<thread::JoinHandle<Vec<u8>>>| handle.and_then(|h| h.join().ok()).unwrap_or_default();
    let stdout = child.stdout.take().map(drain);
    let stderr = child.stderr.take().map(drain);
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let stderr = collect(stderr);
                panic!("{what} did not finish within {timeout:?}; stderr: {}", String::from_utf8_lossy(&stderr));
            }
            Ok(None) => thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{what}: waiting for the process failed: {e}"),
        }
    };
    Output { status, stdout: collect(stdout), stderr: collect(stderr) }
}
