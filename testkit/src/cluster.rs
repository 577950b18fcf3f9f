//! A Redis Cluster from real `redis-server` processes, formed with `redis-cli --cluster create`:
//! by default three masters with a replica each, optionally TLS-only (clients, cluster bus and
//! replication) with client certificates required. Tests kill masters and wait for the failover,
//! migrate a slot, add ACL users, and read every stream.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::os::output_within;
use crate::redis_server::{stream_keys_on, tls_server_args, Entry, Redis, RedisOptions, StreamStore};
use crate::tls::{Certificates, ClientTls};
use crate::wait::{wait_for, DEADLINE};

const SLOTS: usize = 16384;

fn redis_cli_binary() -> String {
    std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".to_string())
}

/// The shape of a cluster and how its nodes are started.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub masters: usize,
    pub replicas_per_master: usize,
    /// `cluster-node-timeout`: how long a node may not answer before it is considered failing.
    pub node_timeout: Duration,
    /// TLS-only nodes: their redis-server TLS arguments, and how this crate's own connections
    /// (and `redis-cli`) verify them and authenticate. [`RedisCluster::start_tls`] fills it in.
    pub tls: Option<(Vec<String>, ClientTls)>,
    /// The nodes' directories (`node-N` below it), kept afterwards, instead of temporary ones.
    pub dir: Option<PathBuf>,
    /// Nodes in their own process groups (see [`RedisOptions::own_process_group`]).
    pub own_process_group: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            masters: 3,
            replicas_per_master: 1,
            node_timeout: Duration::from_secs(1),
            tls: None,
            dir: None,
            own_process_group: false,
        }
    }
}

/// A node as `CLUSTER NODES` shows it.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub flags: Vec<String>,
    /// A master that no node reports failing, handshaking or without address.
    pub master: bool,
    /// A replica's master's id.
    pub replica_of: Option<String>,
    /// The slot ranges it serves (a master); a slot being migrated is not among them.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    /// Flagged failed, suspected, or not yet joined.
    pub fn is_failing(&self) -> bool {
        self.flags.iter().any(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
    }

    fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(first, last)| (first..=last).contains(&slot))
    }
}

/// `CLUSTER NODES` parsed; `None` if a line does not parse.
fn parse_nodes(text: &str) -> Option<Vec<ClusterNode>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // ip:port@cport[,hostname]
            let port = fields.get(1)?.split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags: Vec<String> = fields.get(2)?.split(',').map(str::to_string).collect();
            let master_id = *fields.get(3)?;
            let mut slots = Vec::new();
            for range in fields.iter().skip(8).filter(|range| !range.starts_with('[')) {
                let (first, last) = range.split_once('-').unwrap_or((range, range));
                slots.push((first.parse().ok()?, last.parse().ok()?));
            }
            let mut node = ClusterNode {
                id: fields[0].to_string(),
                port,
                master: false,
                replica_of: (master_id != "-").then(|| master_id.to_string()),
                flags,
                slots,
            };
            node.master = node.flags.iter().any(|f| f == "master") && !node.is_failing();
            Some(node)
        })
        .collect()
}

/// A Redis Cluster on free loopback ports (each node with a bus port of its own), killed on
/// drop.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    options: ClusterOptions,
    /// `ACL SETUSER` arguments applied to every node (again after a restart: ACLs are not kept).
    users: Vec<Vec<String>>,
}

