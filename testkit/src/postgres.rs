//! Private PostgreSQL clusters of any installation (known by its `pg_config`), on free loopback
//! ports, run as the `postgres` OS user when root: initdb, settings, start and stop in every mode,
//! kill -9 of a backend, a hot standby and its promotion, an address-space limit; with outbox_pg
//! preloaded when asked. A failed test's cluster prints its log and keeps its directory.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::dirs::TempDir;
use crate::os::{as_server_user, chown_to_server_user, free_port, run};
use crate::wait::{wait_for, DEADLINE};

/// The private PostgreSQL 15 that scripts/install-deps.sh installs (scripts/pg-config.sh 15):
/// under `$PG_PREFIX`, by default /opt/postgresql.
pub fn default_pg_config() -> PathBuf {
    let prefix = std::env::var_os("PG_PREFIX").map_or_else(|| PathBuf::from("/opt/postgresql"), PathBuf::from);
    prefix.join("15/bin/pg_config")
}

/// One PostgreSQL installation: what its `pg_config` answers.
#[derive(Clone, Debug)]
pub struct PgInstall {
    pg_config: PathBuf,
    bindir: PathBuf,
    pkglibdir: PathBuf,
    sharedir: PathBuf,
    version: String,
}

impl PgInstall {
    /// The installation `pg_config` belongs to.
    pub fn at(pg_config: impl Into<PathBuf>) -> PgInstall {
        let pg_config = pg_config.into();
        let ask = |flag: &str| ask(&pg_config, flag);
        PgInstall {
            bindir: PathBuf::from(ask("--bindir")),
            pkglibdir: PathBuf::from(ask("--pkglibdir")),
            sharedir: PathBuf::from(ask("--sharedir")),
            version: ask("--version"),
            pg_config,
        }
    }

    /// The installation under test: `$PG_CONFIG`, else [`default_pg_config`] (scripts/test.sh
    /// sets `PG_CONFIG` for the major it runs).
    pub fn under_test() -> &'static PgInstall {
        static UNDER_TEST: OnceLock<PgInstall> = OnceLock::new();
        UNDER_TEST
            .get_or_init(|| PgInstall::at(std::env::var_os("PG_CONFIG").map_or_else(default_pg_config, PathBuf::from)))
    }

    /// What `pg_config flag` prints, trimmed.
    pub fn ask(&self, flag: &str) -> String {
        ask(&self.pg_config, flag)
    }

    pub fn pg_config(&self) -> &Path {
        &self.pg_config
    }

    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// A program of this installation (`initdb`, `pg_dump`, ...).
    pub fn bin(&self, program: &str) -> PathBuf {
        self.bindir.join(program)
    }

    /// Where the extension's library goes.
    pub fn pkglibdir(&self) -> &Path {
        &self.pkglibdir
    }

    /// Where the extension's control file and scripts go.
    pub fn extension_dir(&self) -> PathBuf {
        self.sharedir.join("extension")
    }

    /// `PostgreSQL 16.15` and the like.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The major version, e.g. 16.
    pub fn major(&self) -> u32 {
        self.version
            .strip_prefix("PostgreSQL ")
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|major| major.parse().ok())
            .unwrap_or_else(|| panic!("no major version in {:?} ({})", self.version, self.pg_config.display()))
    }

    /// A client program of this installation, run as the caller.
    pub fn command(&self, program: &str) -> Command {
        Command::new(self.bin(program))
    }

    /// A server program of this installation, run as the server's OS user.
    pub fn server_command(&self, program: &str) -> Command {
        as_server_user(&self.bin(program))
    }

    /// Fails with a hint unless outbox_pg's library is installed here.
    pub fn require_outbox(&self) {
        assert!(
            self.pkglibdir.join("outbox_pg.so").exists(),
            "outbox_pg is not installed into {}; run scripts/test.sh (it installs it before the tests), or \
             cargo pgrx install --pg-config {}",
            self.pkglibdir.display(),
            self.pg_config.display()
        );
    }
}

fn ask(pg_config: &Path, flag: &str) -> String {
    let mut cmd = Command::new(pg_config);
    cmd.arg(flag);
    run(cmd, &format!("{} {flag}", pg_config.display())).trim().to_string()
}

/// One initdb per installation and test process; test clusters start from a copy of it.
fn template_of(install: &PgInstall) -> PathBuf {
    static TEMPLATES: OnceLock<Mutex<HashMap<PathBuf, PathBuf>>> = OnceLock::new();
    let mut templates = TEMPLATES.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    templates
        .entry(install.pg_config.clone())
        .or_insert_with(|| {
            let mut dir = TempDir::for_server_user("tpl");
            // Shared by every cluster this process starts; the OS cleans /tmp.
            dir.keep();
            let data = dir.path().join("data");
            initdb(install, &data, &[]);
            data
        })
        .clone()
}

