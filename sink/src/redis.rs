//! The Redis sink: publishing a batch as MULTI/EXEC blocks of XADDs to whichever topology the
//! settings name, and telling failures of Redis as a whole from rejections of one entry.
//!
//! - **Standalone**: one node; the whole batch is one MULTI/EXEC (split only around events that may
//!   be over Redis's argument limit, see `publish`).
//! - **Sentinel**: the same, with the master found by asking the sentinels at every (re)connect.
//! - **Cluster**: the batch is split by hash slot, since a MULTI/EXEC may touch one slot only;
//!   each slot's events are one MULTI/EXEC block, and each master gets its blocks in one pipeline,
//!   all masters at once. MOVED updates the slot map and sends the block to the node named; ASK
//!   sends it there once, after ASKING. An aggregate's events in a round all go to one stream key
//!   (`relay::publish` defers the rest to the next round), hence to one block, so splitting never reorders an aggregate.
//!
//! One file, longer than most: publishing to each topology (one node, a Sentinel's master, a
//! Cluster's masters with MOVED and ASK), sending a batch now and landing it later, and the check for
//! lost entries all share the sink's connections, its slot map and the rule of when a connection can
//! no longer be trusted; split, that state would be spread over files that each change it.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use redis::ConnectionInfo;

pub use super::address::redact_url;
use super::address::{at_node, describe_target, node_infos};
use super::cluster::{key_slot, NodeAddr, SlotMap};
use super::marks::{self, last_generated_ids, LastIdError, Loss, Mark, Marks, Query, CHECK_CHUNK};
use super::node::{self, BlockReply, Pipeline, Redirect};
use super::sentinel;
pub use super::{BrokerError, EntryOutcome, RedisConfig, RedisMode, TlsFiles};
use crate::entry::{EntryFormat, EntrySettings, OutboxEvent};

/// Redis's default `proto-max-bulk-len` (512 MB): the most any event may carry in one argument.
const DEFAULT_MAX_ARGUMENT: u64 = 512 * 1024 * 1024;
/// The smallest `proto-max-bulk-len` Redis can be configured with (1 MB): with the limit unknown,
/// an event with a longer argument might be over it.
const SMALLEST_MAX_ARGUMENT: u64 = 1024 * 1024;
/// Redirections followed for one block within one exchange (a slot moving twice while being sent
/// is already rare; more means the cluster's view is in flux, which the backoff rides out).
const MAX_REDIRECTIONS: usize = 5;

/// A lazily (re)connected Redis, of the configured topology.
pub struct RedisSink {
    config: Option<RedisConfig>,
    /// Standalone or Sentinel: the connection to the node (the master) in use.
    single: Option<redis::Connection>,
    /// Cluster: the slot map (`None` until read, and after a failure that may have moved slots)
    /// and a connection per master in use.
    slots: Option<SlotMap>,
    nodes: HashMap<NodeAddr, redis::Connection>,
    /// Redis's `proto-max-bulk-len`, the longest argument it accepts, as read at connect; `None`
    /// when the relay's user may not read the configuration (ACLs; managed services that disable
    /// CONFIG).
    max_argument: Option<u64>,
    /// The last entry ID written to each stream, checked against Redis after each new connection.
    marks: Marks,
    /// Losses the checks found, for the relay to report (`take_losses`).
    losses: Vec<Loss>,
    /// Redis refused `XINFO STREAM` (an ACL without it): losses cannot be noticed. Reported once.
    pub check_refused: Option<String>,
    /// How the checks ask Redis (`Query::Xinfo` once `EVAL` was refused).
    check_query: Query,
    /// What the server in use offers (learnt at connect: the node, or a Cluster's first master).
    capabilities: Option<node::Capabilities>,
    /// What the last connect learnt, when it differs from what was logged before: for the relay
    /// to log once (`take_capabilities_news`).
    capabilities_news: Option<String>,
    capabilities_logged: Option<node::Capabilities>,
    /// Streams trimmed by acknowledgement found holding more than `held_back_above` entries
    /// at the last check (a consumer group that stopped acknowledging holds them).
    held_back: HashMap<String, u64>,
    /// Changes of `held_back` for the relay to log: (stream, length, over the bound).
    held_back_news: Vec<(String, u64, bool)>,
    /// `outbox.stream_maxlen` while `outbox.stream_trim = 'acked'`, as the last publish was
    /// given it: the checks of the marks then note the streams a group holds over the bound.
    trim_watch: Option<u64>,
}

/// Entries beyond `outbox.stream_maxlen` that a stream trimmed by acknowledgement may hold before
/// the relay warns: as many again as the bound, plus 100 (the entries of a node of the stream with
/// Redis's default `stream-node-max-entries`, which an approximate trim may keep).
pub fn held_back_above(maxlen: u64) -> u64 {
    maxlen.saturating_mul(2).saturating_add(100)
}

impl Default for RedisSink {
    fn default() -> Self {
        Self::new()
    }
}

impl RedisSink {
    pub fn new() -> Self {
        RedisSink {
            config: None,
            single: None,
            slots: None,
            nodes: HashMap::new(),
            max_argument: None,
            marks: Marks::default(),
            losses: Vec::new(),
            check_refused: None,
            check_query: Query::default(),
            capabilities: None,
            capabilities_news: None,
            capabilities_logged: None,
            held_back: HashMap::new(),
            held_back_news: Vec::new(),
            trim_watch: None,
        }
    }

