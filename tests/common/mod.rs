//! Test harness: a private PostgreSQL cluster with outbox_pg preloaded and a private
//! `redis-server`, each on a free loopback port, that tests can stop, kill and restart.
//! PostgreSQL refuses to run as root, so when the tests run as root the server runs as `postgres`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
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

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn pg_bindir() -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    let out = Command::new(&pg_config).arg("--bindir").output().expect("pg_config");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn pg_libdir() -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    let out = Command::new(&pg_config).arg("--pkglibdir").output().expect("pg_config");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
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

fn run(mut cmd: Command, what: &str) -> String {
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
    /// A cluster that preloads outbox_pg, relays to `redis_port` and watches database `postgres`.
    pub fn start(redis_port: u16, extra: &[&str]) -> Cluster {
        let mut conf = vec![
            "shared_preload_libraries = 'outbox_pg'".to_string(),
            "outbox.database = 'postgres'".to_string(),
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

    /// Waits until the relay process is running and returns its pid.
    pub fn relay_pid(&self, client: &mut postgres::Client) -> i32 {
        wait_for(DEADLINE, "the relay worker to run", || {
            client
                .query_opt("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])
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
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("redis-server (apt-get install redis-server)"));
        let port = self.port;
        let password = self.password();
        wait_for(DEADLINE, "redis-server to answer PING", || {
            let url = match &password {
                Some(pw) => format!("redis://:{pw}@127.0.0.1:{port}"),
                None => format!("redis://127.0.0.1:{port}"),
            };
            let mut con = redis::Client::open(url).ok()?.get_connection_with_timeout(Duration::from_secs(1)).ok()?;
            redis::cmd("PING").query::<String>(&mut con).ok()
        });
    }

    fn password(&self) -> Option<String> {
        self.extra.iter().position(|a| a == "--requirepass").map(|i| self.extra[i + 1].clone())
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
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
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

/// Counts rows of outbox.messages by status.
pub fn status_counts(client: &mut postgres::Client) -> HashMap<String, i64> {
    client
        .query("SELECT status, count(*) FROM outbox.messages GROUP BY status", &[])
        .unwrap()
        .into_iter()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)))
        .collect()
}
