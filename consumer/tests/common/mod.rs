//! Shared test support: private redis-server processes per test (plain, TLS, or a six-node Redis
//! Cluster), certificates made with the `openssl` CLI, and small Redis helpers.
//!
//! Every wait is a poll against a deadline (never a fixed sleep), and no test asserts on how long
//! anything took. Ports are taken from the kernel's free ones; a server that loses the race for
//! its port exits at once and is started again on another.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::collections::HashSet;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_consumer::{ConsumerConfig, RedisMode};
use redis::{ConnectionLike, Value};

/// How long any wait in the tests may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Forming a cluster or failing over takes longer than anything on a single server.
pub const CLUSTER_DEADLINE: Duration = Duration::from_secs(60);

fn redis_server_binary() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_string())
}

fn redis_cli_binary() -> String {
    std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".to_string())
}

/// A directory under the system's temp dir, removed (with its contents) on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh, empty directory whose name includes `label`, the pid and a counter.
    pub fn new(label: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("outbox-consumer-{label}-{}-{n}-{nanos}", std::process::id()));
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Sets a file's Unix permission bits.
pub fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Writes a secret file (password) readable by its owner only.
pub fn write_secret(path: &Path, contents: &str) {
    fs::write(path, contents).expect("write secret file");
    chmod(path, 0o600);
}

/// Certificates for TLS tests, made at test time: a CA with a server certificate (SAN
/// IP:127.0.0.1, DNS:localhost) and a client certificate, and a second, unrelated CA with a
/// server certificate of its own (for "signed by another CA"). Keys are owner-only files.
pub struct TlsFiles {
    dir: TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub other_ca: PathBuf,
    pub other_server_cert: PathBuf,
    pub other_server_key: PathBuf,
}

/// What the test's own client presents to a TLS server: the CA to verify it with, and the client
/// certificate and key.
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Makes every certificate and key with the `openssl` CLI, in a temp dir of their own.
    pub fn generate() -> TlsFiles {
        let dir = TempDir::new("tls");
        let base = dir.path().to_path_buf();
        let p = |name: &str| base.join(name);
        let files = TlsFiles {
            ca: p("ca.crt"),
            server_cert: p("server.crt"),
            server_key: p("server.key"),
            client_cert: p("client.crt"),
            client_key: p("client.key"),
            other_ca: p("other-ca.crt"),
            other_server_cert: p("other-server.crt"),
            other_server_key: p("other-server.key"),
            dir,
        };
        let server_ext = p("server.ext");
        // clientAuth too: with tls-replication / tls-cluster a server presents it as a client.
        fs::write(
            &server_ext,
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("write server.ext");
        let client_ext = p("client.ext");
        fs::write(
            &client_ext,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
        )
        .expect("write client.ext");

        make_ca(&files.ca, &p("ca.key"), "outbox-consumer test CA");
        make_ca(&files.other_ca, &p("other-ca.key"), "some other CA");
        sign(&files.server_cert, &files.server_key, "localhost", &files.ca, &p("ca.key"), &server_ext, 2);
        sign(&files.client_cert, &files.client_key, "outbox-consumer", &files.ca, &p("ca.key"), &client_ext, 3);
        sign(
            &files.other_server_cert,
            &files.other_server_key,
            "localhost",
            &files.other_ca,
            &p("other-ca.key"),
            &server_ext,
            4,
        );
        for key in [&files.server_key, &files.client_key, &files.other_server_key] {
            chmod(key, 0o600);
        }
        files
    }

    /// The directory holding the files (and a few non-PEM helper files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Our CA and client certificate: what a well-configured client uses.
    pub fn client(&self) -> ClientTls {
        ClientTls { ca: self.ca.clone(), cert: self.client_cert.clone(), key: self.client_key.clone() }
    }
}