    /// Applies (possibly new) settings; a changed configuration drops every connection so the next
    /// publish connects with the new one.
    pub fn configure(&mut self, config: RedisConfig) {
        if self.config.as_ref() != Some(&config) {
            // Another Redis (or database number), as the marks name it: the same servers reached
            // with other credentials (a rotated password, a user of their own) are not elsewhere,
            // and the relay, which reloads stored marks only when this target changes, would
            // otherwise check nothing until it restarted.
            let before = self.config.is_some().then(|| self.marks_target());
            self.config = Some(config);
            if before.is_none_or(|before| before != self.marks_target()) {
                // What the relay knows of the streams of one Redis says nothing of another's.
                self.marks = Marks::default();
                self.losses.clear();
            }
            // The next connection tries every check again (`reconnected`).
            self.disconnect();
        }
    }

    fn disconnect(&mut self) {
        self.single = None;
        self.slots = None;
        self.nodes.clear();
    }

    /// Where this sink publishes, for log lines and `outbox.stream_marks.target`: hosts and
    /// ports only, never credentials, and the logical database when not 0 (a Cluster has only 0).
    /// The marks of one database say nothing of another's, on the same server or not, and a
    /// reload that moves the relay to another database is logged like one that moves its server.
    pub fn describe(&self) -> String {
        let Some(config) = &self.config else { return "(unconfigured)".into() };
        let nodes = describe_target(&config.url);
        let described = match config.mode {
            RedisMode::Standalone => nodes,
            RedisMode::Sentinel => format!("master \"{}\" of sentinels {nodes}", config.sentinel_master),
            RedisMode::Cluster => return format!("cluster {nodes}"),
        };
        let db = node_infos(&config.url, None)
            .ok()
            .and_then(|nodes| nodes.first().map(|info| info.redis_settings().db()))
            .unwrap_or(0);
        if db == 0 {
            described
        } else {
            format!("{described} db {db}")
        }
    }

    /// Which Redis deployment the stream marks are of (`outbox.stream_marks.target`).
    pub fn marks_target(&self) -> String {
        self.describe()
    }

    /// Streams whose marks were forgotten to stay within `MAX_STREAMS` (sink/src/marks.rs).
    pub fn marks_forgotten(&self) -> u64 {
        self.marks.forgotten
    }

    pub fn is_connected(&self) -> bool {
        self.single.is_some() || !self.nodes.is_empty()
    }

    fn config(&self) -> Result<&RedisConfig, BrokerError> {
        self.config.as_ref().ok_or_else(|| BrokerError("outbox.redis_url is not set".into()))
    }

    /// Every node the URL names, parsed, with the password file applied.
    fn listed_nodes(config: &RedisConfig) -> Result<Vec<ConnectionInfo>, BrokerError> {
        node_infos(&config.url, config.password_file.as_deref())
    }

    /// The Standalone or Sentinel connection, connected if needed.
    fn single(&mut self) -> Result<&mut redis::Connection, BrokerError> {
        if self.single.is_none() {
            let config = self.config()?;
            let nodes = Self::listed_nodes(config)?;
            let mut connection = match config.mode {
                RedisMode::Sentinel => {
                    if config.sentinel_master.is_empty() {
                        return Err(BrokerError(
                            "outbox.redis_mode is sentinel but outbox.redis_sentinel_master is empty".into(),
                        ));
                    }
                    let (host, port) =
                        sentinel::master_address(&nodes, &config.sentinel_master, config.timeout, &config.tls)?;
                    sentinel::connect_master(&nodes[0], &host, port, config.timeout, &config.tls)?
                }
                _ => {
                    if nodes.len() != 1 {
                        return Err(BrokerError(format!(
                            "outbox.redis_url names {} nodes; list several only with outbox.redis_mode = sentinel or cluster",
                            nodes.len()
                        )));
                    }
                    let info = nodes.into_iter().next().ok_or_else(|| BrokerError("no Redis node".into()))?;
                    node::connect(info, config.timeout, &config.tls)?
                }
            };
            self.max_argument = node::max_argument(&mut connection);
            self.learnt(node::capabilities(&mut connection));
            self.single = Some(connection);
            self.reconnected();
        }
        // The branch above either filled the slot or returned.
        self.single.as_mut().ok_or_else(|| BrokerError("no connection".into()))
    }

    /// A new connection: the marks are checked again, and a check Redis refused (an ACL without
    /// `+xinfo|stream`, or `EVAL` denied) is tried again, so that a grant takes effect at the next
    /// connection rather than at the relay's restart.
    fn reconnected(&mut self) {
        self.marks.reconnected();
        self.check_refused = None;
        self.check_query = Query::default();
    }

    /// The connection to cluster node `addr`, connected if needed.
    fn node(&mut self, addr: &NodeAddr) -> Result<&mut redis::Connection, BrokerError> {
        if !self.nodes.contains_key(addr) {
            let config = self.config()?;
            let template =
                Self::listed_nodes(config)?.into_iter().next().ok_or_else(|| BrokerError("no Redis node".into()))?;
            let mut connection = node::connect(at_node(&template, &addr.host, addr.port), config.timeout, &config.tls)?;
            if self.nodes.is_empty() {
                self.max_argument = node::max_argument(&mut connection);
                self.learnt(node::capabilities(&mut connection));
            }
            self.nodes.insert(addr.clone(), connection);
            self.reconnected();
        }
        self.nodes.get_mut(addr).ok_or_else(|| BrokerError("no connection".into()))
    }