fn initdb(install: &PgInstall, data: &Path, extra: &[String]) {
    let mut initdb = install.server_command("initdb");
    initdb
        .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync"])
        .args(extra)
        .arg("-D")
        .arg(data);
    run(initdb, &format!("initdb {}", data.display()));
}

/// Appends `lines` to a cluster's postgresql.conf: later lines win over the defaults above them.
fn append_conf(data: &Path, lines: &str) {
    let path = data.join("postgresql.conf");
    let mut conf = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    conf.push_str(lines);
    fs::write(&path, conf).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    chown_to_server_user(&path);
}

/// How a cluster is made: its installation, settings and directory.
#[must_use = "a builder does nothing until create() or start()"]
pub struct ClusterBuilder {
    install: PgInstall,
    test_defaults: bool,
    settings: Vec<String>,
    initdb_args: Vec<String>,
    dir: Option<PathBuf>,
}

impl ClusterBuilder {
    /// Settings for tests (no fsync, room for 16 workers, INFO in the log) before the others, and
    /// a copy of one initdb per process unless initdb is given arguments.
    pub fn for_tests(mut self) -> Self {
        self.test_defaults = true;
        self
    }

    /// outbox_pg preloaded, its relays publishing to `redis_url`.
    pub fn outbox_relaying_to(mut self, redis_url: &str) -> Self {
        self.install.require_outbox();
        self.settings.push("shared_preload_libraries = 'outbox_pg'".into());
        self.settings.push(format!("outbox.redis_url = '{redis_url}'"));
        self
    }

    /// One postgresql.conf line.
    pub fn setting(mut self, line: impl Into<String>) -> Self {
        self.settings.push(line.into());
        self
    }

    /// postgresql.conf lines, in order.
    pub fn settings<S: AsRef<str>>(mut self, lines: &[S]) -> Self {
        self.settings.extend(lines.iter().map(|line| line.as_ref().to_string()));
        self
    }

    /// More initdb arguments (e.g. `--no-data-checksums`).
    pub fn initdb_args(mut self, args: &[&str]) -> Self {
        self.initdb_args.extend(args.iter().map(|arg| arg.to_string()));
        self
    }

