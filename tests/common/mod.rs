//! Test harness: a private PostgreSQL cluster with outbox_pg preloaded and a private
//! `redis-server`, each on a free loopback port, that tests can stop, kill and restart.
//! PostgreSQL refuses to run as root, so when the tests run as root the server runs as `postgres`.
#![allow(dead_code)]

pub mod topologies;

use std::collections::HashMap;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `probe` until it returns `Some`, failing the test with `what` after `timeout`.
pub fn wait_for<T>(timeout: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// `text` with every byte but ASCII letters and digits percent-encoded, as a URL's password.
pub fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A directory of the installed PostgreSQL (`--bindir`, `--pkglibdir`, `--sharedir`), from
/// $PG_CONFIG or PostgreSQL 15's pg_config.
pub fn pg_config(flag: &str) -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    let out = Command::new(&pg_config).arg(flag).output().expect("pg_config");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn pg_bindir() -> PathBuf {
    pg_config("--bindir")
}

/// A PostgreSQL client program (pg_dump, pg_restore, psql) of the installed server's version.
pub fn pg_command(program: &str) -> Command {
    Command::new(pg_bindir().join(program))
}

fn pg_libdir() -> PathBuf {
    pg_config("--pkglibdir")
}

/// A command run as the server's OS user.
fn as_server_user(program: &Path) -> Command {
    if running_as_root() {
        let mut cmd = Command::new("runuser");
        cmd.arg("-u").arg("postgres").arg("--").arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

pub fn run(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed: {text}");
    text
}

fn chown_to_server_user(path: &Path) {
    if running_as_root() {
        run(
            {
                let mut c = Command::new("chown");
                c.arg("-R").arg("postgres:postgres").arg(path);
                c
            },
            "chown",
        );
    }
}

fn scratch_root() -> PathBuf {
    let root = PathBuf::from("/tmp/opg-it");
    fs::create_dir_all(&root).unwrap();
    // The server user must be able to enter it.
    run(
        {
            let mut c = Command::new("chmod");
            c.arg("755").arg(&root);
            c
        },
        "chmod",
    );
    root
}

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = scratch_root().join(format!("{tag}{}-{}", std::process::id(), NEXT_DIR.fetch_add(1, Ordering::SeqCst)));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    chown_to_server_user(&dir);
    dir
}

/// One initdb per test process; every cluster starts from a copy of it.
fn template_cluster() -> &'static PathBuf {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        assert!(
            pg_libdir().join("outbox_pg.so").exists(),
            "outbox_pg is not installed into {}; run scripts/test.sh (it installs it before these tests)",
            pg_libdir().display()
        );
        let dir = fresh_dir("tpl");
        let data = dir.join("data");
        let mut initdb = as_server_user(&pg_bindir().join("initdb"));
        initdb.args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync", "-D"]).arg(&data);
        run(initdb, "initdb");
        data
    })
}

/// A private PostgreSQL cluster.
pub struct Cluster {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub port: u16,
}

impl Cluster {
    /// A cluster that preloads outbox_pg and relays every database with the extension to `redis_port`.
    pub fn start(redis_port: u16, extra: &[&str]) -> Cluster {
        let mut conf = vec![
            "shared_preload_libraries = 'outbox_pg'".to_string(),
            format!("outbox.redis_url = 'redis://127.0.0.1:{redis_port}'"),
            "outbox.redis_timeout = '2s'".to_string(),
        ];
        conf.extend(extra.iter().map(|s| s.to_string()));
        Cluster::start_with(&conf)
    }