    fn learnt(&mut self, capabilities: node::Capabilities) {
        if self.capabilities_logged.as_ref() != Some(&capabilities) {
            self.capabilities_news =
                Some(format!("{} at {}: {}", capabilities.server(), self.describe(), capabilities.offers()));
            self.capabilities_logged = Some(capabilities.clone());
        }
        self.capabilities = Some(capabilities);
    }

    /// What the relay will use of the server, once per server (or change of it) for the log.
    pub fn take_capabilities_news(&mut self) -> Option<String> {
        self.capabilities_news.take()
    }

    /// Refuses to publish when the settings ask for what the server does not offer: with
    /// `outbox.stream_trim = 'acked'`, an older Redis would otherwise trim by length, i.e. drop
    /// entries a consumer group has not read. A refusal of Redis as a whole: nothing is published,
    /// nothing dead-lettered, and the relay retries with backoff until the server or the setting
    /// changes.
    fn check_trim(&mut self, entries: &EntrySettings) -> Result<(), BrokerError> {
        if !entries.trim_acked || entries.maxlen.is_none() {
            return Ok(());
        }
        let Some(capabilities) = &self.capabilities else { return Ok(()) };
        if capabilities.acked_trim {
            return Ok(());
        }
        let server = capabilities.server();
        let unknown = capabilities.unknown.clone();
        if unknown.is_some() {
            // Asked again at the next connect: a permission granted meanwhile takes effect then.
            self.disconnect();
        }
        Err(BrokerError(match &unknown {
            Some(why) => format!(
                "outbox.stream_trim = 'acked' needs XADD ... ACKED (Redis 8.2 or later), and whether {server} offers it is unknown: \
                 COMMAND DOCS XADD was refused ({why}); grant the relay's Redis user +command|docs. \
                 Nothing is published, nor trimmed by length, until then"
            ),
            None => format!(
                "outbox.stream_trim = 'acked' needs XADD ... ACKED (Redis 8.2 or later), which {server} does not offer: \
                 nothing is published, nor trimmed by length, until Redis is upgraded or outbox.stream_trim is 'length'"
            ),
        }))
    }

    /// Reads the slot map from the first node that answers: masters already connected, then the
    /// seed nodes of the URL.
    fn refresh_slots(&mut self) -> Result<(), BrokerError> {
        let config = self.config()?.clone();
        let mut failures = Vec::new();
        let connected: Vec<NodeAddr> = self.nodes.keys().cloned().collect();
        let seeds: Vec<NodeAddr> = Self::listed_nodes(&config)?
            .iter()
            .filter_map(|info| match info.addr() {
                redis::ConnectionAddr::Tcp(host, port) | redis::ConnectionAddr::TcpTls { host, port, .. } => {
                    Some(NodeAddr { host: host.clone(), port: *port })
                }
                _ => None,
            })
            .collect();
        if seeds.is_empty() {
            return Err(BrokerError("outbox.redis_mode = cluster needs host:port nodes in outbox.redis_url".into()));
        }
        for addr in connected.into_iter().chain(seeds) {
            let reply = self
                .node(&addr)
                .and_then(|connection| {
                    redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query::<redis::Value>(connection)
                        .map_err(|e| BrokerError(node::describe_error(&e)))
                })
                .and_then(|reply| SlotMap::from_cluster_slots(&reply, &addr.host).map_err(BrokerError));
            match reply {
                Ok(map) => {
                    // Connections to nodes that are no longer masters are of no use.
                    let masters = map.masters();
                    self.nodes.retain(|node, _| masters.contains(node));
                    self.slots = Some(map);
                    return Ok(());
                }
                Err(error) => {
                    self.nodes.remove(&addr);
                    failures.push(format!("{addr}: {error}"));
                }
            }
        }
        Err(BrokerError(format!("cannot read the cluster's slot map from any node: {}", failures.join("; "))))
    }

    /// XADDs every event to its stream and reports, per event and in the same order, whether Redis
    /// stored it. `Err` means the batch's fate is unknown (connection lost, or no complete answer
    /// within `outbox.redis_timeout`): treat every entry as not published; some may be, which is
    /// the at-least-once duplicate consumers deduplicate by `event_id`.
    ///
    /// MULTI/EXEC makes a failure of Redis as a whole all-or-nothing for a block: Redis refuses
    /// to queue a write while out of memory (or loading, or read-only), and then discards the
    /// whole transaction. Without it, an OOM that starts or ends in the middle of a pipeline
    /// would store later events of an aggregate while refusing earlier ones. Errors an entry
    /// causes itself (WRONGTYPE) still come back per entry from EXEC.
    pub fn publish(
        &mut self,
        events: &[OutboxEvent],
        entries: &EntrySettings,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let _quiet = node::SignalsDeferred::new();
        // Connect first: that is where the size limit below is learnt.
        self.connect_any()?;
        self.check_trim(entries)?;
        self.trim_watch = entries.maxlen.filter(|_| entries.trim_acked);
        self.check_marks(&stream_keys(events, entries))?;
        let (mut outcomes, sendable) = refuse_oversized(events, self.max_argument.unwrap_or(DEFAULT_MAX_ARGUMENT));
        // With the limit unknown, an event that may be over it is sent in an exchange of its own,
        // so that if Redis closes the connection on it, the failure points at that event.
        let suspect_above = if self.max_argument.is_none() { Some(SMALLEST_MAX_ARGUMENT) } else { None };
        let mut held_back: Vec<(&str, &str)> = Vec::new();
        let segments = segments(events, &sendable, suspect_above);
        for (position, segment) in segments.iter().enumerate() {
            let segment: Vec<usize> =
                segment.iter().copied().filter(|&i| !held_back.contains(&aggregate_of(&events[i]))).collect();
            if segment.is_empty() {
                continue;
            }
            let lone_suspect = segment.len() == 1
                && suspect_above.is_some_and(|limit| events[segment[0]].largest_argument().1 as u64 > limit);
            match self.exchange_segment(events, &segment, entries) {
                Ok(sent) => {
                    for (index, outcome) in segment.into_iter().zip(sent) {
                        // A later part must not overtake an event that did not go through.
                        if matches!(outcome, EntryOutcome::Rejected(_) | EntryOutcome::NotSent) {
                            held_back.push(aggregate_of(&events[index]));
                        }
                        outcomes[index] = outcome;
                    }
                }
                Err(error) if lone_suspect && self.answers_ping() => {
                    // Redis is fine, yet it dropped the connection on this event: its size.
                    let index = segment[0];
                    let (field, len) = events[index].largest_argument();
                    outcomes[index] = EntryOutcome::Rejected(format!(
                        "Redis closed the connection while receiving this event ({field} of {len} bytes): \
                         larger than its proto-max-bulk-len? ({error})"
                    ));
                    held_back.push(aggregate_of(&events[index]));
                }
                Err(error) if position == 0 => return Err(error),
                Err(error) => {
                    // Redis failed as a whole after earlier parts went through: keep what was
                    // published, and return this part and the rest (whose fate is unknown or
                    // which were not sent) with the error.
                    for later in &segments[position..] {
                        for &index in later {
                            if outcomes[index] == EntryOutcome::NotSent {
                                outcomes[index] = EntryOutcome::BrokerRefused(error.0.clone());
                            }
                        }
                    }
                    return Ok(outcomes);
                }
            }
        }
        Ok(outcomes)
    }