fn openssl(args: &[&str]) {
    let output = Command::new("openssl").args(args).stdin(Stdio::null()).output().expect("run openssl");
    assert!(output.status.success(), "openssl {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
}

fn make_ca(cert: &Path, key: &Path, name: &str) {
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key.display().to_string(),
        "-out",
        &cert.display().to_string(),
        "-days",
        "2",
        "-subj",
        &format!("/CN={name}"),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
}

fn sign(cert: &Path, key: &Path, name: &str, ca: &Path, ca_key: &Path, ext: &Path, serial: u32) {
    let csr = cert.with_extension("csr");
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key.display().to_string(),
        "-out",
        &csr.display().to_string(),
        "-subj",
        &format!("/CN={name}"),
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr.display().to_string(),
        "-CA",
        &ca.display().to_string(),
        "-CAkey",
        &ca_key.display().to_string(),
        "-set_serial",
        &serial.to_string(),
        "-days",
        "2",
        "-out",
        &cert.display().to_string(),
        "-extfile",
        &ext.display().to_string(),
    ]);
}

/// A client for `url`, over TLS with `tls` when given (the crypto provider is installed first, as
/// the library does).
pub fn client(url: &str, tls: Option<&ClientTls>) -> redis::Client {
    match tls {
        None => redis::Client::open(url).expect("valid url"),
        Some(tls) => {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let certificates = redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: fs::read(&tls.cert).expect("read client cert"),
                    client_key: fs::read(&tls.key).expect("read client key"),
                }),
                root_cert: Some(fs::read(&tls.ca).expect("read CA")),
            };
            redis::Client::build_with_tls(url, certificates).expect("TLS client")
        }
    }
}

/// How a server is started (besides its port), so that it can be restarted the same way.
#[derive(Clone, Debug, Default)]
struct Launch {
    /// Extra redis-server arguments.
    args: Vec<String>,
    /// `Some`: the port is the TLS port (the plain one is disabled) and this is how the tests'
    /// own connections authenticate.
    tls: Option<ClientTls>,
}

/// A redis-server child process listening on 127.0.0.1 on a free port, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    launch: Launch,
}

impl RedisServer {
    /// Starts a plain server on a free port; retries with another port if it loses a race for one.
    pub fn start() -> RedisServer {
        Self::start_launch(Launch::default())
    }