    /// A cluster with exactly these settings (beyond port and sockets).
    pub fn start_with(settings: &[String]) -> Cluster {
        let dir = fresh_dir("pg");
        let data = dir.join("data");
        let mut copy = as_server_user(Path::new("/bin/cp"));
        copy.arg("-a").arg(template_cluster()).arg(&data);
        run(copy, "copy template cluster");
        let port = free_port();
        let mut conf = format!(
            "\n# outbox_pg tests\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\nmax_worker_processes = 16\nlog_min_messages = info\n",
            dir.display()
        );
        for s in settings {
            conf.push_str(s);
            conf.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = fs::read_to_string(&conf_path).unwrap();
        existing.push_str(&conf);
        fs::write(&conf_path, existing).unwrap();
        chown_to_server_user(&conf_path);
        let cluster = Cluster { dir, data, port };
        cluster.pg_ctl_start();
        cluster
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The server log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pg_ctl_start(&self) {
        let mut cmd = as_server_user(&pg_bindir().join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).arg("-l").arg(self.log_path()).args(["-w", "-t", "60", "start"]);
        cmd.stdout(Stdio::null());
        run(cmd, "pg_ctl start");
    }

    /// Stops the server (`fast` or `immediate`); pg_ctl fails if it does not stop within 60 s.
    pub fn pg_ctl_stop(&self, mode: &str) {
        let mut cmd = as_server_user(&pg_bindir().join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).args(["-w", "-t", "60", "-m", mode, "stop"]);
        run(cmd, "pg_ctl stop");
    }

    pub fn connect_to(&self, database: &str) -> postgres::Client {
        postgres::Client::connect(
            &format!("host=127.0.0.1 port={} user=postgres dbname={database} connect_timeout=10", self.port),
            postgres::NoTls,
        )
        .unwrap_or_else(|e| panic!("connect to {database}: {e}\n--- server log ---\n{}", self.log()))
    }

    pub fn connect(&self) -> postgres::Client {
        self.connect_to("postgres")
    }

    /// Connects, retrying while the server restarts (e.g. after a crash).
    pub fn connect_eventually(&self) -> postgres::Client {
        wait_for(DEADLINE, "the server to accept connections", || {
            postgres::Client::connect(
                &format!("host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=5", self.port),
                postgres::NoTls,
            )
            .ok()
        })
    }

    /// Applies settings with ALTER SYSTEM and reloads.
    pub fn set(&self, client: &mut postgres::Client, settings: &[(&str, &str)]) {
        for (name, value) in settings {
            client.batch_execute(&format!("ALTER SYSTEM SET {name} = '{value}'")).unwrap();
        }
        client.batch_execute("SELECT pg_reload_conf()").unwrap();
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
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut cmd = as_server_user(&pg_bindir().join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).args(["-w", "-t", "30", "-m", "immediate", "stop"]);
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        let _ = cmd.status();
        if !std::thread::panicking() {
            let _ = fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("--- server log of failed test ({}) ---\n{}", self.dir.display(), self.log());
        }
    }
}

/// A private redis-server on a loopback port, killable and restartable on the same port.
pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Redis {
        let dir = fresh_dir("rd");
        let mut redis =
            Redis { port: free_port(), dir, child: None, extra: extra.iter().map(|s| s.to_string()).collect() };
        redis.restart();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "redis-server is already running");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("redis-server (apt-get install redis-server)"));
        let port = self.port;
        let password = self.password();
        wait_for(DEADLINE, "redis-server to answer PING", || {
            let url = match &password {
                Some(pw) => format!("redis://:{}@127.0.0.1:{port}", percent_encoded(pw)),
                None => format!("redis://127.0.0.1:{port}"),
            };
            let mut con = redis::Client::open(url).ok()?.get_connection_with_timeout(Duration::from_secs(1)).ok()?;
            redis::cmd("PING").query::<String>(&mut con).ok()
        });
    }

    fn password(&self) -> Option<String> {
        self.extra.iter().position(|a| a == "--requirepass").map(|i| self.extra[i + 1].clone())
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server (SIGKILL) and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn connection(&self) -> redis::Connection {
        let url = match self.password() {
            Some(pw) => format!("redis://:{}@127.0.0.1:{}", percent_encoded(&pw), self.port),
            None => self.url(),
        };
        redis::Client::open(url).unwrap().get_connection_with_timeout(Duration::from_secs(5)).unwrap()
    }

    pub fn xlen(&self, stream: &str) -> usize {
        redis::cmd("XLEN").arg(stream).query(&mut self.connection()).unwrap()
    }

    /// Every entry of `stream`, oldest first, as field maps.
    pub fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        let reply: Vec<(String, Vec<(String, String)>)> =
            redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(&mut self.connection()).unwrap();
        reply.into_iter().map(|(_, fields)| fields.into_iter().collect()).collect()
    }

    /// Waits until `stream` holds at least `count` entries and returns them.
    pub fn wait_for_entries(&self, stream: &str, count: usize) -> Vec<HashMap<String, String>> {
        wait_for(DEADLINE, &format!("{count} entries in stream {stream}"), || {
            let entries = self.entries(stream);
            (entries.len() >= count).then_some(entries)
        })
    }
}