    /// Connects to some node (the master, or a cluster node through the slot map), so that the
    /// argument limit is known before a batch is split.
    fn connect_any(&mut self) -> Result<(), BrokerError> {
        match self.config()?.mode {
            RedisMode::Cluster => {
                if self.slots.is_none() {
                    self.refresh_slots()?;
                }
                if self.nodes.is_empty() {
                    let first = self.slots.as_ref().and_then(|map| map.masters().into_iter().next());
                    let first = first.ok_or_else(|| BrokerError("the cluster's slot map names no master".into()))?;
                    self.node(&first)?;
                }
                Ok(())
            }
            _ => self.single().map(|_| ()),
        }
    }

    /// One exchange of the events at `indexes`, their outcomes in the same order.
    fn exchange_segment(
        &mut self,
        events: &[OutboxEvent],
        indexes: &[usize],
        entries: &EntrySettings,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        let config = self.config()?;
        let (mode, timeout, wait_replicas) = (config.mode, config.timeout, config.wait_replicas);
        let deadline = Instant::now() + timeout;
        let keys: Vec<String> = indexes.iter().map(|&i| events[i].stream_key(&entries.stream_template)).collect();
        let xadd = Xadd::new(entries);
        let write = |pipeline: &mut Pipeline, position: usize| {
            xadd.write(pipeline, &events[indexes[position]], &keys[position])
        };
        if mode != RedisMode::Cluster {
            let pipeline = single_pipeline(events, indexes, &keys, &xadd, wait_replicas, timeout);
            let connection = self.single()?;
            let exchanged = pipeline.send(connection).and_then(|_| pipeline.receive(connection, deadline));
            let outcomes = self.single_outcomes(exchanged)?;
            self.note_written(&keys, &outcomes);
            return Ok(outcomes);
        }

        // Cluster: one block per slot, in order of first appearance (positions within a block keep
        // the batch's order).
        let mut blocks: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut block_of_slot: HashMap<u16, usize> = HashMap::new();
        for (position, key) in keys.iter().enumerate() {
            let slot = key_slot(key.as_bytes());
            let block = *block_of_slot.entry(slot).or_insert_with(|| {
                blocks.push((slot, Vec::new()));
                blocks.len() - 1
            });
            blocks[block].1.push(position);
        }
        if self.slots.is_none() {
            self.refresh_slots()?;
        }
        // Where each block goes: (node, after ASKING).
        let mut routes: Vec<(NodeAddr, bool)> = Vec::with_capacity(blocks.len());
        for (slot, _) in &blocks {
            let master = self.slots.as_ref().and_then(|map| map.master_of(*slot)).cloned();
            let master = master.ok_or_else(|| {
                self.slots = None;
                BrokerError(format!("no master serves hash slot {slot} (is the cluster fully covered?)"))
            })?;
            routes.push((master, false));
        }
        let mut outcomes = vec![EntryOutcome::NotSent; indexes.len()];
        let mut pending: Vec<usize> = (0..blocks.len()).collect();
        for _ in 0..=MAX_REDIRECTIONS {
            let mut by_node: BTreeMap<NodeAddr, Vec<usize>> = BTreeMap::new();
            for &block in &pending {
                by_node.entry(routes[block].0.clone()).or_default().push(block);
            }
            // Send to every master first, then read every reply: the masters work in parallel.
            let mut sent: Vec<(NodeAddr, Vec<usize>, Pipeline)> = Vec::new();
            for (addr, node_blocks) in by_node {
                let mut pipeline = Pipeline::default();
                for &block in &node_blocks {
                    pipeline.begin_block(routes[block].1);
                    for &position in &blocks[block].1 {
                        write(&mut pipeline, position);
                    }
                    pipeline.end_block();
                }
                pipeline.wait(wait_replicas, timeout / 2);
                let result = self.node(&addr).and_then(|connection| pipeline.send(connection));
                if let Err(error) = result {
                    self.lost_node(&addr);
                    for (addr, ..) in &sent {
                        self.nodes.remove(addr);
                    }
                    return Err(BrokerError(format!("{addr}: {error}")));
                }
                sent.push((addr, node_blocks, pipeline));
            }
            let mut redirected = Vec::new();
            let mut failure = None;
            for (addr, node_blocks, pipeline) in sent {
                let exchanged = match self.nodes.get_mut(&addr) {
                    Some(connection) => pipeline.receive(connection, deadline),
                    None => Err(BrokerError("connection lost".into())),
                };
                match exchanged {
                    Ok(exchanged) => {
                        if exchanged.connection_closed {
                            self.nodes.remove(&addr);
                        }
                        for (block, reply) in node_blocks.into_iter().zip(exchanged.blocks) {
                            match reply {
                                BlockReply::Outcomes(block_outcomes) => {
                                    for (&position, outcome) in blocks[block].1.iter().zip(block_outcomes) {
                                        outcomes[position] = outcome;
                                    }
                                }
                                BlockReply::Redirected(redirect) => {
                                    routes[block] = self.follow(&redirect);
                                    redirected.push(block);
                                }
                            }
                        }
                    }
                    Err(error) => {
                        // Keep reading the other masters (their replies are in flight), then fail.
                        self.lost_node(&addr);
                        failure.get_or_insert(BrokerError(format!("{addr}: {error}")));
                    }
                }
            }
            if let Some(error) = failure {
                return Err(error);
            }
            if redirected.is_empty() {
                self.note_written(&keys, &outcomes);
                return Ok(outcomes);
            }
            pending = redirected;
        }
        self.slots = None;
        Err(BrokerError(format!(
            "Redis Cluster kept redirecting the batch ({MAX_REDIRECTIONS} times): slots are moving; retrying"
        )))
    }