    /// The cluster's directory (data in `data/`, its log, its sockets), kept afterwards, instead
    /// of a temporary one.
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// The cluster, initialized and configured, not started.
    pub fn create(self) -> Cluster {
        let (dir, temp) = match self.dir {
            Some(dir) => {
                let _ = fs::remove_dir_all(&dir);
                fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
                chown_to_server_user(&dir);
                (dir, None)
            }
            None => {
                let temp = TempDir::for_server_user("pg");
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        let data = dir.join("data");
        if self.test_defaults && self.initdb_args.is_empty() {
            let mut copy = as_server_user(Path::new("/bin/cp"));
            copy.arg("-a").arg(template_of(&self.install)).arg(&data);
            run(copy, "copy of the template cluster");
        } else {
            initdb(&self.install, &data, &self.initdb_args);
        }
        let port = free_port();
        let mut conf = format!(
            "\n# outbox-testkit\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n",
            dir.display()
        );
        if self.test_defaults {
            conf.push_str("fsync = off\nmax_worker_processes = 16\nlog_min_messages = info\n");
        }
        for line in &self.settings {
            conf.push_str(line);
            conf.push('\n');
        }
        append_conf(&data, &conf);
        Cluster { dir, data, port, address_space_kb: None, install: self.install, temp, detached: false }
    }

    /// The cluster, started and accepting connections.
    pub fn start(self) -> Cluster {
        let cluster = self.create();
        cluster.pg_ctl_start();
        cluster
    }
}

/// A private PostgreSQL cluster, stopped (`immediate`) when dropped.
pub struct Cluster {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub port: u16,
    /// An address-space limit (`ulimit -v`, kB) every server process starts under, if any.
    pub address_space_kb: Option<u64>,
    install: PgInstall,
    temp: Option<TempDir>,
    detached: bool,
}

impl Cluster {
    /// A cluster of `install`, to be configured.
    pub fn builder(install: &PgInstall) -> ClusterBuilder {
        ClusterBuilder {
            install: install.clone(),
            test_defaults: false,
            settings: Vec::new(),
            initdb_args: Vec::new(),
            dir: None,
        }
    }

    /// A test cluster of the installation under test that preloads outbox_pg and relays every
    /// database with the extension to the Redis on `redis_port` (2 s timeout), with `extra`
    /// settings after those.
    pub fn start(redis_port: u16, extra: &[&str]) -> Cluster {
        Cluster::builder(PgInstall::under_test())
            .for_tests()
            .outbox_relaying_to(&format!("redis://127.0.0.1:{redis_port}"))
            .setting("outbox.redis_timeout = '2s'")
            .settings(extra)
            .start()
    }

    /// A test cluster of the installation under test with exactly these settings (beyond port,
    /// sockets and the test defaults).
    pub fn start_with(settings: &[String]) -> Cluster {
        PgInstall::under_test().require_outbox();
        Cluster::builder(PgInstall::under_test()).for_tests().settings(settings).start()
    }

    /// The installation it runs.
    pub fn install(&self) -> &PgInstall {
        &self.install
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The server log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Starts the server and waits until it accepts connections (pg_ctl gives up after 60 s).
    pub fn pg_ctl_start(&self) {
        let pg_ctl = self.install.bin("pg_ctl");
        let mut cmd = match self.address_space_kb {
            // The limit is inherited by the postmaster and every process it forks.
            Some(kb) => {
                let mut cmd = as_server_user(Path::new("/bin/sh"));
                cmd.arg("-c").arg(format!("ulimit -v {kb} && exec \"$0\" \"$@\"")).arg(&pg_ctl);
                cmd
            }
            None => as_server_user(&pg_ctl),
        };
        cmd.arg("-D").arg(&self.data).arg("-l").arg(self.log_path()).args(["-w", "-t", "60", "start"]);
        cmd.stdout(Stdio::null());
        run(cmd, &format!("pg_ctl start ({})", self.data.display()));
    }

    /// Stops the server (`smart`, `fast` or `immediate`); pg_ctl fails if it does not stop within
    /// 60 s.
    pub fn pg_ctl_stop(&self, mode: &str) {
        if let Err(output) = self.pg_ctl_stop_within(mode, Duration::from_secs(60)) {
            panic!("pg_ctl stop -m {mode} ({}) failed: {output}", self.data.display());
        }
    }

    /// Stops the server, giving pg_ctl `timeout`; `Err` with pg_ctl's output when the server did
    /// not stop in time (it may still be shutting down).
    pub fn pg_ctl_stop_within(&self, mode: &str, timeout: Duration) -> Result<(), String> {
        let mut cmd = self.install.server_command("pg_ctl");
        cmd.arg("-D").arg(&self.data).args(["-w", "-t", &timeout.as_secs().max(1).to_string(), "-m", mode, "stop"]);
        let out = cmd.output().map_err(|e| format!("pg_ctl: {e}"))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            Ok(())
        } else {
            Err(text)
        }
    }

    /// Restarts the server with every process's address space limited to `kb` (`ulimit -v`).
    pub fn restart_with_address_space_limit(&mut self, kb: u64) {
        self.pg_ctl_stop("fast");
        self.address_space_kb = Some(kb);
        self.pg_ctl_start();
    }

    fn conninfo(&self, database: &str, connect_timeout: u32) -> String {
        format!("host=127.0.0.1 port={} user=postgres dbname={database} connect_timeout={connect_timeout}", self.port)
    }

    pub fn connect_to(&self, database: &str) -> postgres::Client {
        postgres::Client::connect(&self.conninfo(database, 10), postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to {database}: {e}\n--- server log ---\n{}", self.log()))
    }

    /// A connection to database `postgres`.
    pub fn connect(&self) -> postgres::Client {
        self.connect_to("postgres")
    }

    /// Connects, retrying while the server restarts (e.g. after a crash).
    pub fn connect_eventually(&self) -> postgres::Client {
        wait_for(DEADLINE, "the server to accept connections", || {
            postgres::Client::connect(&self.conninfo("postgres", 5), postgres::NoTls).ok()
        })
    }

    /// Applies settings with ALTER SYSTEM and reloads.
    pub fn set(&self, client: &mut postgres::Client, settings: &[(&str, &str)]) {
        for (name, value) in settings {
            client
                .batch_execute(&format!("ALTER SYSTEM SET {name} = '{value}'"))
                .unwrap_or_else(|e| panic!("ALTER SYSTEM SET {name} = '{value}': {e}"));
        }
        client.batch_execute("SELECT pg_reload_conf()").unwrap_or_else(|e| panic!("pg_reload_conf(): {e}"));
    }

    /// Pids of this cluster's processes of `backend_type` (e.g. `outbox_pg relay`).
    pub fn backend_pids(&self, client: &mut postgres::Client, backend_type: &str) -> Vec<i32> {
        client
            .query("SELECT pid FROM pg_stat_activity WHERE backend_type = $1 ORDER BY pid", &[&backend_type])
            .unwrap_or_else(|e| panic!("pids of {backend_type} processes: {e}"))
            .into_iter()
            .map(|row| row.get(0))
            .collect()
    }

    /// Waits until the relay of the database `client` is connected to runs and returns its pid.
    pub fn relay_pid(&self, client: &mut postgres::Client) -> i32 {
        wait_for(DEADLINE, "the relay worker to run", || {
            client
                .query_opt(
                    "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay' AND datname = current_database()",
                    &[],
                )
                .ok()
                .flatten()
                .map(|row| row.get::<_, i32>(0))
        })
    }

    /// Sends SIGKILL to process `pid` (a backend or worker of this cluster). The postmaster then
    /// resets the whole cluster: every connection is lost and crash recovery runs.
    pub fn kill_9(&self, pid: i32) {
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is the caller's lookup in
        // pg_stat_activity.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 {pid}: {}", std::io::Error::last_os_error());
    }

    /// A hot standby of this cluster, made with `pg_basebackup -R` (the primary's settings,
    /// `postgresql.auto.conf` included, plus `primary_conninfo` and `standby.signal`), on its own
    /// port and socket directory, started and accepting read-only connections.
    pub fn standby(&self) -> Cluster {
        let temp = TempDir::for_server_user("sb");
        let dir = temp.path().to_path_buf();
        let data = dir.join("data");
        let mut backup = self.install.server_command("pg_basebackup");
        backup.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"]).arg("-D").arg(&data).args([
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        ]);
        run(backup, "pg_basebackup");
        let port = free_port();
        // Appended, so these win over the primary's values in the copied postgresql.conf.
        append_conf(
            &data,
            &format!(
                "\n# outbox-testkit: standby\nport = {port}\nunix_socket_directories = '{}'\nhot_standby = on\n",
                dir.display()
            ),
        );
        let install = self.install.clone();
        let standby = Cluster { dir, data, port, address_space_kb: None, install, temp: Some(temp), detached: false };
        standby.pg_ctl_start();
        standby
    }

    /// Whether the server is (still) in recovery, i.e. a standby.
    pub fn in_recovery(&self, client: &mut postgres::Client) -> bool {
        client
            .query_one("SELECT pg_is_in_recovery()", &[])
            .unwrap_or_else(|e| panic!("pg_is_in_recovery(): {e}"))
            .get(0)
    }

    /// Promotes this standby (`pg_promote`, waiting) and checks that it accepts writes.
    pub fn promote(&self) {
        let mut client = self.connect_eventually();
        let promoted: bool =
            client.query_one("SELECT pg_promote(true, 60)", &[]).unwrap_or_else(|e| panic!("pg_promote: {e}")).get(0);
        assert!(promoted, "pg_promote did not finish within 60 s");
        wait_for(DEADLINE, "the promoted server to leave recovery", || (!self.in_recovery(&mut client)).then_some(()));
    }

    /// Waits until `standby` has replayed all WAL this cluster has flushed so far.
    pub fn wait_replayed_by(&self, standby: &Cluster) {
        let mut primary = self.connect_eventually();
        let target: String = primary
            .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
            .unwrap_or_else(|e| panic!("pg_current_wal_flush_lsn(): {e}"))
            .get(0);
        let mut client = standby.connect_eventually();
        wait_for(DEADLINE, &format!("the standby to replay up to {target}"), || {
            client
                .query_one("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", &[&target])
                .unwrap_or_else(|e| panic!("pg_last_wal_replay_lsn(): {e}"))
                .get::<_, Option<bool>>(0)
                .unwrap_or(false)
                .then_some(())
        });
    }

    /// Leaves the server running, and its directory in place, when the handle goes.
    pub fn detach(mut self) {
        self.detached = true;
        if let Some(temp) = self.temp.as_mut() {
            temp.keep();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        let mut cmd = self.install.server_command("pg_ctl");
        cmd.arg("-D").arg(&self.data).args(["-w", "-t", "30", "-m", "immediate", "stop"]);
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        let _ = cmd.status();
        if std::thread::panicking() {
            if let Some(temp) = self.temp.as_mut() {
                temp.keep();
            }
            eprintln!("--- server log of failed test ({}) ---\n{}", self.dir.display(), self.log());
        }
    }
}

/// Connects to database `postgres` on `port` once, without retrying or panicking.
pub fn try_connect(port: u16) -> Result<postgres::Client, postgres::Error> {
    postgres::Client::connect(
        &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=5"),
        postgres::NoTls,
    )
}
