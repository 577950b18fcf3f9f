//! Redis topologies for the tests, from real `redis-server` processes on free loopback ports: a
//! Sentinel set (a master, a replica, three sentinels) and a Cluster (three masters, three
//! replicas), each able to kill a master, wait for the failover, bring the old master back as a
//! replica, and read every stream for the invariant checker.

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, fresh_dir, run, stream_keys_on, wait_for, Redis, StreamStore, DEADLINE};

fn connection(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .ok()?
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()
}

fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    let info: String = redis::cmd("INFO").arg(section).query(&mut connection(port)?).ok()?;
    info.lines().find_map(|line| line.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
}

/// A stream entry as XRANGE returns it: its id and its field/value pairs.
type Entry = (String, Vec<(String, String)>);

/// Entries of `stream` on the node at `port`, oldest first. In a cluster, after ASKING: a node
/// importing the stream's slot answers for it only then.
fn entries_at(port: u16, stream: &str) -> Vec<HashMap<String, String>> {
    let mut connection = connection(port).expect("a connection to the node");
    let cluster = info_field_cluster(port).is_some();
    let mut pipe = redis::pipe();
    if cluster {
        pipe.cmd("ASKING").ignore();
    }
    pipe.cmd("XRANGE").arg(stream).arg("-").arg("+");
    let (reply,): (Vec<Entry>,) = pipe.query(&mut connection).unwrap();
    reply.into_iter().map(|(_, fields)| fields.into_iter().collect()).collect()
}

/// Keys holding a stream on the node at `port`.
fn stream_keys_at(port: u16) -> Vec<String> {
    stream_keys_on(&mut connection(port).expect("a connection to the node"))
}

/// A sentinel process with its own config file (sentinels rewrite theirs).
struct Sentinel {
    port: u16,
    child: Child,
    _dir: PathBuf,
}

/// A master, its replica and three sentinels watching them under the name `outbox`.
pub struct SentinelSet {
    pub master: Redis,
    pub replica: Redis,
    sentinels: Vec<Sentinel>,
}

pub const SENTINEL_MASTER: &str = "outbox";