    /// Records the entry IDs Redis returned, as the marks of their streams (`keys` and `outcomes`
    /// in the same order).
    fn note_written(&mut self, keys: &[String], outcomes: &[EntryOutcome]) {
        for (key, outcome) in keys.iter().zip(outcomes) {
            if let EntryOutcome::Published(Some(id)) = outcome {
                self.marks.wrote(key, *id);
            }
        }
    }

    /// Notes the streams an unacknowledging group holds over the bound, and those back under it.
    fn note_lengths(&mut self, found: &[(String, Option<marks::Found>)], maxlen: u64) {
        for (stream, now) in found {
            let length = now.as_ref().map_or(0, |now| now.length);
            let over = length > held_back_above(maxlen);
            if over != self.held_back.contains_key(stream) {
                self.held_back_news.push((stream.clone(), length, over));
            }
            if over {
                self.held_back.insert(stream.clone(), length);
            } else {
                self.held_back.remove(stream);
            }
        }
    }

    /// Streams trimmed by acknowledgement that went over `held_back_above` (true) or came back
    /// under it (false) since the last call, with their length then.
    pub fn take_held_back_news(&mut self) -> Vec<(String, u64, bool)> {
        std::mem::take(&mut self.held_back_news)
    }

    /// The losses found since the last call (sink/src/marks.rs).
    pub fn take_losses(&mut self) -> Vec<Loss> {
        std::mem::take(&mut self.losses)
    }

    /// Losses `take_losses` handed out that could not be recorded.
    pub fn restore_losses(&mut self, losses: Vec<Loss>) {
        self.losses.extend(losses);
    }

    /// The marks moved since the last call, for the relay to store.
    pub fn take_dirty_marks(&mut self) -> Vec<(String, Mark)> {
        self.marks.take_dirty()
    }

    /// Marks `take_dirty_marks` handed out that were not stored (their transaction failed).
    pub fn marks_not_stored(&mut self, marks: Vec<(String, Mark)>) {
        self.marks.not_stored(marks.into_iter().map(|(stream, _)| stream));
    }

    /// Marks stored earlier (by this relay's predecessor or another relay of the database).
    pub fn adopt_marks(&mut self, stored: Vec<(String, Mark)>) {
        self.marks.adopt(stored);
    }

    /// While a pass over the marks is under way or due (sink/src/marks.rs: every `CHECK_EVERY`),
    /// checks its next chunk of streams on the connection already open (a new one begins the pass
    /// again); whether streams are left. For the turns of a relay with nothing to publish, so that
    /// an idle relay notices a loss too. A failure drops the connection (the next round connects
    /// anew, and checks again).
    pub fn check_between_rounds(&mut self) -> bool {
        if !(self.marks.checking() || self.marks.check_due()) || !self.is_connected() {
            return false;
        }
        let _quiet = node::SignalsDeferred::new();
        self.check_marks(&[]).is_ok() && self.marks.checking()
    }

