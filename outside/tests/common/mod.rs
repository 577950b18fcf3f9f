//! What outbox-relay's integration tests share: a private PostgreSQL without the library (the
//! testkit's), a database with the SQL-only install made by its owner, a role with CREATEROLE and
//! no superuser (docs/sql-only.md, "No superuser needed"), and connections as any role.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

// Each test binary names a few of them.
#[allow(unused_imports)]
pub use outbox_testkit::{run, wait_for, Cluster, PgInstall, TempDir, DEADLINE};

pub const OWNER: &str = "app_owner";
pub const DATABASE: &str = "app";

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("outside/ is in the repository").to_path_buf()
}

/// The installation under test: `$PG_CONFIG`, else testkit's default, else Debian's PostgreSQL 15.
pub fn install() -> &'static PgInstall {
    static INSTALL: OnceLock<PgInstall> = OnceLock::new();
    INSTALL.get_or_init(|| {
        let pg_config = std::env::var_os("PG_CONFIG").map(PathBuf::from).unwrap_or_else(|| {
            let default = outbox_testkit::default_pg_config();
            if default.exists() {
                default
            } else {
                PathBuf::from("/usr/lib/postgresql/15/bin/pg_config")
            }
        });
        PgInstall::at(pg_config)
    })
}

/// A started server that preloads nothing.
pub fn server() -> Cluster {
    let pg = Cluster::builder(install()).for_tests().start();
    let preloaded: String = pg.connect().query_one("SHOW shared_preload_libraries", &[]).unwrap().get(0);
    assert!(!preloaded.contains("outbox_pg"), "{preloaded}");
    pg
}

/// A URL for `user` to `database` on `pg`.
pub fn url(pg: &Cluster, user: &str, database: &str) -> String {
    format!("postgresql://{user}@127.0.0.1:{}/{database}", pg.port)
}

pub fn connect_as(pg: &Cluster, database: &str, user: &str) -> postgres::Client {
    postgres::Client::connect(&format!("{}?connect_timeout=10", url(pg, user, database)), postgres::NoTls)
        .unwrap_or_else(|e| panic!("connect as {user} to {database}: {e}"))
}

/// Database `DATABASE` owned by `OWNER`, a role with CREATEROLE only; no schema yet.
pub fn owned_database(pg: &Cluster) {
    let mut admin = pg.connect();
    admin.batch_execute(&format!("CREATE ROLE {OWNER} LOGIN CREATEROLE")).unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {DATABASE} OWNER {OWNER}")).unwrap();
}

/// Runs `bash scripts/sql-only.sh`'s output in `DATABASE` as `OWNER` with psql, as the docs say.
pub fn install_sql_only(pg: &Cluster) {
    let files = TempDir::new("relay-sqlonly");
    let script = files.path().join("outbox_pg.sql");
    let out = Command::new("bash").arg(root().join("scripts/sql-only.sh")).output().expect("bash runs sql-only.sh");
    assert!(out.status.success(), "scripts/sql-only.sh: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(&script, out.stdout).unwrap();
    let mut psql = install().command("psql");
    psql.args(["-X", "-q", "-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", OWNER, "-d", DATABASE, "-f"])
        .arg(&script);
    let output = run(psql, "psql -f outbox_pg.sql");
    assert!(!output.contains("ERROR"), "{output}");
}

/// A server with `DATABASE` and the SQL-only install made there by `OWNER`.
pub fn sql_only_server() -> Cluster {
    let pg = server();
    owned_database(&pg);
    install_sql_only(&pg);
    pg
}

/// The relay, its standard error collected line by line.
pub struct RelayProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The thread reading standard error; joined once the process exited, so that its last lines
    /// are in `lines`.
    reader: Option<std::thread::JoinHandle<()>>,
}

impl RelayProcess {
    pub fn start(args: &[&str]) -> RelayProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OUTBOX_") {
                command.env_remove(name);
            }
        }
        let mut child =
            command.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("outbox-relay starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        RelayProcess { child, lines, reader: Some(reader) }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits for a line containing `text`.
    pub fn wait_for_line(&self, text: &str) -> String {
        wait_for(DEADLINE, &format!("a line with {text:?}"), || {
            self.lines().into_iter().find(|line| line.contains(text))
        })
    }

    /// Kills it with SIGKILL (a crash: nothing of the round in flight is finished).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: kill(2) on the child this test started, which has not been waited for.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill -TERM: {}", std::io::Error::last_os_error());
        let status = wait_for(DEADLINE, "outbox-relay to exit after SIGTERM", || self.child.try_wait().unwrap());
        // Its standard error is closed: the reader ends once it has read the last line.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        status
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- outbox-relay's stderr ---\n{}", self.lines().join("\n"));
        }
    }
}