/// Every key holding a stream on the server `connection` talks to, sorted.
pub fn stream_keys_on(connection: &mut redis::Connection) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) =
            redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(1000).arg("TYPE").arg("stream").query(connection).unwrap();
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    keys
}

/// Where the invariant checker reads the streams: one node, or a Sentinel set's master, or every
/// master of a cluster.
pub trait StreamStore {
    /// Every key holding a stream, sorted.
    fn stream_keys(&self) -> Vec<String>;
    /// Every entry of `stream`, oldest first, as field maps.
    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>>;
}

impl StreamStore for Redis {
    fn stream_keys(&self) -> Vec<String> {
        Redis::stream_keys(self)
    }

    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        Redis::entries(self, stream)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A test environment: Redis first (the cluster's relay points at it), then PostgreSQL with the
/// extension created in database `postgres`.
pub struct Env {
    pub redis: Redis,
    pub pg: Cluster,
}

impl Env {
    pub fn start(extra: &[&str]) -> Env {
        let redis = Redis::start();
        let pg = Cluster::start(redis.port, extra);
        pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
        Env { redis, pg }
    }
}

/// Enqueues an event with an empty payload, to `stream` or the template's; returns its event_id.
pub fn enqueue_to(
    client: &mut postgres::Client,
    aggregate_type: &str,
    aggregate_id: &str,
    stream: Option<&str>,
) -> String {
    client
        .query_one(
            "SELECT outbox_enqueue($1, $2, 'test.event', '{}'::jsonb, NULL, $3)::text",
            &[&aggregate_type, &aggregate_id, &stream],
        )
        .unwrap()
        .get(0)
}

/// The status outbox.messages gives an event.
pub fn status_of(client: &mut postgres::Client, event_id: &str) -> String {
    client.query_one("SELECT status FROM outbox.messages WHERE event_id = $1::text::uuid", &[&event_id]).unwrap().get(0)
}

/// Counts rows of outbox.messages by status.
pub fn status_counts(client: &mut postgres::Client) -> HashMap<String, i64> {
    client
        .query("SELECT status, count(*) FROM outbox.messages GROUP BY status", &[])
        .unwrap()
        .into_iter()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)))
        .collect()
}

// -------------------------------------------------------------------------------------------------
// Fault injection (tests/faults.rs): standbys, killing the relay, producers that record the fate of
// every transaction, and the invariant checker that compares that record with PostgreSQL and Redis.
// -------------------------------------------------------------------------------------------------

/// Connects to database `postgres` on `port` once, without retrying or panicking.
pub fn try_connect(port: u16) -> Result<postgres::Client, postgres::Error> {
    postgres::Client::connect(
        &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=5"),
        postgres::NoTls,
    )
}

impl Cluster {
    /// Pids of this cluster's processes of `backend_type` (e.g. `outbox_pg relay`).
    pub fn backend_pids(&self, client: &mut postgres::Client, backend_type: &str) -> Vec<i32> {
        client
            .query("SELECT pid FROM pg_stat_activity WHERE backend_type = $1 ORDER BY pid", &[&backend_type])
            .unwrap()
            .into_iter()
            .map(|row| row.get(0))
            .collect()
    }

    /// Sends SIGKILL to process `pid` (a backend or worker of this cluster). The postmaster then
    /// resets the whole cluster: every connection is lost and crash recovery runs.
    pub fn kill_9(&self, pid: i32) {
        // SAFETY: kill(2) with a pid this test looked up in pg_stat_activity.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 {pid}: {}", std::io::Error::last_os_error());
    }

    /// A hot standby of this cluster, made with `pg_basebackup -R` (the primary's settings,
    /// `postgresql.auto.conf` included, plus `primary_conninfo` and `standby.signal`), on its own
    /// port and socket directory, started and accepting read-only connections.
    pub fn standby(&self) -> Cluster {
        let dir = fresh_dir("sb");
        let data = dir.join("data");
        let mut backup = as_server_user(&pg_bindir().join("pg_basebackup"));
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
        let conf_path = data.join("postgresql.conf");
        let mut conf = fs::read_to_string(&conf_path).unwrap();
        conf.push_str(&format!(
            "\n# outbox_pg tests: standby\nport = {port}\nunix_socket_directories = '{}'\nhot_standby = on\n",
            dir.display()
        ));
        fs::write(&conf_path, conf).unwrap();
        chown_to_server_user(&conf_path);
        let standby = Cluster { dir, data, port };
        standby.pg_ctl_start();
        standby
    }