    /// When a check of the marks is due (a new connection, or `CHECK_EVERY` since the last pass),
    /// asks Redis about the streams of the pass that `writing` (the keys the caller is about to
    /// write to) names, and `CHECK_CHUNK` more, `CHECK_CHUNK` per exchange, and keeps the losses
    /// found. Runs before anything is written: a write to a stream Redis lost would create it
    /// again with a later ID and hide the loss. The rest of the pass waits for the next rounds, so
    /// that a pass over thousands of streams delays no round by more than a chunk's exchange
    /// (beyond the streams the round itself writes to). `Err` only when Redis fails as a whole.
    fn check_marks(&mut self, writing: &[String]) -> Result<(), BrokerError> {
        if !self.marks.check_due() || self.check_refused.is_some() {
            return Ok(());
        }
        let streams = self.marks.streams_to_check(writing.iter().map(String::as_str), CHECK_CHUNK);
        let mode = self.config()?.mode;
        let mut found = Vec::with_capacity(streams.len());
        let mut chunks = streams.chunks(CHECK_CHUNK);
        let mut chunk = chunks.next();
        while let Some(streams) = chunk {
            let query = self.check_query;
            let (asked, node) = if mode == RedisMode::Cluster {
                // One stream at a time, at its master.
                let stream = &streams[..1];
                let slot = key_slot(stream[0].as_bytes());
                let master = self.slots.as_ref().and_then(|map| map.master_of(slot)).cloned();
                let Some(master) = master else {
                    // No slot map to ask by: the pass begins again once there is one.
                    self.marks.reconnected();
                    return Ok(());
                };
                (last_generated_ids(self.node(&master)?, stream, query), Some(master))
            } else {
                (last_generated_ids(self.single()?, streams, query), None)
            };
            match asked {
                Ok(mut ids) => found.append(&mut ids),
                Err(LastIdError::NoScript(_)) if query == Query::Script => {
                    // Ask XINFO STREAM itself from now on; the same chunk again.
                    self.check_query = Query::Xinfo;
                    continue;
                }
                Err(LastIdError::Refused(error) | LastIdError::NoScript(error)) => {
                    self.check_refused = Some(error);
                    return Ok(());
                }
                Err(LastIdError::Failed(error)) => {
                    match node {
                        Some(master) => self.lost_node(&master),
                        None => self.single = None,
                    }
                    return Err(error);
                }
            }
            chunk = if mode == RedisMode::Cluster && streams.len() > 1 { Some(&streams[1..]) } else { chunks.next() };
        }
        match self.trim_watch {
            Some(maxlen) => self.note_lengths(&found, maxlen),
            None => self.held_back.clear(),
        }
        let losses = self.marks.compare(found);
        let lost = losses.len();
        self.losses.extend(losses);
        if lost > 0 && self.config()?.replay_losses_first {
            // Nothing more is written before the relays have replayed what Redis lost, so that
            // the replayed events come before later ones in their streams (src/relay/worker.rs).
            return Err(BrokerError(format!(
                "Redis lost entries of {lost} streams it had acknowledged; the relays replay them before anything else (outbox.replay_on_loss)"
            )));
        }
        Ok(())
    }

    /// The outcomes of a single node's exchange; a connection whose stream can no longer be
    /// trusted is dropped.
    fn single_outcomes(
        &mut self,
        exchanged: Result<node::Exchanged, BrokerError>,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        if !matches!(&exchanged, Ok(sent) if !sent.connection_closed) {
            // Replies may still be in flight, or Redis closed the connection after a protocol
            // error: this connection's stream can no longer be trusted.
            self.single = None;
        }
        match exchanged?.blocks.pop() {
            Some(BlockReply::Outcomes(outcomes)) => Ok(outcomes),
            Some(BlockReply::Redirected(redirect)) => {
                self.single = None;
                Err(BrokerError(format!(
                    "Redis answered {} for slot {} (served by {}:{}): it is a Redis Cluster node; set outbox.redis_mode = cluster",
                    if redirect.ask { "ASK" } else { "MOVED" },
                    redirect.slot,
                    redirect.host,
                    redirect.port
                )))
            }
            None => Err(BrokerError("Redis sent no reply for the batch".into())),
        }
    }

    /// Sends a batch and returns without reading the replies, so that the relay can read its next
    /// round while Redis executes this one (`publish_end` reads them). Only a batch that is one
    /// exchange with one node is sent now: a Cluster's, or one split around events that may be
    /// over Redis's argument limit, is sent whole by `publish_end`, as `publish` does.
    pub fn publish_begin(&mut self, events: &[OutboxEvent], entries: &EntrySettings) -> Result<Sent, BrokerError> {
        if events.is_empty() || self.config()?.mode == RedisMode::Cluster {
            return Ok(Sent(None));
        }
        let _quiet = node::SignalsDeferred::new();
        self.connect_any()?;
        self.check_trim(entries)?;
        self.trim_watch = entries.maxlen.filter(|_| entries.trim_acked);
        self.check_marks(&stream_keys(events, entries))?;
        let Some(max_argument) = self.max_argument else { return Ok(Sent(None)) };
        let (outcomes, sendable) = refuse_oversized(events, max_argument);
        let config = self.config()?;
        let (timeout, wait_replicas) = (config.timeout, config.wait_replicas);
        let keys: Vec<String> = sendable.iter().map(|&i| events[i].stream_key(&entries.stream_template)).collect();
        let pipeline = single_pipeline(events, &sendable, &keys, &Xadd::new(entries), wait_replicas, timeout);
        let connection = self.single()?;
        if let Err(error) = pipeline.send(connection) {
            self.single = None;
            return Err(error);
        }
        Ok(Sent(Some(InFlight { outcomes, sendable, keys, pipeline })))
    }