    /// Starts a TLS-only server (`--port 0 --tls-port P`) with the given certificate and key,
    /// trusting our CA for client certificates, which it requires (`--tls-auth-clients yes`).
    /// `probe` is how the test's own client verifies it and authenticates.
    pub fn start_tls(files: &TlsFiles, server_cert: &Path, server_key: &Path, probe: ClientTls) -> RedisServer {
        let args = [
            "--tls-cert-file",
            &server_cert.display().to_string(),
            "--tls-key-file",
            &server_key.display().to_string(),
            "--tls-ca-cert-file",
            &files.ca.display().to_string(),
            "--tls-auth-clients",
            "yes",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Self::start_launch(Launch { args, tls: Some(probe) })
    }

    fn start_launch(launch: Launch) -> RedisServer {
        for _ in 0..10 {
            if let Some(server) = Self::start_on(free_port(), launch.clone()) {
                return server;
            }
        }
        panic!("could not start redis-server on a free port after 10 attempts");
    }

    /// Starts a server on `port`; `None` if it exited (port taken) before answering PING.
    fn start_on(port: u16, launch: Launch) -> Option<RedisServer> {
        let binary = redis_server_binary();
        let port_text = port.to_string();
        let mut args: Vec<&str> = match launch.tls {
            None => vec!["--port", &port_text],
            Some(_) => vec!["--port", "0", "--tls-port", &port_text],
        };
        args.extend(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        args.extend(launch.args.iter().map(String::as_str));
        let child = Command::new(&binary)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {binary}: {e} (set REDIS_SERVER to its path)"));
        let mut server = RedisServer { child, port, launch };
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Ok(Some(_)) = server.child.try_wait() {
                return None;
            }
            if server.ping() {
                return Some(server);
            }
            assert!(Instant::now() < deadline, "redis-server on port {port} did not answer PING in time");
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn ping(&self) -> bool {
        let client = client(&self.url(), self.launch.tls.as_ref());
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else { return false };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    /// Kills the server and starts a fresh, empty one on the same port (a restart without
    /// persistence: streams and groups are gone).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(server) = Self::start_on(self.port, self.launch.clone()) {
                *self = server;
                return;
            }
            assert!(Instant::now() < deadline, "could not restart redis-server on port {}", self.port);
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `redis://127.0.0.1:P/`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.launch.tls.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// An administrative connection (default user; over TLS with our client certificate).
    pub fn conn(&self) -> redis::Connection {
        client(&self.url(), self.launch.tls.as_ref())
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect to test redis")
    }

    /// A config with test-friendly timings: short blocking reads so loops notice conditions
    /// quickly, and a reclaim scan on every poll.
    pub fn config(&self, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
        let mut config = ConsumerConfig::new(self.url(), stream, group);
        test_timings(&mut config, consumer);
        config
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn test_timings(config: &mut ConsumerConfig, consumer: &str) {
    config.consumer_name = consumer.to_string();
    config.block_timeout = Duration::from_millis(50);
    config.claim_interval = Duration::ZERO;
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// One redis-server of a [`RedisCluster`], in a directory of its own.
struct ClusterNode {
    child: Option<Child>,
    port: u16,
}

impl ClusterNode {
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // std's kill is SIGKILL on Unix: no chance to hand over or flush anything.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis Cluster of three masters with one replica each (six redis-server processes on free
/// loopback ports), formed with `redis-cli --cluster create` and waited for until every node
/// agrees that the cluster is up. Optionally TLS-only (clients, cluster bus and replication),
/// with client certificates required. Killed on drop.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    dir: TempDir,
    /// `Some`: TLS-only nodes, and how the tests' own connections authenticate.
    tls: Option<ClientTls>,
    /// Certificate arguments of every node (TLS only).
    tls_args: Vec<String>,
}

/// One line of CLUSTER NODES.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub flags: Vec<String>,
    /// The master's ID for a replica, `-` for a master.
    pub master: String,
    /// Slot ranges served, for a master.
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    /// Flagged master (failed ones included).
    pub fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    /// Flagged as failed, suspected, or not yet joined.
    pub fn is_failing(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?" || f == "handshake" || f == "noaddr")
    }
}

impl RedisCluster {
    /// A plain-TCP cluster.
    pub fn start() -> RedisCluster {
        Self::start_with(None, Vec::new())
    }

    /// A TLS-only cluster: every node serves TLS on its port, speaks TLS on the cluster bus and
    /// for replication, presents our server certificate and requires a client certificate of our
    /// CA.
    pub fn start_tls(files: &TlsFiles) -> RedisCluster {
        let args = [
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-cert-file",
            &files.server_cert.display().to_string(),
            "--tls-key-file",
            &files.server_key.display().to_string(),
            "--tls-ca-cert-file",
            &files.ca.display().to_string(),
            "--tls-auth-clients",
            "yes",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Self::start_with(Some(files.client()), args)
    }

    fn start_with(tls: Option<ClientTls>, tls_args: Vec<String>) -> RedisCluster {
        let dir = TempDir::new("cluster");
        let mut cluster = RedisCluster { nodes: Vec::new(), dir, tls, tls_args };
        let mut used = HashSet::new();
        for index in 0..6 {
            let node = cluster.start_node(index, &mut used);
            cluster.nodes.push(node);
        }
        let mut create = Command::new(redis_cli_binary());
        if let Some(tls) = &cluster.tls {
            create.arg("--tls").arg("--cacert").arg(&tls.ca).arg("--cert").arg(&tls.cert).arg("--key").arg(&tls.key);
        }
        create.args(["--cluster", "create"]);
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let output = run_with_deadline(create, CLUSTER_DEADLINE);
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_until_healthy();
        cluster
    }

    /// Starts node `index` on a free port and a free cluster-bus port (both from the kernel, and
    /// distinct from the other nodes'); another pair if it loses the race for one.
    fn start_node(&self, index: usize, used: &mut HashSet<u16>) -> ClusterNode {
        let dir = self.dir.path().join(format!("node-{index}"));
        fs::create_dir_all(&dir).expect("node dir");
        for _ in 0..10 {
            let (port, bus) = (free_port(), free_port());
            if port == bus || used.contains(&port) || used.contains(&bus) {
                continue;
            }
            let d = dir.display().to_string();
            let port_text = port.to_string();
            let port_args: Vec<&str> = match self.tls {
                None => vec!["--port", &port_text],
                Some(_) => vec!["--port", "0", "--tls-port", &port_text],
            };
            let child = Command::new(redis_server_binary())
                .args(&port_args)
                .args(["--cluster-port", &bus.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", &d])
                .args(["--cluster-enabled", "yes", "--cluster-config-file", &format!("{d}/nodes.conf")])
                .args(["--cluster-node-timeout", "1000", "--logfile", &format!("{d}/redis.log")])
                .args(&self.tls_args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("run redis-server (set REDIS_SERVER to its path)");
            let mut node = ClusterNode { child: Some(child), port };
            let deadline = Instant::now() + DEADLINE;
            let started = loop {
                if let Some(Ok(Some(_))) = node.child.as_mut().map(Child::try_wait) {
                    break false;
                }
                if self.query::<String>(port, &redis::cmd("PING")).is_some() {
                    break true;
                }
                assert!(Instant::now() < deadline, "cluster node on port {port} did not answer PING in time");
                thread::sleep(Duration::from_millis(10));
            };
            if started {
                used.insert(port);
                used.insert(bus);
                return node;
            }
            node.child = None;
            let _ = fs::remove_file(dir.join("nodes.conf"));
        }
        panic!("could not start cluster node {index} on free ports after 10 attempts");
    }

    /// Waits until every live node reports the cluster up with all 16384 slots served, knows all
    /// six nodes, sees no failing one among the live ones, and every replica's link to its master
    /// is up (so a failover has a synchronised replica to promote).
    pub fn wait_until_healthy(&self) {
        let live: Vec<u16> = self.live_ports();
        wait_until_for("cluster healthy", CLUSTER_DEADLINE, || {
            live.iter().all(|&port| {
                let Some(info) = self.query::<String>(port, redis::cmd("CLUSTER").arg("INFO")) else { return false };
                let ok = info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_assigned:16384")
                    && info.contains("cluster_slots_ok:16384")
                    && info.contains("cluster_known_nodes:6");
                let Some(nodes) = self.cluster_nodes(port) else { return false };
                let live_nodes: Vec<&NodeInfo> = nodes.iter().filter(|n| live.contains(&n.port)).collect();
                let agreed = live_nodes.len() == live.len() && live_nodes.iter().all(|n| !n.is_failing());
                let Some(replication) = self.query::<String>(port, redis::cmd("INFO").arg("replication")) else {
                    return false;
                };
                let synced = replication.contains("role:master") || replication.contains("master_link_status:up");
                ok && agreed && synced
            })
        });
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.port).collect()
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    /// Seed list in the compact form: `redis://127.0.0.1:p1,127.0.0.1:p2,...` (`rediss://` for
    /// a TLS cluster).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("{}://{}", self.scheme(), nodes.join(","))
    }

    /// Seed list as comma-separated full URLs, with credentials.
    pub fn full_urls(&self, credentials: &str) -> String {
        let nodes: Vec<String> =
            self.nodes.iter().map(|n| format!("{}://{credentials}127.0.0.1:{}/", self.scheme(), n.port)).collect();
        nodes.join(",")
    }

    /// An administrative cluster connection (default user), through the live nodes.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        let seeds: Vec<String> =
            self.live_ports().iter().map(|p| format!("{}://127.0.0.1:{p}/", self.scheme())).collect();
        let mut builder = redis::cluster::ClusterClient::builder(seeds);
        if let Some(tls) = &self.tls {
            builder = builder.certs(redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: fs::read(&tls.cert).expect("read client cert"),
                    client_key: fs::read(&tls.key).expect("read client key"),
                }),
                root_cert: Some(fs::read(&tls.ca).expect("read CA")),
            });
        }
        builder.build().expect("cluster client").get_connection().expect("connect to test cluster")
    }

    /// Runs `command` on every live node (ACL SETUSER, ...: not propagated by the cluster).
    pub fn on_every_node(&self, command: &redis::Cmd) {
        for port in self.live_ports() {
            let mut conn = self.node_conn(port).expect("connect to cluster node");
            command.exec(&mut conn).unwrap_or_else(|e| panic!("{command:?} on node {port}: {e}"));
        }
    }

    /// A config for the cluster (compact seed list, cluster mode, our certificates for a TLS
    /// cluster) with test-friendly timings.
    pub fn config(&self, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
        let mut config = ConsumerConfig::new(self.url(), stream, group);
        config.redis_mode = RedisMode::Cluster;
        if let Some(tls) = &self.tls {
            config.tls_ca_file = Some(tls.ca.clone());
            config.tls_cert_file = Some(tls.cert.clone());
            config.tls_key_file = Some(tls.key.clone());
        }
        test_timings(&mut config, consumer);
        config
    }

    /// The slot of `key`, as the cluster computes it.
    pub fn slot(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        self.query(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).expect("CLUSTER KEYSLOT")
    }

    /// The live nodes' view of the cluster, from the first live node.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.cluster_nodes(self.live_ports()[0]).expect("CLUSTER NODES")
    }

    /// The port of the (live, non-failing) master serving `key`'s slot.
    pub fn master_port_of(&self, key: &str) -> u16 {
        let slot = self.slot(key);
        let nodes = self.nodes();
        nodes
            .iter()
            .find(|n| n.is_master() && !n.is_failing() && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .map(|n| n.port)
            .unwrap_or_else(|| panic!("no master serves slot {slot}: {nodes:?}"))
    }

    /// The port of the replica of the master on `master_port`.
    pub fn replica_port_of(&self, master_port: u16) -> u16 {
        let nodes = self.nodes();
        let master = nodes.iter().find(|n| n.port == master_port).expect("master in CLUSTER NODES");
        nodes.iter().find(|n| n.master == master.id).map(|n| n.port).expect("the master has a replica")
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).expect("a node of this cluster");
        node.kill();
    }

    /// Waits until the node on `port` has been promoted to master and every live node reports the
    /// cluster up again with all slots served.
    pub fn wait_until_promoted(&self, port: u16) {
        wait_until_for("replica promoted", CLUSTER_DEADLINE, || {
            let role: Option<Vec<Value>> = self.query(port, &redis::cmd("ROLE"));
            matches!(role.as_deref(), Some([Value::BulkString(r), ..]) if r.as_slice() == b"master")
        });
        let live = self.live_ports();
        wait_until_for("cluster up after the failover", CLUSTER_DEADLINE, || {
            live.iter().all(|&p| {
                self.query::<String>(p, redis::cmd("CLUSTER").arg("INFO"))
                    .is_some_and(|info| info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384"))
            })
        });
    }

    /// Waits until the master on `port` has replicated everything written so far to its replica,
    /// so that killing it loses nothing the test wrote itself.
    pub fn wait_replicated(&self, port: u16) {
        let mut conn = self.node_conn(port).expect("connect to the master");
        wait_until_for("writes replicated", DEADLINE, || {
            let acked: i64 = redis::cmd("WAIT").arg(1).arg(1000).query(&mut conn).expect("WAIT");
            acked >= 1
        });
    }

    /// A direct connection to one node (default user, our client certificate for TLS).
    fn node_conn(&self, port: u16) -> Option<redis::Connection> {
        let url = format!("{}://127.0.0.1:{port}/", self.scheme());
        let conn = client(&url, self.tls.as_ref()).get_connection_with_timeout(Duration::from_secs(1)).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        Some(conn)
    }

    /// Runs one command on one node directly; `None` if the node is unreachable or refuses it.
    fn query<T: redis::FromRedisValue>(&self, port: u16, command: &redis::Cmd) -> Option<T> {
        command.query(&mut self.node_conn(port)?).ok()
    }

    fn cluster_nodes(&self, port: u16) -> Option<Vec<NodeInfo>> {
        let text: String = self.query(port, redis::cmd("CLUSTER").arg("NODES"))?;
        let mut out = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.len() < 8 {
                return None;
            }
            // ip:port@cport[,hostname]
            let address = parts[1].split('@').next()?;
            let port = address.rsplit(':').next()?.parse().ok()?;
            let mut slots = Vec::new();
            for range in &parts[8..] {
                if range.starts_with('[') {
                    continue; // a slot being migrated
                }
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                slots.push((a.parse().ok()?, b.parse().ok()?));
            }
            out.push(NodeInfo {
                id: parts[0].to_string(),
                port,
                flags: parts[2].split(',').map(str::to_string).collect(),
                master: parts[3].to_string(),
                slots,
            });
        }
        Some(out)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

/// Runs a command to completion, killing it and failing the test after `deadline`.
pub fn run_with_deadline(mut command: Command, deadline: Duration) -> std::process::Output {
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let until = Instant::now() + deadline;
    loop {
        match child.try_wait().expect("try_wait") {
            // Outputs of the commands run this way are small: waiting before reading is safe.
            Some(_) => return child.wait_with_output().expect("collect output"),
            None if Instant::now() >= until => {
                let _ = child.kill();
                let output = child.wait_with_output().expect("collect output");
                panic!("{command:?} did not finish in time: {}", String::from_utf8_lossy(&output.stderr));
            }
            None => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The README's least ACL privileges for a consumer of `stream` in group `group` (default
/// dead-letter stream and dedup prefix), as ACL SETUSER rules: the keys, then the commands (the
/// scripts' GET, SET and DEL included); cluster mode adds what the cluster client needs to find
/// and follow the slots.
pub fn least_privileges(stream: &str, group: &str, cluster: bool) -> Vec<String> {
    let mut rules = vec![format!("~{stream}"), format!("~{stream}:dead"), format!("~outbox:dedup:{group}:*")];
    let commands = [
        "+xgroup|create",
        "+xreadgroup",
        "+xautoclaim",
        "+xpending",
        "+xack",
        "+xadd",
        "+set",
        "+get",
        "+del",
        "+eval",
    ];
    rules.extend(commands.iter().map(|c| c.to_string()));
    if cluster {
        rules.extend(["+ping", "+cluster|slots", "+asking"].iter().map(|c| c.to_string()));
    }
    rules
}

/// `ACL SETUSER user reset on >password resetchannels -@all <rules...>`: a user with only `rules`.
pub fn set_user_command(user: &str, password: &str, rules: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(user).arg("reset").arg("on").arg(format!(">{password}")).arg("resetchannels").arg("-@all");
    for rule in rules {
        cmd.arg(rule);
    }
    cmd
}

/// A deterministic, valid UUID for test event number `n`.
pub fn event_id(n: u64) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

/// The fields outbox_pg writes for an event, with a small JSON payload.
pub fn event_fields(event_id: &str, seq: i64) -> Vec<(String, String)> {
    vec![
        ("event_id".into(), event_id.into()),
        ("outbox_id".into(), (1000 + seq).to_string()),
        ("aggregate_type".into(), "order".into()),
        ("aggregate_id".into(), "o-1".into()),
        ("aggregate_seq".into(), seq.to_string()),
        ("event_type".into(), "order.updated".into()),
        ("payload".into(), format!(r#"{{"seq":{seq}}}"#)),
        ("created_at".into(), "2026-11-29T20:00:00.123456Z".into()),
    ]
}

/// XADDs an entry and returns its ID.
pub fn xadd(conn: &mut dyn ConnectionLike, stream: &str, fields: &[(String, String)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(k).arg(v);
    }
    cmd.query(conn).expect("XADD")
}

/// How many entries of the group are pending (delivered, not acknowledged).
pub fn pending_count(conn: &mut dyn ConnectionLike, stream: &str, group: &str) -> u64 {
    let summary: Vec<Value> = redis::cmd("XPENDING").arg(stream).arg(group).query(conn).expect("XPENDING");
    match summary.first() {
        Some(Value::Int(n)) => u64::try_from(*n).expect("non-negative count"),
        other => panic!("unexpected XPENDING summary {other:?}"),
    }
}

/// The IDs of the pending entries of the group.
pub fn pending_ids(conn: &mut dyn ConnectionLike, stream: &str, group: &str) -> Vec<String> {
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(1000).query(conn).expect("XPENDING range");
    rows.into_iter().map(|(id, ..)| id).collect()
}

/// All entries of a stream as (id, field map).
pub fn xrange(conn: &mut dyn ConnectionLike, stream: &str) -> Vec<(String, std::collections::HashMap<String, String>)> {
    let rows: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).expect("XRANGE");
    rows.into_iter().map(|(id, fields)| (id, fields.into_iter().collect())).collect()
}

/// Polls `condition` until it holds; fails the test with `what` after [`DEADLINE`].
pub fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    wait_until_for(what, DEADLINE, condition);
}

/// Polls `condition` until it holds; fails the test with `what` after `deadline`.
pub fn wait_until_for(what: &str, deadline: Duration, mut condition: impl FnMut() -> bool) {
    let until = Instant::now() + deadline;
    while !condition() {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        thread::sleep(Duration::from_millis(10));
    }
}
