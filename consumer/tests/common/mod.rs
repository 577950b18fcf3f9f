//! Shared test support: the consumer's view of outbox-testkit's servers (a redis-server, plain or
//! TLS, and a six-node Redis Cluster, each with a `ConsumerConfig` for it), certificates, and
//! small Redis helpers.
//!
//! Every wait is a poll against a deadline (never a fixed sleep), and no test asserts on how long
//! anything took.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::fs;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::time::Duration;

use outbox_consumer::{ConsumerConfig, RedisMode};
use outbox_testkit::{wait_for, Redis};
use redis::{ConnectionLike, Value};

#[allow(unused_imports)]
pub use outbox_testkit::{output_within, Certificates as TlsFiles, ClientTls, TempDir};

/// How long any wait in the tests may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Forming a cluster or failing over takes longer than anything on a single server.
pub const CLUSTER_DEADLINE: Duration = Duration::from_secs(60);

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

/// A config with test-friendly timings: short blocking reads so loops notice conditions
/// quickly, and a reclaim scan on every poll.
fn test_config(url: String, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(url, stream, group);
    config.consumer_name = consumer.to_string();
    config.block_timeout = Duration::from_millis(50);
    config.claim_interval = Duration::ZERO;
    config
}

/// A private redis-server (outbox-testkit's), killed on drop.
pub struct RedisServer(Redis);

impl RedisServer {
    /// A plain server on a free port.
    pub fn start() -> RedisServer {
        RedisServer(Redis::start())
    }

    /// A TLS-only server (`--port 0 --tls-port P`) with the given certificate and key, trusting
    /// our CA for client certificates, which it requires. `probe` is how the test's own client
    /// verifies it and authenticates.
    pub fn start_tls(files: &TlsFiles, server_cert: &Path, server_key: &Path, probe: ClientTls) -> RedisServer {
        RedisServer(Redis::start_tls(files, server_cert, server_key, probe))
    }

    /// `redis://127.0.0.1:P/`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        format!("{}/", self.0.url())
    }

    /// An administrative connection (default user; over TLS with our client certificate).
    pub fn conn(&self) -> redis::Connection {
        self.0.connection()
    }

    /// A config for this server with test-friendly timings.
    pub fn config(&self, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
        test_config(self.url(), stream, group, consumer)
    }
}

impl Deref for RedisServer {
    type Target = Redis;

    fn deref(&self) -> &Redis {
        &self.0
    }
}

impl DerefMut for RedisServer {
    fn deref_mut(&mut self) -> &mut Redis {
        &mut self.0
    }
}

/// A Redis Cluster of three masters with one replica each (outbox-testkit's), killed on drop.
pub struct RedisCluster(outbox_testkit::RedisCluster);

impl RedisCluster {
    /// A plain-TCP cluster.
    pub fn start() -> RedisCluster {
        RedisCluster(outbox_testkit::RedisCluster::start())
    }

    /// A TLS-only cluster: every node serves TLS on its port, speaks TLS on the cluster bus and
    /// for replication, presents our server certificate and requires a client certificate of our
    /// CA.
    pub fn start_tls(files: &TlsFiles) -> RedisCluster {
        RedisCluster(outbox_testkit::RedisCluster::start_tls(files))
    }

    /// An administrative cluster connection (default user), through the live nodes.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        let scheme = if self.client_tls().is_some() { "rediss" } else { "redis" };
        let seeds: Vec<String> = self.live_ports().iter().map(|p| format!("{scheme}://127.0.0.1:{p}/")).collect();
        let mut builder = redis::cluster::ClusterClient::builder(seeds);
        if let Some(tls) = self.client_tls() {
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

    /// A config for the cluster (compact seed list, cluster mode, our certificates for a TLS
    /// cluster) with test-friendly timings.
    pub fn config(&self, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
        let mut config = test_config(self.url(), stream, group, consumer);
        config.redis_mode = RedisMode::Cluster;
        if let Some(tls) = self.client_tls() {
            config.tls_ca_file = Some(tls.ca.clone());
            config.tls_cert_file = Some(tls.cert.clone());
            config.tls_key_file = Some(tls.key.clone());
        }
        config
    }
}

impl Deref for RedisCluster {
    type Target = outbox_testkit::RedisCluster;

    fn deref(&self) -> &outbox_testkit::RedisCluster {
        &self.0
    }
}

impl DerefMut for RedisCluster {
    fn deref_mut(&mut self) -> &mut outbox_testkit::RedisCluster {
        &mut self.0
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
    wait_for(deadline, what, || condition().then_some(()));
}
