//! A private `redis-server` on a loopback port, in a directory of its own, that tests can kill,
//! restart on the same port, and pause; plain, password-protected or TLS-only; and the stream
//! reads the tests assert with.

use std::collections::HashMap;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::dirs::TempDir;
use crate::os::free_port;
use crate::tls::{Certificates, ClientTls};
use crate::wait::{wait_for, DEADLINE};

/// The redis-server the tests run: `$REDIS_SERVER` (scripts/test.sh sets it from `REDIS_VERSION`,
/// scripts/install-redis.sh), else the one on PATH.
pub fn redis_server_binary() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_string())
}

/// The redis-server for a server with TLS: `$REDIS_TLS_SERVER`, else [`redis_server_binary`]. The
/// Redis 8.2 binary the matrix uses is built without TLS, so scripts/test.sh keeps TLS on Debian's
/// 7.0 whatever `REDIS_VERSION` says.
fn redis_tls_server_binary() -> String {
    std::env::var("REDIS_TLS_SERVER").unwrap_or_else(|_| redis_server_binary())
}

/// `text` with every byte but ASCII letters and digits percent-encoded, as a URL's password.
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// A client for `url`, over TLS with `tls` when given (rustls's crypto provider installed first,
/// as the extension and the consumer do).
pub fn redis_client(url: &str, tls: Option<&ClientTls>) -> redis::Client {
    let Some(tls) = tls else {
        return redis::Client::open(url).unwrap_or_else(|e| panic!("Redis URL {url}: {e}"));
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |path: &Path| fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let certificates = redis::TlsCertificates {
        client_tls: Some(redis::ClientTlsConfig { client_cert: read(&tls.cert), client_key: read(&tls.key) }),
        root_cert: Some(read(&tls.ca)),
    };
    redis::Client::build_with_tls(url, certificates).unwrap_or_else(|e| panic!("TLS client for {url}: {e}"))
}

/// A stream entry as XRANGE returns it: its id and its field/value pairs.
pub(crate) type Entry = (String, Vec<(String, String)>);

/// How a server is started besides its port, so that a restart starts it the same way.
#[derive(Clone, Debug, Default)]
pub struct RedisOptions {
    /// More redis-server arguments (`--requirepass`, `--appendonly yes`, cluster settings, ...).
    pub args: Vec<String>,
    /// TLS only: the port is the TLS port (the plain one is off), and this is how this crate's own
    /// connections verify the server and authenticate.
    pub tls: Option<ClientTls>,
    /// A cluster node: its cluster-bus port is chosen free as well (the default, port + 10000, may
    /// be taken, or beyond 65535).
    pub cluster_bus: bool,
    /// The server's directory, kept afterwards, instead of a temporary one.
    pub dir: Option<PathBuf>,
    /// Its own process group, so that ^C in the terminal of a script that left it running does
    /// not stop it (`outbox-servers`).
    pub own_process_group: bool,
}

/// A redis-server child process listening on 127.0.0.1, without persistence unless asked,
/// killed on drop.
pub struct Redis {
    pub port: u16,
    /// A cluster node's bus port.
    pub bus_port: Option<u16>,
    dir: PathBuf,
    temp: Option<TempDir>,
    child: Option<Child>,
    options: RedisOptions,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with(&[])
    }

    /// A server started with more arguments.
    pub fn start_with(args: &[&str]) -> Redis {
        Redis::start_options(RedisOptions { args: args.iter().map(|a| a.to_string()).collect(), ..Default::default() })
    }

    /// A TLS-only server presenting `server_cert`, trusting `certs.ca` for client certificates,
    /// which it requires. `probe` is how this crate's own connections verify it and authenticate.
    pub fn start_tls(certs: &Certificates, server_cert: &Path, server_key: &Path, probe: ClientTls) -> Redis {
        let args = tls_server_args(certs, server_cert, server_key);
        Redis::start_options(RedisOptions { args, tls: Some(probe), ..Default::default() })
    }

    /// A server on free ports; when it loses a port to another process before binding it (it
    /// exits at once), it is started again on others.
    pub fn start_options(options: RedisOptions) -> Redis {
        let (dir, temp) = match &options.dir {
            Some(dir) => {
                fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
                (dir.clone(), None)
            }
            None => {
                let temp = TempDir::new("rd");
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        let mut redis = Redis { port: 0, bus_port: None, dir, temp, child: None, options };
        for _ in 0..10 {
            redis.port = free_port();
            redis.bus_port = redis.options.cluster_bus.then(|| loop {
                let bus = free_port();
                if bus != redis.port {
                    break bus;
                }
            });
            if redis.launch() {
                return redis;
            }
            // A cluster node's identity bound to the ports it lost.
            let _ = fs::remove_file(redis.dir.join("nodes.conf"));
        }
        panic!("could not start redis-server on a free port in 10 attempts; its log:\n{}", redis.log());
    }

    /// Spawns the server on its port(s) and waits until it answers PING: `false` if it exited
    /// first (its port was taken).
    fn launch(&mut self) -> bool {
        // A server with a TLS port besides its plain one (tests/redis_tls.rs) needs TLS too.
        let tls = self.options.tls.is_some() || self.options.args.iter().any(|arg| arg == "--tls-port");
        let binary = if tls { redis_tls_server_binary() } else { redis_server_binary() };
        let port = self.port.to_string();
        let mut cmd = Command::new(&binary);
        match self.options.tls {
            None => cmd.args(["--port", &port]),
            Some(_) => cmd.args(["--port", "0", "--tls-port", &port]),
        };
        if let Some(bus) = self.bus_port {
            cmd.args(["--cluster-port", &bus.to_string()]);
        }
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.log_path())
            .args(&self.options.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.options.own_process_group {
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {binary}: {e} (apt-get install redis-server, or set REDIS_SERVER)"));
        self.child = Some(child);
        let up = wait_for(DEADLINE, &format!("redis-server on port {port} to answer PING"), || {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                return Some(false);
            }
            self.try_connection(Duration::from_secs(1))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok())
                .map(|_| true)
        });
        if !up {
            self.child = None;
        }
        up
    }

    /// Starts the server again on its port (killing it first if it runs) and waits until it
    /// answers. Without persistence it comes back empty; with `--appendonly yes` it keeps what it
    /// acknowledged.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.port;
        wait_for(DEADLINE, &format!("redis-server to start again on port {port}"), || self.launch().then_some(()));
    }

    /// Makes the next (re)start a replica of the server on `port` (`--replicaof`), or a master
    /// (`None`), whatever it was started as.
    pub fn replicate(&mut self, port: Option<u16>) {
        let args = &mut self.options.args;
        if let Some(i) = args.iter().position(|a| a == "--replicaof") {
            args.drain(i..(i + 3).min(args.len()));
        }
        if let Some(port) = port {
            args.extend(["--replicaof".to_string(), "127.0.0.1".to_string(), port.to_string()]);
        }
    }

    /// Kills the server (SIGKILL: nothing is handed over or flushed) and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Leaves the server running, and its directory in place, when the handle goes.
    pub fn detach(mut self) {
        // A dropped `Child` is neither killed nor waited for.
        self.child = None;
        if let Some(temp) = self.temp.as_mut() {
            temp.keep();
        }
    }

    /// `redis://127.0.0.1:P`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.options.tls.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// How this crate's own connections verify a TLS server and authenticate (`None`: plain).
    pub fn client_tls(&self) -> Option<&ClientTls> {
        self.options.tls.as_ref()
    }

    fn password(&self) -> Option<&str> {
        let args = &self.options.args;
        args.iter().position(|a| a == "--requirepass").and_then(|i| args.get(i + 1)).map(String::as_str)
    }

    /// The URL this crate's own connections use: the default user, with the server's password.
    fn admin_url(&self) -> String {
        match self.password() {
            Some(pw) => self.url().replacen("://", &format!("://:{}@", percent_encoded(pw)), 1),
            None => self.url(),
        }
    }

    /// A connection as the default user, `None` if the server does not answer within `timeout`
    /// (replies too: a hung server fails a read instead of blocking it).
    pub fn try_connection(&self, timeout: Duration) -> Option<redis::Connection> {
        let connection =
            redis_client(&self.admin_url(), self.client_tls()).get_connection_with_timeout(timeout).ok()?;
        connection.set_read_timeout(Some(timeout.max(Duration::from_secs(2)))).ok()?;
        Some(connection)
    }

    /// A connection as the default user (with the server's password, over TLS for a TLS server).
    pub fn connection(&self) -> redis::Connection {
        redis_client(&self.admin_url(), self.client_tls())
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect to redis-server at {}: {e}", self.url()))
    }

    /// Runs one command on a fresh connection.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query(&mut self.connection()).unwrap_or_else(|e| panic!("redis command {cmd:?} on port {}: {e}", self.port))
    }

    /// One field of `INFO section`, `None` while the server does not answer.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let info: String =
            redis::cmd("INFO").arg(section).query(&mut self.try_connection(Duration::from_secs(2))?).ok()?;
        info.lines().find_map(|line| line.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
    }

    /// Holds every client's writes for `how_long` (`CLIENT PAUSE ... WRITE`): a hung server, or a
    /// partition that drops packets, as far as a writer can tell.
    pub fn pause_writes(&self, how_long: Duration) {
        self.query::<()>(redis::cmd("CLIENT").arg("PAUSE").arg(how_long.as_millis() as u64).arg("WRITE"));
    }

    /// Ends a [`pause_writes`](Redis::pause_writes) early.
    pub fn unpause(&self) {
        self.query::<()>(redis::cmd("CLIENT").arg("UNPAUSE"));
    }

    /// The server's directory (its log, its append-only file, a cluster node's `nodes.conf`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn xlen(&self, stream: &str) -> usize {
        self.query(redis::cmd("XLEN").arg(stream))
    }

    /// Every entry of `stream`, oldest first, as field maps.
    pub fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        let reply: Vec<Entry> = self.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"));
        reply.into_iter().map(|(_, fields)| fields.into_iter().collect()).collect()
    }

    /// Waits until `stream` holds at least `count` entries and returns them.
    pub fn wait_for_entries(&self, stream: &str, count: usize) -> Vec<HashMap<String, String>> {
        wait_for(DEADLINE, &format!("{count} entries in stream {stream}"), || {
            let entries = self.entries(stream);
            (entries.len() >= count).then_some(entries)
        })
    }

    /// Every key holding a stream, sorted.
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
            .unwrap_or_else(|| panic!("no used_memory in INFO memory: {info}"))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// redis-server arguments for TLS with `server_cert`, requiring client certificates of `certs.ca`.
pub(crate) fn tls_server_args(certs: &Certificates, server_cert: &Path, server_key: &Path) -> Vec<String> {
    let [cert, key, ca] = [server_cert, server_key, certs.ca.as_path()].map(|p| p.display().to_string());
    ["--tls-cert-file", &cert, "--tls-key-file", &key, "--tls-ca-cert-file", &ca, "--tls-auth-clients", "yes"]
        .map(String::from)
        .to_vec()
}

/// Every key holding a stream on the server `connection` talks to, sorted.
pub fn stream_keys_on(connection: &mut redis::Connection) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .arg("TYPE")
            .arg("stream")
            .query(connection)
            .unwrap_or_else(|e| panic!("SCAN for streams: {e}"));
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

/// Where a test reads what was published: one server, a Sentinel set's master, or every master
/// of a cluster.
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