    /// Stops the server (`smart`, `fast` or `immediate`), giving pg_ctl `timeout`; `Err` with
    /// pg_ctl's output when the server did not stop in time (it may still be shutting down).
    pub fn pg_ctl_stop_within(&self, mode: &str, timeout: Duration) -> Result<(), String> {
        let mut cmd = as_server_user(&pg_bindir().join("pg_ctl"));
        cmd.arg("-D").arg(&self.data).args(["-w", "-t", &timeout.as_secs().max(1).to_string(), "-m", mode, "stop"]);
        let out = cmd.output().map_err(|e| format!("pg_ctl: {e}"))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            Ok(())
        } else {
            Err(text)
        }
    }

    /// Whether the server is (still) in recovery, i.e. a standby.
    pub fn in_recovery(&self, client: &mut postgres::Client) -> bool {
        client.query_one("SELECT pg_is_in_recovery()", &[]).unwrap().get(0)
    }

    /// Promotes this standby (`pg_promote`, waiting) and checks that it accepts writes.
    pub fn promote(&self) {
        let mut client = self.connect_eventually();
        let promoted: bool = client.query_one("SELECT pg_promote(true, 60)", &[]).unwrap().get(0);
        assert!(promoted, "pg_promote did not finish within 60 s");
        wait_for(DEADLINE, "the promoted server to leave recovery", || (!self.in_recovery(&mut client)).then_some(()));
    }

    /// Waits until `standby` has replayed all WAL this cluster has flushed so far.
    pub fn wait_replayed_by(&self, standby: &Cluster) {
        let mut primary = self.connect_eventually();
        let target: String = primary.query_one("SELECT pg_current_wal_flush_lsn()::text", &[]).unwrap().get(0);
        let mut client = standby.connect_eventually();
        wait_for(DEADLINE, &format!("the standby to replay up to {target}"), || {
            client
                .query_one("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", &[&target])
                .unwrap()
                .get::<_, Option<bool>>(0)
                .unwrap_or(false)
                .then_some(())
        });
    }
}

impl Redis {
    /// Runs one command on a fresh connection.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query(&mut self.connection()).unwrap_or_else(|e| panic!("redis command failed: {e}"))
    }

    /// Every key holding a stream.
    pub fn stream_keys(&self) -> Vec<String> {
        stream_keys_on(&mut self.connection())
    }

    /// Entries in all streams together.
    pub fn total_entries(&self) -> usize {
        self.stream_keys().iter().map(|key| self.xlen(key)).sum()
    }

    /// `INFO memory`'s `used_memory`, in bytes.
    pub fn used_memory(&self) -> u64 {
        let info: String = self.query(redis::cmd("INFO").arg("memory"));
        info.lines()
            .find_map(|line| line.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory in INFO memory")
    }
}

impl Env {
    /// Like `start`, with extra redis-server arguments (e.g. `--appendonly yes`, so that a killed
    /// Redis keeps what it acknowledged).
    pub fn start_with_redis(redis_args: &[&str], extra: &[&str]) -> Env {
        let redis = Redis::start_with(redis_args);
        let pg = Cluster::start(redis.port, extra);
        pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
        Env { redis, pg }
    }
}

/// A small deterministic PRNG (xorshift64*), so that workloads need no extra crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// One event as its producer knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEvent {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
}

/// What producers know about their transactions, one `Vec` of events per transaction:
/// committed (COMMIT answered), rolled back (ROLLBACK, or an error before COMMIT was sent) and
/// ambiguous (the connection broke while COMMIT was in flight: the outcome is unknown until the
/// events are looked up in outbox.messages).
#[derive(Default, Debug)]
pub struct Ledger {
    pub committed: Vec<Vec<LedgerEvent>>,
    pub rolled_back: Vec<Vec<LedgerEvent>>,
    pub ambiguous: Vec<Vec<LedgerEvent>>,
}