    /// Reads the replies of a batch `publish_begin` sent (or publishes it now, if it did not):
    /// the same outcomes `publish` gives. `events` are the ones given to `publish_begin`.
    pub fn publish_end(
        &mut self,
        sent: Sent,
        events: &[OutboxEvent],
        entries: &EntrySettings,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        let Some(InFlight { mut outcomes, sendable, keys, pipeline }) = sent.0 else {
            return self.publish(events, entries);
        };
        if sendable.is_empty() {
            return Ok(outcomes);
        }
        let _quiet = node::SignalsDeferred::new();
        // The deadline counts from now: the relay read its next round meanwhile.
        let deadline = Instant::now() + self.config()?.timeout;
        let exchanged = match self.single.as_mut() {
            Some(connection) => pipeline.receive(connection, deadline),
            None => Err(BrokerError("the connection to Redis was closed before the batch's replies were read".into())),
        };
        let sent = self.single_outcomes(exchanged)?;
        self.note_written(&keys, &sent);
        for (index, outcome) in sendable.into_iter().zip(sent) {
            outcomes[index] = outcome;
        }
        Ok(outcomes)
    }

    /// Where a redirected block goes next: MOVED also updates the slot map (until the next full
    /// read, which it schedules); ASK is for this once.
    fn follow(&mut self, redirect: &Redirect) -> (NodeAddr, bool) {
        let target = NodeAddr { host: redirect.host.clone(), port: redirect.port };
        if !redirect.ask {
            if let Some(map) = self.slots.as_mut() {
                map.moved(redirect.slot, target.clone());
            }
        }
        (target, redirect.ask)
    }

    /// A node failed (connection lost, timed out, refused): forget its connection, and the slot
    /// map, since a failover may be moving its slots to a replica.
    fn lost_node(&mut self, addr: &NodeAddr) {
        self.nodes.remove(addr);
        self.slots = None;
    }

