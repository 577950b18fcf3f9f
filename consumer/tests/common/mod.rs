//! Shared test support: a private redis-server per test, and small Redis helpers.
//!
//! Every wait is a poll against a deadline (never a fixed sleep), and no test asserts on how long
//! anything took.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use outbox_consumer::ConsumerConfig;
use redis::Value;

/// How long any wait in the tests may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A redis-server child process listening on 127.0.0.1 on a free port, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    /// Starts a server on a free port; retries with another port if it loses a race for one.
    pub fn start() -> RedisServer {
        for _ in 0..10 {
            if let Some(server) = Self::start_on(free_port()) {
                return server;
            }
        }
        panic!("could not start redis-server on a free port after 10 attempts");
    }

    /// Starts a server on `port`; `None` if it exited (port taken) before answering PING.
    pub fn start_on(port: u16) -> Option<RedisServer> {
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_string());
        let child = Command::new(&binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {binary}: {e} (set REDIS_SERVER to its path)"));
        let mut server = RedisServer { child, port };
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
        let Ok(client) = redis::Client::open(self.url()) else { return false };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else { return false };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    /// Kills the server and starts a fresh, empty one on the same port (a restart without
    /// persistence: streams and groups are gone).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(server) = Self::start_on(self.port) {
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).expect("valid url");
        client.get_connection_with_timeout(Duration::from_secs(5)).expect("connect to test redis")
    }

    /// A config with test-friendly timings: short blocking reads so loops notice conditions
    /// quickly, and a reclaim scan on every poll.
    pub fn config(&self, stream: &str, group: &str, consumer: &str) -> ConsumerConfig {
        let mut config = ConsumerConfig::new(self.url(), stream, group);
        config.consumer_name = consumer.to_string();
        config.block_timeout = Duration::from_millis(50);
        config.claim_interval = Duration::ZERO;
        config
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
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
pub fn xadd(conn: &mut redis::Connection, stream: &str, fields: &[(String, String)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(k).arg(v);
    }
    cmd.query(conn).expect("XADD")
}

/// How many entries of the group are pending (delivered, not acknowledged).
pub fn pending_count(conn: &mut redis::Connection, stream: &str, group: &str) -> u64 {
    let summary: Vec<Value> = redis::cmd("XPENDING").arg(stream).arg(group).query(conn).expect("XPENDING");
    match summary.first() {
        Some(Value::Int(n)) => u64::try_from(*n).expect("non-negative count"),
        other => panic!("unexpected XPENDING summary {other:?}"),
    }
}

/// The IDs of the pending entries of the group.
pub fn pending_ids(conn: &mut redis::Connection, stream: &str, group: &str) -> Vec<String> {
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(1000).query(conn).expect("XPENDING range");
    rows.into_iter().map(|(id, ..)| id).collect()
}

/// All entries of a stream as (id, field map).
pub fn xrange(conn: &mut redis::Connection, stream: &str) -> Vec<(String, std::collections::HashMap<String, String>)> {
    let rows: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).expect("XRANGE");
    rows.into_iter().map(|(id, fields)| (id, fields.into_iter().collect())).collect()
}

/// Polls `condition` until it holds; fails the test with `what` after [`DEADLINE`].
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        thread::sleep(Duration::from_millis(10));
    }
}