impl SentinelSet {
    pub fn start() -> SentinelSet {
        let master = Redis::start_with(&["--repl-diskless-sync-delay", "0"]);
        let replica = Redis::start_with(&[
            "--repl-diskless-sync-delay",
            "0",
            "--replicaof",
            "127.0.0.1",
            &master.port.to_string(),
        ]);
        wait_for(DEADLINE, "the replica to sync", || {
            (info_field(master.port, "replication", "connected_slaves").as_deref() == Some("1")
                && info_field(replica.port, "replication", "master_link_status").as_deref() == Some("up"))
            .then_some(())
        });
        let sentinels = (0..3)
            .map(|_| {
                let dir = fresh_dir("sn");
                let port = free_port();
                let conf = dir.join("sentinel.conf");
                fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
                         sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                         sentinel failover-timeout {SENTINEL_MASTER} 5000\n",
                        dir.display(),
                        master.port
                    ),
                )
                .unwrap();
                let child = Command::new("redis-server")
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-server --sentinel");
                Sentinel { port, child, _dir: dir }
            })
            .collect();
        let set = SentinelSet { master, replica, sentinels };
        wait_for(DEADLINE, "every sentinel to know the replica and the other sentinels", || {
            set.sentinels
                .iter()
                .all(|sentinel| {
                    let Some(mut connection) = connection(sentinel.port) else { return false };
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

    /// `outbox.redis_url` for the relay: every sentinel.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        format!("redis://{}", hosts.join(","))
    }

    /// The master's port as the sentinels' quorum sees it.
    pub fn master_port(&self) -> Option<u16> {
        let mut votes: HashMap<u16, usize> = HashMap::new();
        for sentinel in &self.sentinels {
            let Some(mut connection) = connection(sentinel.port) else { continue };
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
        let old = self.master.port;
        self.master.kill();
        wait_for(DEADLINE, "the sentinels to promote the replica", || {
            (self.master_port() == Some(self.replica.port)
                && info_field(self.replica.port, "replication", "role").as_deref() == Some("master"))
            .then_some(())
        });
        // Only now: an old master back (empty, no persistence) before the failover would be taken
        // back as master and wipe the replica.
        self.master.restart();
        wait_for(DEADLINE, "the old master to replicate the new one", || {
            (info_field(old, "replication", "master_link_status").as_deref() == Some("up")
                && info_field(self.replica.port, "replication", "connected_slaves").as_deref() == Some("1"))
            .then_some(())
        });
        std::mem::swap(&mut self.master, &mut self.replica);
    }
}

impl StreamStore for SentinelSet {
    fn stream_keys(&self) -> Vec<String> {
        let port = self.master_port().expect("a master");
        let mut keys = stream_keys_at(port);
        keys.sort();
        keys
    }

    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        entries_at(self.master_port().expect("a master"), stream)
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

/// A Redis Cluster of three masters with a replica each.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    /// `ACL SETUSER` arguments applied to every node (again after a restart: ACLs are not kept).
    users: Vec<Vec<String>>,
}

/// A node of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// The slot ranges it serves (masters).
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        // No delay before a replica's first full sync (5 s by default): a replica that never synced
        // cannot take over.
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            "--repl-diskless-sync-delay",
            "0",
        ];
        let nodes: Vec<Redis> = (0..6).map(|_| Redis::start_with(&args)).collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        run(create, "redis-cli --cluster create");
        let cluster = RedisCluster { nodes, users: Vec::new() };
        cluster.wait_healthy();
        cluster
    }

    /// Creates a Redis user on every node (`ACL SETUSER` with `rules`).
    pub fn add_user(&mut self, rules: &[&str]) {
        self.users.push(rules.iter().map(|rule| rule.to_string()).collect());
        for node in &self.nodes {
            self.apply_users(node.port);
        }
    }

    fn apply_users(&self, port: u16) {
        for rules in &self.users {
            let mut cmd = redis::cmd("ACL");
            cmd.arg("SETUSER").arg(rules);
            let _: () = cmd.query(&mut connection(port).expect("a connection to the node")).unwrap();
        }
    }

    /// Waits until every node that runs sees the cluster as ok, every replica has synced with its
    /// master, and every master has a replica.
    pub fn wait_healthy(&self) {
        wait_for(DEADLINE, "the cluster to be ok with a synced replica per master", || {
            let ok = self.nodes.iter().filter(|node| node.is_running()).all(|node| {
                info_field_cluster(node.port).as_deref() == Some("ok")
                    && (info_field(node.port, "replication", "role").as_deref() != Some("slave")
                        || info_field(node.port, "replication", "master_link_status").as_deref() == Some("up"))
            });
            let topology = self.topology()?;
            let masters: Vec<&ClusterNode> =
                topology.iter().filter(|node| node.master && !node.slots.is_empty()).collect();
            let replicated = masters.len() == 3
                && masters
                    .iter()
                    .all(|master| info_field(master.port, "replication", "connected_slaves").is_some_and(|n| n != "0"));
            (ok && replicated).then_some(())
        });
    }

    /// `CLUSTER NODES` as a running node sees it (`None` while none answers).
    pub fn topology(&self) -> Option<Vec<ClusterNode>> {
        let port = self.nodes.iter().find(|node| node.is_running())?.port;
        let text: String = redis::cmd("CLUSTER").arg("NODES").query(&mut connection(port)?).ok()?;
        Some(
            text.lines()
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let address = fields.get(1)?;
                    let port = address.split('@').next()?.rsplit(':').next()?.parse().ok()?;
                    let flags = fields.get(2)?;
                    let slots = fields
                        .iter()
                        .skip(8)
                        .filter(|range| !range.starts_with('['))
                        .filter_map(|range| {
                            let (first, last) = range.split_once('-').unwrap_or((range, range));
                            Some((first.parse().ok()?, last.parse().ok()?))
                        })
                        .collect();
                    Some(ClusterNode {
                        id: fields[0].to_string(),
                        port,
                        master: flags.contains("master") && !flags.contains("fail"),
                        slots,
                    })
                })
                .collect(),
        )
    }

    /// `outbox.redis_url` for the relay: two seed nodes are enough to find the rest.
    pub fn url(&self) -> String {
        self.url_as("")
    }

    /// The same, with credentials (`user:password@`).
    pub fn url_as(&self, credentials: &str) -> String {
        format!("redis://{credentials}127.0.0.1:{},127.0.0.1:{}", self.nodes[0].port, self.nodes[1].port)
    }

    pub fn key_slot(&self, key: &str) -> u16 {
        let port = self.nodes.iter().find(|node| node.is_running()).expect("a running node").port;
        redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut connection(port).unwrap()).unwrap()
    }

    /// The master serving `slot`.
    pub fn master_of(&self, slot: u16) -> ClusterNode {
        wait_for(DEADLINE, &format!("a master serving slot {slot}"), || self.try_master_of(slot))
    }

    /// The master serving `slot`, as a running node sees it now (`None`: none, during a failover).
    fn try_master_of(&self, slot: u16) -> Option<ClusterNode> {
        self.topology()?
            .into_iter()
            .find(|node| node.master && node.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
    }

    /// `CLUSTER NODES` of every running node, for a failed test's output.
    fn dump(&self) -> String {
        self.nodes
            .iter()
            .filter(|node| node.is_running())
            .map(|node| {
                let text: String = connection(node.port)
                    .and_then(|mut c| redis::cmd("CLUSTER").arg("NODES").query(&mut c).ok())
                    .unwrap_or_default();
                let log = node.log();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- seen by {}:\n{text}--- its log:\n{}\n", node.port, tail.join("\n"))
            })
            .collect()
    }

    fn node_index(&self, port: u16) -> usize {
        self.nodes.iter().position(|node| node.port == port).expect("a node of this cluster")
    }

    /// Kills the master serving `slot` (SIGKILL), waits until its replica took over, then starts
    /// it again (it rejoins as the new master's replica) and waits for the cluster to be whole.
    pub fn fail_over(&mut self, slot: u16) {
        let old = self.master_of(slot);
        let index = self.node_index(old.port);
        self.nodes[index].kill();
        let mut looked = std::time::Instant::now();
        wait_for(DEADLINE, "the replica to take the slots over", || {
            if looked.elapsed() > Duration::from_secs(5) {
                eprintln!("still waiting for a failover of slot {slot} (master {} killed):\n{}", old.port, self.dump());
                looked = std::time::Instant::now();
            }
            let master = self.try_master_of(slot)?;
            (master.port != old.port && info_field(master.port, "replication", "role").as_deref() == Some("master"))
                .then_some(())
        });
        self.nodes[index].restart();
        self.apply_users(self.nodes[index].port);
        self.wait_healthy();
    }

    /// Moves `slot` (and the keys in it) from its master to another master, the way `redis-cli
    /// --cluster reshard` does: IMPORTING/MIGRATING, MIGRATE of the keys, then the new owner.
    /// `between` runs while the keys have moved and the slot is still migrating, when writes to
    /// the old owner are answered with ASK.
    pub fn migrate_slot(&self, slot: u16, between: impl FnOnce(u16)) -> u16 {
        let source = self.master_of(slot);
        let topology = self.topology().expect("the cluster's nodes");
        let target =
            topology.iter().find(|node| node.master && !node.slots.is_empty() && node.id != source.id).unwrap();
        let mut at_source = connection(source.port).unwrap();
        let mut at_target = connection(target.port).unwrap();
        let setslot = |connection: &mut redis::Connection, args: &[&str]| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot);
            for arg in args {
                cmd.arg(*arg);
            }
            let _: () = cmd.query(connection).unwrap();
        };
        setslot(&mut at_target, &["IMPORTING", &source.id]);
        setslot(&mut at_source, &["MIGRATING", &target.id]);
        loop {
            let keys: Vec<String> =
                redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(100).query(&mut at_source).unwrap();
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate.arg("127.0.0.1").arg(target.port).arg("").arg(0).arg(5000).arg("KEYS");
            for key in &keys {
                migrate.arg(key);
            }
            let _: () = migrate.query(&mut at_source).unwrap();
        }
        between(target.port);
        for node in &topology {
            if node.master && !node.slots.is_empty() {
                if let Some(mut connection) = connection(node.port) {
                    setslot(&mut connection, &["NODE", &target.id]);
                }
            }
        }
        target.port
    }

    /// Entries of `stream` on the node at `port` (tests read a migrating slot's two owners).
    pub fn entries_at(&self, port: u16, stream: &str) -> Vec<HashMap<String, String>> {
        entries_at(port, stream)
    }

    /// Keys in `slot` on the node at `port`.
    pub fn keys_in_slot_at(&self, port: u16, slot: u16) -> i64 {
        redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot).query(&mut connection(port).unwrap()).unwrap()
    }
}

fn info_field_cluster(port: u16) -> Option<String> {
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut connection(port)?).ok()?;
    info.lines().find_map(|line| line.strip_prefix("cluster_state:").map(|v| v.trim().to_string()))
}

impl StreamStore for RedisCluster {
    fn stream_keys(&self) -> Vec<String> {
        let topology = self.topology().expect("the cluster's nodes");
        let mut keys: Vec<String> = topology
            .iter()
            .filter(|node| node.master && !node.slots.is_empty())
            .flat_map(|node| stream_keys_at(node.port))
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }

    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        entries_at(self.master_of(self.key_slot(stream)).port, stream)
    }
}