impl RedisCluster {
    /// Three masters with a replica each, plain TCP.
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(ClusterOptions::default())
    }

    /// Three masters with a replica each, TLS-only: every node serves TLS on its port, speaks TLS
    /// on the cluster bus and for replication, presents `certs`' server certificate and requires a
    /// client certificate of its CA.
    pub fn start_tls(certs: &Certificates) -> RedisCluster {
        let mut args = tls_server_args(certs, &certs.server_cert, &certs.server_key);
        args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
        RedisCluster::start_with(ClusterOptions { tls: Some((args, certs.client())), ..Default::default() })
    }

    /// A cluster of `options`' shape, waited for until it is healthy (see [`wait_healthy`]).
    ///
    /// [`wait_healthy`]: RedisCluster::wait_healthy
    pub fn start_with(options: ClusterOptions) -> RedisCluster {
        let count = options.masters * (1 + options.replicas_per_master);
        let mut args: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &options.node_timeout.as_millis().to_string(),
            // No delay before a replica's first full sync (5 s by default): a replica that never
            // synced cannot take over.
            "--repl-diskless-sync-delay",
            "0",
        ]
        .map(String::from)
        .to_vec();
        let tls = options.tls.as_ref().map(|(tls_args, client)| {
            args.extend(tls_args.iter().cloned());
            client.clone()
        });
        let nodes = (0..count)
            .map(|n| {
                Redis::start_options(RedisOptions {
                    args: args.clone(),
                    tls: tls.clone(),
                    cluster_bus: true,
                    dir: options.dir.as_ref().map(|dir| dir.join(format!("node-{n}"))),
                    own_process_group: options.own_process_group,
                })
            })
            .collect();
        let cluster = RedisCluster { nodes, options, users: Vec::new() };
        let mut create = Command::new(redis_cli_binary());
        if let Some(tls) = &tls {
            create.arg("--tls").arg("--cacert").arg(&tls.ca).arg("--cert").arg(&tls.cert).arg("--key").arg(&tls.key);
        }
        create.args(["--cluster", "create"]);
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", &cluster.options.replicas_per_master.to_string(), "--cluster-yes"]);
        let child = create
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-cli (set REDIS_CLI to its path): {e}"));
        let output = output_within(child, DEADLINE, "redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_healthy();
        cluster
    }

    /// Leaves every node running, and the directories in place, when the handle goes.
    pub fn detach(self) {
        let RedisCluster { nodes, .. } = self;
        nodes.into_iter().for_each(Redis::detach);
    }

    fn scheme(&self) -> &'static str {
        if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    /// Every node in the compact seed form, `redis://127.0.0.1:p1,127.0.0.1:p2,...` (`rediss://`
    /// for a TLS cluster).
    pub fn url(&self) -> String {
        self.seed_url("", self.nodes.len())
    }

    /// The first `seeds` nodes in the compact form with `credentials` (`user:password@`, or
    /// empty): a client must find the other nodes itself.
    pub fn seed_url(&self, credentials: &str, seeds: usize) -> String {
        let nodes: Vec<String> = self.nodes.iter().take(seeds).map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("{}://{credentials}{}", self.scheme(), nodes.join(","))
    }

    /// Every node as a full URL with `credentials`, comma-separated.
    pub fn full_urls(&self, credentials: &str) -> String {
        let nodes: Vec<String> =
            self.nodes.iter().map(|n| format!("{}://{credentials}127.0.0.1:{}/", self.scheme(), n.port)).collect();
        nodes.join(",")
    }

    /// How this crate's own connections authenticate to a TLS cluster (`None`: plain).
    pub fn client_tls(&self) -> Option<&ClientTls> {
        self.options.tls.as_ref().map(|(_, client)| client)
    }

    /// Ports of the nodes that run.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes.iter().filter(|node| node.is_running()).map(|node| node.port).collect()
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> &Redis {
        self.nodes.iter().find(|node| node.port == port).unwrap_or_else(|| panic!("no node of this cluster on {port}"))
    }

    fn node_mut(&mut self, port: u16) -> &mut Redis {
        self.nodes
            .iter_mut()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("no node of this cluster on {port}"))
    }

    /// Runs one command on one node directly; `None` if the node is unreachable or refuses it.
    fn query_node<T: redis::FromRedisValue>(&self, port: u16, command: &redis::Cmd) -> Option<T> {
        command.query(&mut self.node(port).try_connection(Duration::from_secs(1))?).ok()
    }

    /// Runs `command` on every running node (ACL SETUSER, CONFIG SET, ...: the cluster does not
    /// pass them on).
    pub fn on_every_node(&self, command: &redis::Cmd) {
        for port in self.live_ports() {
            command
                .exec(&mut self.node(port).connection())
                .unwrap_or_else(|e| panic!("{command:?} on node {port}: {e}"));
        }
    }

    /// Creates a Redis user on every node (`ACL SETUSER` with `rules`), again whenever a node
    /// restarts.
    pub fn add_user(&mut self, rules: &[&str]) {
        self.users.push(rules.iter().map(|rule| rule.to_string()).collect());
        for port in self.live_ports() {
            self.apply_users(port);
        }
    }

    fn apply_users(&self, port: u16) {
        for rules in &self.users {
            let mut cmd = redis::cmd("ACL");
            cmd.arg("SETUSER").arg(rules);
            cmd.exec(&mut self.node(port).connection()).unwrap_or_else(|e| panic!("ACL SETUSER on node {port}: {e}"));
        }
    }

    /// Waits until every running node reports the cluster ok with all slots served, knows every
    /// node and sees none of the running ones failing, every replica's link to its master is up,
    /// and (when the cluster has replicas) every master has one: a failover then has a synced
    /// replica to promote.
    pub fn wait_healthy(&self) {
        let live = self.live_ports();
        let slots = format!("cluster_slots_ok:{SLOTS}");
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
        wait_for(DEADLINE, "the cluster to be ok with every node known and every replica synced", || {
            let each_node_agrees = live.iter().all(|&port| {
                let node = self.node(port);
                let Some(info) = self.query_node::<String>(port, redis::cmd("CLUSTER").arg("INFO")) else {
                    return false;
                };
                let Some(view) = self.topology_at(port) else { return false };
                let sees_live = live.iter().all(|p| view.iter().any(|n| n.port == *p && !n.is_failing()));
                info.contains("cluster_state:ok")
                    && info.contains(&slots)
                    && info.lines().any(|line| line.trim() == known)
                    && sees_live
                    && (node.info_field("replication", "role").as_deref() != Some("slave")
                        || node.info_field("replication", "master_link_status").as_deref() == Some("up"))
            });
            let topology = self.topology()?;
            let masters: Vec<&ClusterNode> = topology.iter().filter(|n| n.master && !n.slots.is_empty()).collect();
            let replicated = masters.len() == self.options.masters
                && (self.options.replicas_per_master == 0
                    || masters.iter().all(|master| {
                        self.node(master.port).info_field("replication", "connected_slaves").is_some_and(|n| n != "0")
                    }));
            (each_node_agrees && replicated).then_some(())
        });
    }

    /// `CLUSTER NODES` as the node on `port` sees it.
    fn topology_at(&self, port: u16) -> Option<Vec<ClusterNode>> {
        parse_nodes(&self.query_node::<String>(port, redis::cmd("CLUSTER").arg("NODES"))?)
    }

    /// `CLUSTER NODES` as the first running node sees it (`None` while none answers).
    pub fn topology(&self) -> Option<Vec<ClusterNode>> {
        self.topology_at(*self.live_ports().first()?)
    }

    /// The slot of `key`, as the cluster computes it.
    pub fn key_slot(&self, key: &str) -> u16 {
        let port = *self.live_ports().first().expect("a running node of the cluster");
        self.query_node(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
            .unwrap_or_else(|| panic!("CLUSTER KEYSLOT {key} on node {port}"))
    }

    /// The master serving `slot` (waiting while none does, during a failover).
    pub fn master_of(&self, slot: u16) -> ClusterNode {
        wait_for(DEADLINE, &format!("a master serving slot {slot}"), || self.try_master_of(slot))
    }

    fn try_master_of(&self, slot: u16) -> Option<ClusterNode> {
        self.topology()?.into_iter().find(|node| node.master && node.serves(slot))
    }

    /// The port of the master serving `key`'s slot.
    pub fn master_port_of(&self, key: &str) -> u16 {
        self.master_of(self.key_slot(key)).port
    }

    /// The port of a replica of the master on `master_port`.
    pub fn replica_port_of(&self, master_port: u16) -> u16 {
        let topology = self.topology().expect("the cluster's nodes");
        let master = topology.iter().find(|n| n.port == master_port).expect("the master in CLUSTER NODES");
        topology
            .iter()
            .find(|n| n.replica_of.as_ref() == Some(&master.id))
            .map(|n| n.port)
            .unwrap_or_else(|| panic!("the master on {master_port} has no replica: {topology:?}"))
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        self.node_mut(port).kill();
    }

    /// Starts the node on `port` again (it rejoins with the identity in its `nodes.conf`) and
    /// gives it the cluster's users.
    pub fn restart(&mut self, port: u16) {
        self.node_mut(port).restart();
        self.apply_users(port);
    }

    /// Waits until the node on `port` has been promoted to master and every running node reports
    /// the cluster ok again with all slots served.
    pub fn wait_until_promoted(&self, port: u16) {
        wait_for(DEADLINE, &format!("the node on {port} to be promoted"), || {
            let role: Option<Vec<redis::Value>> = self.query_node(port, &redis::cmd("ROLE"));
            matches!(role.as_deref(), Some([redis::Value::BulkString(r), ..]) if r.as_slice() == b"master")
                .then_some(())
        });
        let live = self.live_ports();
        let slots = format!("cluster_slots_ok:{SLOTS}");
        wait_for(DEADLINE, "the cluster to be ok after the failover", || {
            live.iter()
                .all(|&p| {
                    self.query_node::<String>(p, redis::cmd("CLUSTER").arg("INFO"))
                        .is_some_and(|info| info.contains("cluster_state:ok") && info.contains(&slots))
                })
                .then_some(())
        });
    }

    /// Waits until the master on `port` has replicated everything written so far to a replica,
    /// so that killing it loses nothing the test wrote itself.
    pub fn wait_replicated(&self, port: u16) {
        let mut connection = self.node(port).connection();
        wait_for(DEADLINE, "writes replicated", || {
            let acked: i64 = redis::cmd("WAIT")
                .arg(1)
                .arg(1000)
                .query(&mut connection)
                .unwrap_or_else(|e| panic!("WAIT on node {port}: {e}"));
            (acked >= 1).then_some(())
        });
    }

    /// `CLUSTER NODES` of every running node and the tail of its log, for a failing wait.
    fn dump(&self) -> String {
        self.nodes
            .iter()
            .filter(|node| node.is_running())
            .map(|node| {
                let text: String = self.query_node(node.port, redis::cmd("CLUSTER").arg("NODES")).unwrap_or_default();
                let log = node.log();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- seen by {}:\n{text}--- its log:\n{}\n", node.port, tail.join("\n"))
            })
            .collect()
    }

    /// Kills the master serving `slot` (SIGKILL), waits until its replica took over, then starts
    /// it again (it rejoins as the new master's replica) and waits for the cluster to be whole.
    pub fn fail_over(&mut self, slot: u16) {
        let old = self.master_of(slot);
        self.kill(old.port);
        let mut looked = Instant::now();
        wait_for(DEADLINE, "the replica to take the slots over", || {
            if looked.elapsed() > Duration::from_secs(5) {
                eprintln!("still waiting for a failover of slot {slot} (master {} killed):\n{}", old.port, self.dump());
                looked = Instant::now();
            }
            let master = self.try_master_of(slot)?;
            (master.port != old.port
                && self.node(master.port).info_field("replication", "role").as_deref() == Some("master"))
            .then_some(())
        });
        self.restart(old.port);
        self.wait_healthy();
    }

    /// Moves `slot` (and the keys in it) from its master to another master, the way `redis-cli
    /// --cluster reshard` does: IMPORTING/MIGRATING, MIGRATE of the keys, then the new owner.
    /// `between` runs while the keys have moved and the slot is still migrating, when writes to
    /// the old owner are answered with ASK. Returns the new owner's port.
    pub fn migrate_slot(&self, slot: u16, between: impl FnOnce(u16)) -> u16 {
        let source = self.master_of(slot);
        let topology = self.topology().expect("the cluster's nodes");
        let target = topology
            .iter()
            .find(|node| node.master && !node.slots.is_empty() && node.id != source.id)
            .expect("another master to migrate to");
        let mut at_source = self.node(source.port).connection();
        let mut at_target = self.node(target.port).connection();
        let setslot = |connection: &mut redis::Connection, args: &[&str]| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(args);
            cmd.exec(connection).unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {args:?}: {e}"));
        };
        setslot(&mut at_target, &["IMPORTING", &source.id]);
        setslot(&mut at_source, &["MIGRATING", &target.id]);
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut at_source)
                .unwrap_or_else(|e| panic!("CLUSTER GETKEYSINSLOT {slot}: {e}"));
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate.arg("127.0.0.1").arg(target.port).arg("").arg(0).arg(5000).arg("KEYS").arg(&keys);
            migrate.exec(&mut at_source).unwrap_or_else(|e| panic!("MIGRATE {keys:?} to {}: {e}", target.port));
        }
        between(target.port);
        for node in topology.iter().filter(|node| node.master && !node.slots.is_empty()) {
            if let Some(mut connection) = self.node(node.port).try_connection(Duration::from_secs(2)) {
                setslot(&mut connection, &["NODE", &target.id]);
            }
        }
        target.port
    }

    /// Entries of `stream` on the node at `port`, oldest first, after ASKING: a node importing
    /// the stream's slot answers for it only then.
    pub fn entries_at(&self, port: u16, stream: &str) -> Vec<HashMap<String, String>> {
        let mut pipe = redis::pipe();
        pipe.cmd("ASKING").ignore().cmd("XRANGE").arg(stream).arg("-").arg("+");
        let (reply,): (Vec<Entry>,) = pipe
            .query(&mut self.node(port).connection())
            .unwrap_or_else(|e| panic!("XRANGE {stream} on node {port}: {e}"));
        reply.into_iter().map(|(_, fields)| fields.into_iter().collect()).collect()
    }

    /// Keys in `slot` on the node at `port`.
    pub fn keys_in_slot_at(&self, port: u16, slot: u16) -> i64 {
        self.node(port).query(redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot))
    }
}

