//! A Redis Sentinel set from real processes: a master, its replica and three sentinels, able to
//! kill the master, wait for the failover and bring the old master back as a replica.

use std::collections::HashMap;
use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::dirs::TempDir;
use crate::os::free_port;
use crate::redis_server::{redis_server_binary, stream_keys_on, Redis, StreamStore};
use crate::wait::{wait_for, DEADLINE};

/// The name the sentinels monitor the master under.
pub const SENTINEL_MASTER: &str = "outbox";

/// A sentinel process with its own config file (sentinels rewrite theirs).
struct Sentinel {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl Sentinel {
    fn connection(&self) -> Option<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .ok()?
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()
    }
}

/// A master, its replica and three sentinels watching them under [`SENTINEL_MASTER`], with a
/// quorum of two and a master considered down after one second.
pub struct SentinelSet {
    pub master: Redis,
    pub replica: Redis,
    sentinels: Vec<Sentinel>,
}

impl SentinelSet {
    pub fn start() -> SentinelSet {
        // No delay before the replica's first full sync (5 s by default).
        let master = Redis::start_with(&["--repl-diskless-sync-delay", "0"]);
        let replica = Redis::start_with(&[
            "--repl-diskless-sync-delay",
            "0",
            "--replicaof",
            "127.0.0.1",
            &master.port.to_string(),
        ]);
        wait_for(DEADLINE, "the replica to sync", || {
            (master.info_field("replication", "connected_slaves").as_deref() == Some("1")
                && replica.info_field("replication", "master_link_status").as_deref() == Some("up"))
            .then_some(())
        });
        let sentinels = (0..3)
            .map(|_| {
                let dir = TempDir::new("sn");
                let port = free_port();
                let conf = dir.path().join("sentinel.conf");
                fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
                         sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                         sentinel failover-timeout {SENTINEL_MASTER} 5000\n",
                        dir.path().display(),
                        master.port
                    ),
                )
                .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
                let child = Command::new(redis_server_binary())
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot run redis-server --sentinel: {e}"));
                Sentinel { port, child, _dir: dir }
            })
            .collect();
        let set = SentinelSet { master, replica, sentinels };
        wait_for(DEADLINE, "every sentinel to know the replica and the other sentinels", || {
            set.sentinels
                .iter()
                .all(|sentinel| {
                    let Some(mut connection) = sentinel.connection() else { return false };
                    let fields: redis::RedisResult<HashMap<String, String>> =
                        redis::cmd("SENTINEL").arg("MASTER").arg(SENTINEL_MASTER).query(&mut connection);
                    fields.is_ok_and(|f| {
                        f.get("num-slaves").map(String::as_str) == Some("1")
                            && f.get("num-other-sentinels").map(String::as_str) == Some("2")
                    })
                })
                .then_some(())
        });
        set
    }

    /// `outbox.redis_url` for a relay: every sentinel.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        format!("redis://{}", hosts.join(","))
    }

    /// One field of the first sentinel's `INFO section` (its version, say), "" when it has none.
    pub fn sentinel_info_field(&self, section: &str, field: &str) -> String {
        let Some(mut connection) = self.sentinels.first().and_then(Sentinel::connection) else { return String::new() };
        let info: String = redis::cmd("INFO").arg(section).query(&mut connection).unwrap_or_default();
        info.lines()
            .find_map(|line| line.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
            .unwrap_or_default()
    }

    /// The master's port as the sentinels' quorum sees it.
    pub fn master_port(&self) -> Option<u16> {
        let mut votes: HashMap<u16, usize> = HashMap::new();
        for sentinel in &self.sentinels {
            let Some(mut connection) = sentinel.connection() else { continue };
            let reply: redis::RedisResult<Option<(String, String)>> =
                redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(SENTINEL_MASTER).query(&mut connection);
            if let Ok(Some((_, port))) = reply {
                if let Ok(port) = port.parse() {
                    *votes.entry(port).or_default() += 1;
                }
            }
        }
        votes.into_iter().find(|(_, n)| *n >= 2).map(|(port, _)| port)
    }

    /// Kills the master (SIGKILL), waits until the sentinels have promoted the replica, then starts
    /// the old master again and waits until the sentinels made it the new master's replica.
    pub fn fail_over(&mut self) {
        self.master.kill();
        wait_for(DEADLINE, "the sentinels to promote the replica", || {
            (self.master_port() == Some(self.replica.port)
                && self.replica.info_field("replication", "role").as_deref() == Some("master"))
            .then_some(())
        });
        // Only now, and as the new master's replica, the way an operator brings a failed node
        // back: an empty master back before the failover would be taken back as master and wipe
        // the replica, and one back as a master after it is one a stale sentinel may still name
        // (a relay then wrote to it, and the sentinels took more than a minute to convert it).
        self.master.replicate(Some(self.replica.port));
        self.replica.replicate(None);
        self.master.restart();
        wait_for(DEADLINE, "the old master to replicate the new one", || {
            (self.master.info_field("replication", "master_link_status").as_deref() == Some("up")
                && self.replica.info_field("replication", "connected_slaves").as_deref() == Some("1"))
            .then_some(())
        });
        std::mem::swap(&mut self.master, &mut self.replica);
    }

    /// The server the quorum names master.
    fn current_master(&self) -> &Redis {
        let port = self.master_port().expect("the sentinels' quorum to name a master");
        [&self.master, &self.replica]
            .into_iter()
            .find(|redis| redis.port == port)
            .unwrap_or_else(|| panic!("the sentinels name port {port} master, which is neither server of the set"))
    }
}

impl StreamStore for SentinelSet {
    fn stream_keys(&self) -> Vec<String> {
        stream_keys_on(&mut self.current_master().connection())
    }

    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        self.current_master().entries(stream)
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for sentinel in &mut self.sentinels {
            let _ = sentinel.child.kill();
            let _ = sentinel.child.wait();
        }
    }
}