pub type SharedLedger = Arc<Mutex<Ledger>>;

pub const ENQUEUE: &str = "SELECT outbox_enqueue($1, $2, $3, $4::text::jsonb, NULL, $5)::text";

/// Enqueues one event in its own transaction and records it as committed.
pub fn enqueue_recorded(
    client: &mut postgres::Client,
    ledger: &SharedLedger,
    aggregate_type: &str,
    aggregate_id: &str,
    stream: Option<&str>,
) -> String {
    let event_id: String =
        client.query_one(ENQUEUE, &[&aggregate_type, &aggregate_id, &"scenario.event", &"{}", &stream]).unwrap().get(0);
    ledger.lock().unwrap().committed.push(vec![LedgerEvent {
        event_id: event_id.clone(),
        aggregate_type: aggregate_type.to_string(),
        aggregate_id: aggregate_id.to_string(),
    }]);
    event_id
}

/// What producer threads do: short transactions of 1..=`max_events_per_txn` events over a small
/// set of aggregates shared by all producers (so they contend on the aggregates' sequence rows),
/// some rolled back on purpose. Bounded by `max_txns` per producer and by `max_time`.
#[derive(Clone, Debug)]
pub struct Workload {
    pub producers: usize,
    pub aggregate_types: Vec<&'static str>,
    pub aggregates_per_type: u64,
    pub max_events_per_txn: u64,
    pub rollback_percent: u64,
    pub max_txns: usize,
    pub max_time: Duration,
    /// Sleep between two transactions of one producer.
    pub pause: Duration,
    /// Padding added to each payload.
    pub payload_padding: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            producers: 3,
            aggregate_types: vec!["order", "payment"],
            aggregates_per_type: 6,
            max_events_per_txn: 3,
            rollback_percent: 15,
            max_txns: 1_000,
            max_time: Duration::from_secs(90),
            pause: Duration::from_millis(5),
            payload_padding: 32,
        }
    }
}