impl StreamStore for RedisCluster {
    fn stream_keys(&self) -> Vec<String> {
        let topology = self.topology().expect("the cluster's nodes");
        let mut keys: Vec<String> = topology
            .iter()
            .filter(|node| node.master && !node.slots.is_empty())
            .flat_map(|node| stream_keys_on(&mut self.node(node.port).connection()))
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }

    fn entries(&self, stream: &str) -> Vec<HashMap<String, String>> {
        self.entries_at(self.master_of(self.key_slot(stream)).port, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_nodes, ClusterNode};

    #[test]
    fn cluster_nodes_lines_give_roles_slots_and_failures() {
        let text = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460 [5461->-b2]\r\n\
b2 127.0.0.1:7002@17002,host master - 0 0 2 connected 5461-10922 16383\r\n\
c3 127.0.0.1:7003@17003 master,fail - 0 0 3 connected\r\n\
d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected\r\n";
        let nodes = parse_nodes(text).expect("the lines parse");
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        assert_eq!(ports, [7001, 7002, 7003, 7004]);
        let masters: Vec<bool> = nodes.iter().map(|n| n.master).collect();
        assert_eq!(masters, [true, true, false, false], "a failed master is no master");
        let failing: Vec<bool> = nodes.iter().map(ClusterNode::is_failing).collect();
        assert_eq!(failing, [false, false, true, false]);
        assert_eq!(nodes[3].replica_of.as_deref(), Some("a1"));
        assert_eq!(nodes[0].slots, [(0, 5460)], "a slot being migrated is left out");
        assert_eq!(nodes[1].slots, [(5461, 10922), (16383, 16383)]);
        assert!(parse_nodes("a1 nonsense").is_none(), "a line without an address does not parse");
    }
}