    /// For a relay with nothing to publish, now and then: the connection its streams' marks
    /// concern is alive, or made anew. A Redis restarted while nothing is published is noticed
    /// here rather than at the next write: the new connection's loss check then runs between
    /// rounds (`check_between_rounds`), and `outbox.stats.redis_connected` says what is so. A
    /// relay that has written nothing yet has nothing to check and connects at its first write.
    /// `Err` (the connection dropped) when Redis does not answer.
    pub fn keep_alive(&mut self) -> Result<(), BrokerError> {
        if self.marks.is_empty() && !self.is_connected() {
            return Ok(());
        }
        self.connect_any()?;
        // Any reply proves the connection alive: a user without +ping gets NOPERM, not an outage.
        let ping = |connection: &mut redis::Connection| match redis::cmd("PING").query::<redis::Value>(connection) {
            Err(error) if error.code().is_none() => Err(BrokerError(node::describe_error(&error))),
            _ => Ok(()),
        };
        if let Some(connection) = self.single.as_mut() {
            if let Err(error) = ping(connection) {
                self.single = None;
                return Err(error);
            }
        }
        let nodes: Vec<NodeAddr> = self.nodes.keys().cloned().collect();
        for addr in nodes {
            let Some(connection) = self.nodes.get_mut(&addr) else { continue };
            if let Err(error) = ping(connection) {
                self.lost_node(&addr);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Whether Redis answers a PING on a fresh connection.
    fn answers_ping(&mut self) -> bool {
        self.disconnect();
        if self.connect_any().is_err() {
            return false;
        }
        let ping = |connection: &mut redis::Connection| redis::cmd("PING").query::<String>(connection).is_ok();
        match (&mut self.single, self.nodes.values_mut().next()) {
            (Some(connection), _) | (None, Some(connection)) => ping(connection),
            _ => false,
        }
    }
}

/// A batch `publish_begin` sent, its replies unread; `None` when it was not sent yet.
pub struct Sent(Option<InFlight>);

struct InFlight {
    /// Outcomes decided before sending (events refused for their size), the rest NotSent.
    outcomes: Vec<EntryOutcome>,
    /// The events sent, in the pipeline's order, and their stream keys.
    sendable: Vec<usize>,
    keys: Vec<String>,
    pipeline: Pipeline,
}

/// What an XADD takes in a pipeline beyond its event's variable texts (`single_pipeline`'s
/// estimate): its command and field names, event id, timestamp, numbers and RESP framing.
const ENTRY_FIXED_BYTES: usize = 384;

/// The one MULTI/EXEC block of a single node's exchange: the events at `indexes` to their `keys`,
/// and the WAIT for replicas when asked.
fn single_pipeline(
    events: &[OutboxEvent],
    indexes: &[usize],
    keys: &[String],
    xadd: &Xadd,
    wait_replicas: u32,
    timeout: std::time::Duration,
) -> Pipeline {
    // The variable parts of each entry, and a generous allowance for its field names, ids,
    // timestamp and RESP framing.
    let estimate: usize = indexes
        .iter()
        .zip(keys)
        .map(|(&index, key)| {
            let event = &events[index];
            ENTRY_FIXED_BYTES
                + key.len()
                + event.payload.len()
                + event.headers.as_ref().map_or(0, String::len)
                + event.aggregate_type.len()
                + event.aggregate_id.len()
                + event.event_type.len()
        })
        .sum();
    let mut pipeline = Pipeline::with_capacity(estimate + 64);
    pipeline.begin_block(false);
    for (&index, key) in indexes.iter().zip(keys) {
        xadd.write(&mut pipeline, &events[index], key);
    }
    pipeline.end_block();
    pipeline.wait(wait_replicas, timeout / 2);
    pipeline
}

/// How an exchange writes each event's XADD: `MAXLEN ~ maxlen` when trimming (`ACKED MAXLEN =
/// maxlen` when trimming only what every group acknowledged), the fields in the entry format.
struct Xadd<'a> {
    maxlen: Option<String>,
    acked: bool,
    format: &'a EntryFormat,
}

impl<'a> Xadd<'a> {
    fn new(entries: &'a EntrySettings) -> Self {
        Xadd { maxlen: entries.maxlen.map(|n| n.to_string()), acked: entries.trim_acked, format: &entries.format }
    }

    /// Writes the XADD of `event` to `key` into the pipeline.
    fn write(&self, pipeline: &mut Pipeline, event: &OutboxEvent, key: &str) {
        let acked = self.acked && self.maxlen.is_some();
        let trim = if self.maxlen.is_some() { 3 + usize::from(acked) } else { 0 };
        pipeline.entry(3 + trim + 2 * event.field_count(self.format));
        pipeline.arg(b"XADD");
        pipeline.arg(key.as_bytes());
        if let Some(maxlen) = &self.maxlen {
            if acked {
                pipeline.arg(b"ACKED");
            }
            pipeline.arg(b"MAXLEN");
            // Exact with ACKED: Redis 8.2.3 trims nothing at all with `ACKED MAXLEN ~`, not even a
            // stream without groups (checked with redis-cli; the same XADD without ACKED trims).
            pipeline.arg(if acked { b"=" } else { b"~" });
            pipeline.arg(maxlen.as_bytes());
        }
        pipeline.arg(b"*");
        event.for_each_field(self.format, |field, value| {
            pipeline.arg(field.as_bytes());
            pipeline.arg(value.as_bytes());
        });
    }
}

/// The streams `events` go to (a loss check looks at those first).
fn stream_keys(events: &[OutboxEvent], entries: &EntrySettings) -> Vec<String> {
    events.iter().map(|event| event.stream_key(&entries.stream_template)).collect()
}

fn aggregate_of(event: &OutboxEvent) -> (&str, &str) {
    (event.aggregate_type.as_str(), event.aggregate_id.as_str())
}

/// The indexes to send (in batch order) cut into consecutive exchanges: one for everything, or,
/// when `suspect_above` is set, each event with an argument longer than it alone, between the runs
/// of the others. Consecutive runs keep the batch's order, hence each aggregate's.
fn segments(events: &[OutboxEvent], sendable: &[usize], suspect_above: Option<u64>) -> Vec<Vec<usize>> {
    let Some(limit) = suspect_above else {
        return vec![sendable.to_vec()];
    };
    let mut segments: Vec<Vec<usize>> = Vec::new();
    let mut run = Vec::new();
    for &index in sendable {
        if events[index].largest_argument().1 as u64 > limit {
            if !run.is_empty() {
                segments.push(std::mem::take(&mut run));
            }
            segments.push(vec![index]);
        } else {
            run.push(index);
        }
    }
    if !run.is_empty() {
        segments.push(run);
    }
    segments
}

/// Refuses, without sending them, the events with an argument longer than Redis accepts
/// (`max_argument`): Redis would answer with a protocol error and close the connection, which
/// looks like a Redis-wide failure and would be retried forever, holding back every later event.
/// Refused here, such an event is rejected like any event Redis refuses because of itself (backoff,
/// then dead letter). Later events of its aggregate in the batch are not sent this round, so that
/// they never overtake it. Returns the outcomes so far and the indexes still to send.
fn refuse_oversized(events: &[OutboxEvent], max_argument: u64) -> (Vec<EntryOutcome>, Vec<usize>) {
    let mut outcomes = vec![EntryOutcome::NotSent; events.len()];
    let mut sendable = Vec::with_capacity(events.len());
    let mut held_back: Vec<(&str, &str)> = Vec::new();
    for (index, event) in events.iter().enumerate() {
        let aggregate = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
        let (field, len) = event.largest_argument();
        if len as u64 > max_argument {
            outcomes[index] = EntryOutcome::Rejected(format!(
                "event too large for Redis: its {field} is {len} bytes, Redis accepts at most {max_argument} \
                 (proto-max-bulk-len)"
            ));
            held_back.push(aggregate);
        } else if !held_back.contains(&aggregate) {
            sendable.push(index);
        }
    }
    (outcomes, sendable)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event of `payload_len` bytes whose `event_id` is `e{id}`.
    fn event(id: i64, aggregate_id: &str, aggregate_seq: i64, payload_len: usize) -> OutboxEvent {
        OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "t".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq,
            event_type: "x".into(),
            payload: "p".repeat(payload_len),
            headers: None,
            trace: None,
            stream: None,
            created_at: String::new(),
            replay: None,
        }
    }

    #[test]
    fn oversized_events_are_refused_and_hold_back_their_aggregate_only() {
        let event = |id: i64, aggregate_id: &str, payload_len: usize| event(id, aggregate_id, id, payload_len);
        let events = [event(1, "a", 10), event(2, "a", 2000), event(3, "b", 10), event(4, "a", 10)];
        let (outcomes, sendable) = refuse_oversized(&events, 1000);
        assert_eq!(sendable, [0, 2]);
        assert!(matches!(&outcomes[1], EntryOutcome::Rejected(e) if e.contains("payload is 2000 bytes")));
        assert_eq!(outcomes[3], EntryOutcome::NotSent);
    }

    #[test]
    fn with_the_limit_unknown_large_events_go_alone_in_batch_order() {
        let event = |id: i64, payload_len: usize| event(id, &id.to_string(), 1, payload_len);
        let events = [event(1, 10), event(2, 10), event(3, 5000), event(4, 10), event(5, 6000), event(6, 7000)];
        let all = [0, 1, 2, 3, 4, 5];
        assert_eq!(segments(&events, &all, None), vec![all.to_vec()]);
        assert_eq!(segments(&events, &all, Some(1000)), vec![vec![0, 1], vec![2], vec![3], vec![4], vec![5]]);
    }
}