/// Producer threads writing `Workload` transactions to the cluster on `port` until stopped,
/// reconnecting whenever their connection breaks (server crash, restart), and recording every
/// transaction's fate in the ledger.
pub struct Producers {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicUsize>,
    reconnects: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

/// How one producer transaction ended.
enum TxnOutcome {
    Committed(Vec<LedgerEvent>),
    RolledBack(Vec<LedgerEvent>),
    Ambiguous(Vec<LedgerEvent>),
}

impl Producers {
    pub fn start(port: u16, workload: Workload, ledger: SharedLedger) -> Producers {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicUsize::new(0));
        let reconnects = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(workload.producers));
        let handles = (0..workload.producers)
            .map(|p| {
                let (stop, committed, reconnects, running, ledger, workload) = (
                    stop.clone(),
                    committed.clone(),
                    reconnects.clone(),
                    running.clone(),
                    ledger.clone(),
                    workload.clone(),
                );
                std::thread::spawn(move || {
                    produce(p, port, &workload, &ledger, &stop, &committed, &reconnects);
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        Producers { stop, committed, reconnects, running, handles }
    }

    /// Transactions committed so far, by all producers.
    pub fn committed(&self) -> usize {
        self.committed.load(Ordering::SeqCst)
    }

    /// Times a producer had to connect again after losing its connection.
    pub fn reconnects(&self) -> usize {
        self.reconnects.load(Ordering::SeqCst)
    }

    /// Waits until the producers have committed `more` transactions beyond what they had now.
    pub fn wait_for_commits(&self, more: usize) {
        let target = self.committed() + more;
        wait_for(DEADLINE, &format!("producers to commit {target} transactions"), || {
            assert!(
                self.running.load(Ordering::SeqCst) > 0 || self.committed() >= target,
                "the producers stopped (limits reached) at {} committed transactions, before {target}",
                self.committed()
            );
            (self.committed() >= target).then_some(())
        });
    }

    /// Stops the producers and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for handle in self.handles {
            handle.join().expect("producer thread panicked");
        }
    }
}

fn produce(
    producer: usize,
    port: u16,
    workload: &Workload,
    ledger: &SharedLedger,
    stop: &AtomicBool,
    committed: &AtomicUsize,
    reconnects: &AtomicUsize,
) {
    let started = Instant::now();
    let mut rng = Rng::new(0x5EED ^ ((producer as u64) << 17) ^ u64::from(port));
    let mut client: Option<postgres::Client> = None;
    let mut connected_once = false;
    let padding = "x".repeat(workload.payload_padding);
    let mut txns = 0;
    while !stop.load(Ordering::SeqCst) && txns < workload.max_txns && started.elapsed() < workload.max_time {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            match try_connect(port) {
                Ok(c) => {
                    if connected_once {
                        reconnects.fetch_add(1, Ordering::SeqCst);
                    }
                    connected_once = true;
                    client = Some(c);
                }
                Err(_) => {
                    // The server is restarting (crash recovery, immediate stop): try again soon.
                    client = None;
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
        }
        let Some(c) = client.as_mut() else { continue };
        let events = 1 + rng.below(workload.max_events_per_txn);
        let mut aggregates: Vec<(&str, String)> = (0..events)
            .map(|_| {
                let t = workload.aggregate_types[rng.below(workload.aggregate_types.len() as u64) as usize];
                (t, rng.below(workload.aggregates_per_type).to_string())
            })
            .collect();
        // One lock order for the aggregates' sequence rows: producers wait for each other, never deadlock.
        aggregates.sort();
        let roll_back = rng.below(100) < workload.rollback_percent;
        let payload = format!("{{\"producer\": {producer}, \"txn\": {txns}, \"pad\": \"{padding}\"}}");
        let outcome = run_transaction(c, &aggregates, &payload, roll_back);
        let mut ledger = ledger.lock().unwrap();
        match outcome {
            TxnOutcome::Committed(events) => {
                ledger.committed.push(events);
                committed.fetch_add(1, Ordering::SeqCst);
            }
            TxnOutcome::RolledBack(events) => ledger.rolled_back.push(events),
            TxnOutcome::Ambiguous(events) => ledger.ambiguous.push(events),
        }
        drop(ledger);
        txns += 1;
        if !workload.pause.is_zero() {
            std::thread::sleep(workload.pause);
        }
    }
}

fn run_transaction(
    client: &mut postgres::Client,
    aggregates: &[(&str, String)],
    payload: &str,
    roll_back: bool,
) -> TxnOutcome {
    let mut events = Vec::new();
    let mut tx = match client.transaction() {
        Ok(tx) => tx,
        Err(_) => return TxnOutcome::RolledBack(events),
    };
    for (aggregate_type, aggregate_id) in aggregates {
        let no_stream: Option<&str> = None;
        match tx.query_one(ENQUEUE, &[aggregate_type, aggregate_id, &"test.event", &payload, &no_stream]) {
            Ok(row) => events.push(LedgerEvent {
                event_id: row.get(0),
                aggregate_type: aggregate_type.to_string(),
                aggregate_id: aggregate_id.clone(),
            }),
            // COMMIT was never sent: whatever this transaction wrote is gone.
            Err(_) => return TxnOutcome::RolledBack(events),
        }
    }
    if roll_back {
        // Even if the connection breaks here, COMMIT was never sent.
        let _ = tx.rollback();
        return TxnOutcome::RolledBack(events);
    }
    match tx.commit() {
        Ok(()) => TxnOutcome::Committed(events),
        // The server may have committed before the connection broke (or before it reported a
        // crash of another process): only outbox.messages can tell.
        Err(_) => TxnOutcome::Ambiguous(events),
    }
}

/// Waits until the outbox has nothing pending or in flight.
/// Waits until the relays have failed at least `rounds` more times (each failed round records its
/// error with a new `outbox.stats.last_error_at`) and returns the latest error. Nothing is written
/// per event when Redis fails as a whole, so this is how a test sees retries.
pub fn wait_for_failed_rounds(client: &mut postgres::Client, rounds: usize, what: &str) -> String {
    let mut seen: Vec<std::time::SystemTime> = Vec::new();
    let mut latest = String::new();
    wait_for(DEADLINE, what, || {
        let row = client.query_one("SELECT last_error, last_error_at FROM outbox.stats", &[]).unwrap();
        if let (Some(error), Some(at)) =
            (row.get::<_, Option<String>>(0), row.get::<_, Option<std::time::SystemTime>>(1))
        {
            if seen.last() != Some(&at) {
                seen.push(at);
                latest = error;
            }
        }
        (seen.len() > rounds).then(|| latest.clone())
    })
}

pub fn wait_drained(client: &mut postgres::Client) {
    wait_for(DEADLINE, "outbox.stats to show nothing pending or publishing", || {
        let row = client.query_one("SELECT pending, publishing FROM outbox.stats", &[]).unwrap();
        (row.get::<_, i64>(0) == 0 && row.get::<_, i64>(1) == 0).then_some(())
    });
}

/// What a scenario permits.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expect {
    /// At-least-once duplicates (same event_id, same fields) may appear: the scenario crashes a
    /// process or loses a connection between an XADD and its settlement.
    pub duplicates: bool,
}

/// What the checker found.
#[derive(Debug, Default)]
pub struct Report {
    pub committed_txns: usize,
    pub committed_events: usize,
    pub rolled_back_events: usize,
    pub ambiguous_committed: usize,
    pub ambiguous_rolled_back: usize,
    pub delivered: usize,
    pub duplicates: usize,
    pub entries: usize,
    pub aggregates: usize,
}

/// The invariant checker. Resolves ambiguous transactions by looking their events up, waits until
/// the outbox has drained, then asserts against outbox.messages and every stream in Redis:
/// - outbox.messages holds exactly the committed events (none rolled back, none unknown), all
///   `published`;
/// - every committed event is in its stream (zero loss), no rolled-back or unknown event is in any
///   stream, and every entry carries exactly the row's fields (duplicates included), and a
///   duplicate the same `aggregate_seq` as the first occurrence;
/// - duplicates only when `expect.duplicates`;
/// - per aggregate, the first occurrences of its events carry `aggregate_seq` 1, 2, ... n in stream
///   order (the relay assigns it; the database keeps no per-event copy), and come in id order,
///   which within an aggregate is commit order.
///
/// Assumes the default `outbox.stream` template (`outbox:{aggregate_type}`).
pub fn check_invariants(
    scenario: &str,
    pg: &Cluster,
    redis: &dyn StreamStore,
    ledger: &SharedLedger,
    expect: Expect,
) -> Report {
    let mut client = pg.connect_eventually();
    let mut ledger = ledger.lock().unwrap();
    let mut report = Report::default();

    // Ambiguous commits: all of a transaction's events are in outbox.messages, or none.
    for events in std::mem::take(&mut ledger.ambiguous) {
        let ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
        let found: i64 = client
            .query_one("SELECT count(*) FROM outbox.messages WHERE event_id::text = ANY ($1)", &[&ids])
            .unwrap()
            .get(0);
        if found == ids.len() as i64 {
            report.ambiguous_committed += 1;
            ledger.committed.push(events);
        } else {
            assert_eq!(found, 0, "[{scenario}] a transaction was partly committed: {found} of {ids:?}");
            report.ambiguous_rolled_back += 1;
            ledger.rolled_back.push(events);
        }
    }
    let committed: HashMap<String, LedgerEvent> =
        ledger.committed.iter().flatten().map(|e| (e.event_id.clone(), e.clone())).collect();
    let rolled_back: std::collections::HashSet<String> =
        ledger.rolled_back.iter().flatten().map(|e| e.event_id.clone()).collect();
    report.committed_txns = ledger.committed.len();
    report.committed_events = committed.len();
    report.rolled_back_events = rolled_back.len();
    drop(ledger);

    wait_drained(&mut client);

    // The rows, with the fields their stream entries must carry.
    let rows = client
        .query(
            "SELECT id::text, event_id::text, aggregate_type, aggregate_id, id, event_type, payload::text,
                    headers::text, coalesce(stream, 'outbox:' || aggregate_type), status,
                    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
               FROM outbox.messages",
            &[],
        )
        .unwrap();
    let mut expected: HashMap<String, (String, HashMap<String, String>)> = HashMap::new();
    let mut aggregates: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
    for row in rows {
        let event_id: String = row.get(1);
        let (aggregate_type, aggregate_id, id): (String, String, i64) = (row.get(2), row.get(3), row.get(4));
        let status: String = row.get(9);
        assert!(!rolled_back.contains(&event_id), "[{scenario}] rolled-back event {event_id} is in outbox.messages");
        let known = committed.get(&event_id);
        assert!(known.is_some(), "[{scenario}] outbox.messages holds event {event_id}, which nobody committed");
        let known = known.unwrap();
        assert_eq!(
            (&known.aggregate_type, &known.aggregate_id),
            (&aggregate_type, &aggregate_id),
            "[{scenario}] event {event_id} has another aggregate than enqueued"
        );
        assert_eq!(status, "published", "[{scenario}] event {event_id} ({aggregate_type}/{aggregate_id}, id {id})");
        let mut fields: HashMap<String, String> = [
            ("event_id", event_id.clone()),
            ("outbox_id", row.get(0)),
            ("aggregate_type", aggregate_type.clone()),
            ("aggregate_id", aggregate_id.clone()),
            ("event_type", row.get(5)),
            ("payload", row.get(6)),
            ("created_at", row.get(10)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(headers) = row.get::<_, Option<String>>(7) {
            fields.insert("headers".into(), headers);
        }
        aggregates.insert((aggregate_type, aggregate_id));
        expected.insert(event_id, (row.get(8), fields));
    }
    for id in committed.keys() {
        assert!(expected.contains_key(id), "[{scenario}] committed event {id} is missing from outbox.messages");
    }
    report.aggregates = aggregates.len();

    // Every stream in Redis.
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    let mut seq_of: HashMap<String, String> = HashMap::new();
    let mut last_seq: HashMap<(String, String, String), (i64, i64)> = HashMap::new();
    for stream in redis.stream_keys() {
        for (position, mut entry) in redis.entries(&stream).into_iter().enumerate() {
            report.entries += 1;
            let event_id = entry.get("event_id").cloned().unwrap_or_default();
            assert!(!rolled_back.contains(&event_id), "[{scenario}] rolled-back event {event_id} reached {stream}");
            let Some((want_stream, fields)) = expected.get(&event_id) else {
                panic!("[{scenario}] stream {stream} holds an unknown event: {entry:?}");
            };
            assert_eq!(&stream, want_stream, "[{scenario}] event {event_id} went to the wrong stream");
            let seq_field = entry.remove("aggregate_seq").unwrap_or_default();
            assert_eq!(&entry, fields, "[{scenario}] entry {position} of {stream} differs from its row");
            if first_seen.insert(event_id.clone(), position).is_some() {
                report.duplicates += 1;
                assert!(expect.duplicates, "[{scenario}] event {event_id} delivered twice to {stream}");
                assert_eq!(
                    seq_of.get(&event_id),
                    Some(&seq_field),
                    "[{scenario}] event {event_id} was published again with another aggregate_seq"
                );
                continue;
            }
            seq_of.insert(event_id.clone(), seq_field.clone());
            let key = (stream.clone(), fields["aggregate_type"].clone(), fields["aggregate_id"].clone());
            let seq: i64 = seq_field.parse().unwrap();
            let id: i64 = fields["outbox_id"].parse().unwrap();
            let (previous, previous_id) = last_seq.insert(key.clone(), (seq, id)).unwrap_or((0, 0));
            assert_eq!(
                seq,
                previous + 1,
                "[{scenario}] {}/{} in {stream}: first occurrence of aggregate_seq {seq} (event {event_id}, \
                 entry {position}) follows aggregate_seq {previous}",
                key.1,
                key.2
            );
            assert!(
                id > previous_id,
                "[{scenario}] {}/{} in {stream}: event id {id} came after id {previous_id} (not commit order)",
                key.1,
                key.2
            );
        }
    }
    report.delivered = first_seen.len();
    let missing: Vec<&String> = committed.keys().filter(|id| !first_seen.contains_key(*id)).collect();
    assert!(missing.is_empty(), "[{scenario}] {} committed events never reached Redis: {missing:?}", missing.len());
    eprintln!(
        "[{scenario}] committed {} transactions / {} events over {} aggregates; rolled back {} events; \
         ambiguous commits: {} committed, {} rolled back; delivered {} distinct events in {} entries ({} duplicates)",
        report.committed_txns,
        report.committed_events,
        report.aggregates,
        report.rolled_back_events,
        report.ambiguous_committed,
        report.ambiguous_rolled_back,
        report.delivered,
        report.entries,
        report.duplicates
    );
    report
}
