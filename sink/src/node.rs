//! One Redis node: connecting to it (credentials, TLS, timeouts), and the exchange that publishes
//! to it: a pipeline of MULTI/EXEC blocks of XADDs, optionally followed by WAIT, all read against
//! one deadline. What a reply means for an entry (published, the entry's fault, Redis's fault, a
//! redirection to another cluster node) is decided here, once for every topology.

use std::path::Path;
use std::time::{Duration, Instant};

use outbox_protocol::secret_files::{self, TlsSettings};
use redis::{ConnectionAddr, ConnectionInfo};

use super::address::describe_addr;
use super::{BrokerError, EntryOutcome, StreamId, TlsFiles, NO_ANSWER_IN_TIME};
use crate::entry::NumberText;

/// How long a read timeout set for the rest of an exchange is used before it is set again
/// (`Pipeline::receive`): the most a reply may outlast the exchange's deadline.
const REARM_READ_TIMEOUT: Duration = Duration::from_millis(10);

/// Server error codes that describe the server's state, not the entry: retried without limit.
const BROKER_WIDE_CODES: &[&str] = &[
    "OOM",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MISCONF",
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    "NOREPLICAS",
];

/// Connects to the node `info` names, with `timeout` for the connect and every read and write.
/// TLS certificates are read at every connect, so rotated files take effect at the next one.
pub fn connect(info: ConnectionInfo, timeout: Duration, tls: &TlsFiles) -> Result<redis::Connection, BrokerError> {
    let is_tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
    let node = describe_addr(info.addr());
    if is_tls {
        // rustls needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let client = if is_tls && tls.any() {
        redis::Client::build_with_tls(info, tls_certificates(tls)?)
    } else if tls.any() {
        // Certificates for a plain connection: better refuse than send in the clear what the
        // operator meant to protect.
        return Err(BrokerError(
            "outbox.redis_tls_ca_file, _cert_file or _key_file is set but outbox.redis_url is not a rediss:// URL"
                .into(),
        ));
    } else {
        redis::Client::open(info)
    }
    .map_err(|e| BrokerError(format!("{node}: {}", describe_error(&e))))?;
    let connection = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| BrokerError(format!("{node}: {}", describe_error(&e))))?;
    connection
        .set_read_timeout(Some(timeout))
        .and_then(|_| connection.set_write_timeout(Some(timeout)))
        .map_err(|e| BrokerError(format!("{node}: {}", describe_error(&e))))?;
    Ok(connection)
}

/// Reads the certificates named by `outbox.redis_tls_*`. The server's certificate is verified
/// against `ca_file` (or the system's roots) and the host name or address in the URL, always: there
/// is no setting that turns verification off.
fn tls_certificates(files: &TlsFiles) -> Result<redis::TlsCertificates, BrokerError> {
    let names = TlsSettings {
        ca_file: "outbox.redis_tls_ca_file",
        cert_file: "outbox.redis_tls_cert_file",
        key_file: "outbox.redis_tls_key_file",
    };
    let material = secret_files::read_tls(
        &names,
        files.ca_file.as_deref().map(Path::new),
        files.cert_file.as_deref().map(Path::new),
        files.key_file.as_deref().map(Path::new),
    )
    .map_err(BrokerError)?;
    Ok(redis::TlsCertificates {
        root_cert: material.ca,
        client_tls: material.client.map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key }),
    })
}

/// Reads Redis's `proto-max-bulk-len`; `None` when the relay's user may not (ACLs, managed
/// services that rename CONFIG).
pub fn max_argument(connection: &mut redis::Connection) -> Option<u64> {
    let reply: redis::RedisResult<Vec<String>> =
        redis::cmd("CONFIG").arg("GET").arg("proto-max-bulk-len").query(connection);
    reply.ok().and_then(|pair| pair.get(1).and_then(|value| value.parse().ok()))
}

/// What a server offers beyond Redis 7.0's XADD, learnt at connect from its own description of
/// the command (`COMMAND DOCS XADD`), not guessed from its version.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// The version the server reports (`HELLO`), for messages only; `None` if it would not say.
    pub version: Option<String>,
    /// `XADD ... ACKED` (Redis 8.2): trim only entries every consumer group acknowledged.
    pub acked_trim: bool,
    /// `XADD ... IDMP` (Redis 8.6): idempotent XADD (docs/worker.md; not used yet).
    pub idempotent_xadd: bool,
    /// Why the server's description could not be read (an ACL without `+command|docs`), if so.
    pub unknown: Option<String>,
}

impl Capabilities {
    /// The server as messages name it: `Redis 8.2.3`, or `Redis (version unknown)`.
    pub fn server(&self) -> String {
        match &self.version {
            Some(version) => format!("Redis {version}"),
            None => "Redis (version unknown)".into(),
        }
    }

    /// For the log: which of the options the relay may use the server offers.
    pub fn offers(&self) -> String {
        if let Some(why) = &self.unknown {
            return format!("cannot read COMMAND DOCS XADD ({why}): XADD ACKED unknown");
        }
        let yes_no = |offered: bool| if offered { "offered" } else { "not offered" };
        format!("XADD ACKED {}, XADD IDMP {} (not used yet)", yes_no(self.acked_trim), yes_no(self.idempotent_xadd))
    }
}

/// Asks the server what it is and which XADD options it has.
pub fn capabilities(connection: &mut redis::Connection) -> Capabilities {
    let version = redis::cmd("HELLO").query::<redis::Value>(connection).ok().and_then(|hello| {
        let mut words = Vec::new();
        words_of(&hello, &mut words);
        words.iter().position(|word| word == "version").and_then(|at| words.get(at + 1).cloned())
    });
    match redis::cmd("COMMAND").arg("DOCS").arg("XADD").query::<redis::Value>(connection) {
        Ok(docs) => {
            let mut words = Vec::new();
            words_of(&docs, &mut words);
            let has = |token: &str| words.iter().any(|word| word.eq_ignore_ascii_case(token));
            Capabilities { version, acked_trim: has("ACKED"), idempotent_xadd: has("IDMP"), unknown: None }
        }
        Err(error) => Capabilities { version, unknown: Some(describe_error(&error)), ..Capabilities::default() },
    }
}

/// Every string in a reply, depth first (argument names and tokens of `COMMAND DOCS`, the
/// fields and values of `HELLO`).
fn words_of(value: &redis::Value, words: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => words.push(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(text) => words.push(text.clone()),
        redis::Value::Array(items) | redis::Value::Set(items) => items.iter().for_each(|item| words_of(item, words)),
        redis::Value::Map(pairs) => pairs.iter().for_each(|(key, item)| {
            words_of(key, words);
            words_of(item, words);
        }),
        _ => {}
    }
}

/// A cluster node that serves a slot the block was sent elsewhere for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// ASK (the slot is being migrated: ask the target this once) rather than MOVED (it lives
    /// there now).
    pub ask: bool,
    pub slot: u16,
    pub host: String,
    pub port: u16,
}

impl Redirect {
    /// Parses the details of a MOVED or ASK error: `<slot> <host>:<port>` (the host may be empty:
    /// the node that answered).
    fn parse(error: &redis::ServerError) -> Option<Redirect> {
        let ask = match error.code() {
            "MOVED" => false,
            "ASK" => true,
            _ => return None,
        };
        let mut parts = error.details()?.split_whitespace();
        let slot = parts.next()?.parse().ok()?;
        let endpoint = parts.next()?;
        let colon = endpoint.rfind(':')?;
        let port = endpoint[colon + 1..].parse().ok()?;
        let host = endpoint[..colon].trim_start_matches('[').trim_end_matches(']').to_string();
        Some(Redirect { ask, slot, host, port })
    }
}

/// How one MULTI/EXEC block of a pipeline went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockReply {
    /// An outcome per command of the block, in order.
    Outcomes(Vec<EntryOutcome>),
    /// The node does not serve the block's slot: nothing of it was executed.
    Redirected(Redirect),
}

/// What one exchange with a node produced.
#[derive(Debug)]
pub struct Exchanged {
    pub blocks: Vec<BlockReply>,
    /// Redis closed the connection (after a protocol error): it cannot be used again.
    pub connection_closed: bool,
}

/// A pipeline for one node: MULTI/EXEC blocks of commands, then an optional WAIT, written as
/// RESP straight into one buffer as they are added (no command object per entry: the payloads
/// are copied once, from the event into the buffer).
#[derive(Default)]
pub struct Pipeline {
    bytes: Vec<u8>,
    /// Bytes the buffer could not grow by (memory): the pipeline is not sent, the round fails and
    /// backs off, rather than the allocation aborting the process.
    unallocated: usize,
    /// (commands, preceded by ASKING) per block.
    blocks: Vec<(usize, bool)>,
    wait_replicas: u32,
}

impl Pipeline {
    /// An empty pipeline whose buffer holds about `bytes` without growing: growing it by doubling
    /// copied the whole pipeline again each time. A failed reservation is no error here; `arg`
    /// reserves again and reports memory it cannot get.
    pub fn with_capacity(bytes: usize) -> Self {
        let mut pipeline = Pipeline::default();
        let _ = pipeline.bytes.try_reserve_exact(bytes);
        pipeline
    }

    /// Starts a block, executed atomically; `asking` prefixes it with ASKING (an ASK
    /// redirection's target serves a slot being imported only to clients that say so).
    pub fn begin_block(&mut self, asking: bool) {
        if asking {
            self.command(1);
            self.arg(b"ASKING");
        }
        self.command(1);
        self.arg(b"MULTI");
        self.blocks.push((0, asking));
    }

    /// Ends the block begun last.
    pub fn end_block(&mut self) {
        self.command(1);
        self.arg(b"EXEC");
    }

    /// Starts a command of `args` arguments (its name included), counted in the current block;
    /// exactly that many `arg` calls follow.
    pub fn entry(&mut self, args: usize) {
        if let Some((count, _)) = self.blocks.last_mut() {
            *count += 1;
        }
        self.command(args);
    }

    fn command(&mut self, args: usize) {
        self.bytes.push(b'*');
        self.number(args as u64);
    }

    pub fn arg(&mut self, value: &[u8]) {
        if self.unallocated > 0 || self.bytes.try_reserve(value.len() + 32).is_err() {
            self.unallocated += value.len() + 32;
            return;
        }
        self.bytes.push(b'$');
        self.number(value.len() as u64);
        self.bytes.extend_from_slice(value);
        self.bytes.extend_from_slice(b"\r\n");
    }

    /// A number followed by CRLF.
    fn number(&mut self, value: u64) {
        let mut text = NumberText::default();
        self.bytes.extend_from_slice(text.format(value.min(i64::MAX as u64) as i64).as_bytes());
        self.bytes.extend_from_slice(b"\r\n");
    }

    /// Ends the pipeline with `WAIT replicas timeout`: the blocks count only once that many
    /// replicas have them (`outbox.redis_wait_replicas`).
    pub fn wait(&mut self, replicas: u32, timeout: Duration) {
        if replicas > 0 {
            self.command(3);
            self.arg(b"WAIT");
            self.arg(replicas.to_string().as_bytes());
            self.arg((timeout.as_millis().max(1) as u64).to_string().as_bytes());
            self.wait_replicas = replicas;
        }
    }

    /// Sends the whole pipeline (reading nothing yet).
    pub fn send(&self, connection: &mut redis::Connection) -> Result<(), BrokerError> {
        if self.unallocated > 0 {
            return Err(BrokerError(format!(
                "the relay is out of memory: it could not allocate {} more bytes for a pipeline of {} bytes",
                self.unallocated,
                self.bytes.len()
            )));
        }
        connection.send_packed_command(&self.bytes).map_err(|e| BrokerError(describe_error(&e)))
    }

    /// Reads every reply of a sent pipeline before `deadline`. The client library applies the read
    /// timeout per reply, so a Redis that stops answering would hold a batch for one timeout per
    /// command; the deadline bounds the whole exchange instead.
    ///
    /// Setting the timeout is a system call, and a pipeline has a reply per entry, most of them
    /// already in the client's buffer: it is set again only once `REARM_READ_TIMEOUT` has passed
    /// since it was last set, so a reply may end at most that long after the deadline. (Set before
    /// every reply, it was 3% of the relay's CPU in the drain.)
    pub fn receive(&self, connection: &mut redis::Connection, deadline: Instant) -> Result<Exchanged, BrokerError> {
        let mut armed_at: Option<Instant> = None;
        let mut next_reply = || -> Result<redis::Value, BrokerError> {
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return Err(BrokerError(NO_ANSWER_IN_TIME.into()));
            }
            if armed_at.is_none_or(|at| now.duration_since(at) >= REARM_READ_TIMEOUT) {
                connection
                    .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                    .map_err(|e| BrokerError(describe_error(&e)))?;
                armed_at = Some(now);
            }
            connection.recv_response().map_err(|e| match e.is_timeout() {
                true => BrokerError(format!("{NO_ANSWER_IN_TIME} ({})", describe_error(&e))),
                false => BrokerError(describe_error(&e)),
            })
        };
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for (position, &(count, asking)) in self.blocks.iter().enumerate() {
            if asking {
                if let redis::Value::ServerError(error) = next_reply()? {
                    return Err(BrokerError(error.to_string()));
                }
            }
            // MULTI
            if let redis::Value::ServerError(error) = next_reply()? {
                return Err(BrokerError(error.to_string()));
            }
            // One QUEUED (or a refusal) per command. A refusal makes Redis discard the block.
            let mut refused_at_queueing = Vec::new();
            let mut redirect = None;
            for index in 0..count {
                if let redis::Value::ServerError(error) = next_reply()? {
                    if is_protocol_error(&error) {
                        // Redis could not read this command (an argument over proto-max-bulk-len,
                        // say) and closes the connection: the entry is at fault, nothing after it
                        // was executed.
                        let mut outcomes = vec![EntryOutcome::NotSent; count];
                        outcomes[index] = EntryOutcome::Rejected(format!(
                            "Redis could not read this entry and closed the connection ({error}): an argument longer \
                             than its proto-max-bulk-len?"
                        ));
                        blocks.push(BlockReply::Outcomes(outcomes));
                        for &(later, _) in &self.blocks[position + 1..] {
                            blocks.push(BlockReply::Outcomes(vec![EntryOutcome::NotSent; later]));
                        }
                        return Ok(Exchanged { blocks, connection_closed: true });
                    }
                    match Redirect::parse(&error) {
                        Some(found) => redirect = redirect.or(Some(found)),
                        None => refused_at_queueing.push((index, error)),
                    }
                }
            }
            let exec = next_reply()?;
            if let Some((_, error)) = refused_at_queueing.iter().find(|(_, e)| is_broker_wide(e)) {
                return Err(BrokerError(error.to_string()));
            }
            if let Some(redirect) = redirect {
                blocks.push(BlockReply::Redirected(redirect));
                continue;
            }
            if !refused_at_queueing.is_empty() {
                // Refused for the entry itself at queueing time (a key the Redis user may not
                // write): those entries are rejected, the rest of the discarded block goes again
                // next round.
                let mut outcomes = vec![EntryOutcome::NotSent; count];
                for (index, error) in refused_at_queueing {
                    outcomes[index] = EntryOutcome::Rejected(error.to_string());
                }
                blocks.push(BlockReply::Outcomes(outcomes));
                continue;
            }
            match exec {
                redis::Value::Array(replies) if replies.len() == count => blocks.push(BlockReply::Outcomes(
                    replies
                        .into_iter()
                        .map(|reply| match reply {
                            redis::Value::ServerError(error) if is_broker_wide(&error) => {
                                EntryOutcome::BrokerRefused(error.to_string())
                            }
                            redis::Value::ServerError(error) => EntryOutcome::Rejected(error.to_string()),
                            redis::Value::BulkString(id) => EntryOutcome::Published(StreamId::parse(&id)),
                            _ => EntryOutcome::Published(None),
                        })
                        .collect(),
                )),
                redis::Value::ServerError(error) => return Err(BrokerError(error.to_string())),
                other => return Err(BrokerError(format!("unexpected EXEC reply from Redis: {other:?}"))),
            }
        }
        if self.wait_replicas > 0 {
            match next_reply()? {
                redis::Value::Int(acknowledged) if acknowledged >= self.wait_replicas as i64 => {}
                redis::Value::Int(acknowledged) => {
                    return Err(BrokerError(format!(
                        "only {acknowledged} of {} replicas acknowledged the entries in time (outbox.redis_wait_replicas); \
                         they are published again once enough replicas are connected",
                        self.wait_replicas
                    )))
                }
                redis::Value::ServerError(error) => return Err(BrokerError(error.to_string())),
                other => return Err(BrokerError(format!("unexpected WAIT reply from Redis: {other:?}"))),
            }
        }
        Ok(Exchanged { blocks, connection_closed: false })
    }
}

/// Whether Redis answered that it could not parse a command (then it closes the connection).
fn is_protocol_error(error: &redis::ServerError) -> bool {
    error.code() == "ERR" && error.details().is_some_and(|details| details.starts_with("Protocol error"))
}

/// Whether a refusal concerns Redis as a whole rather than one entry. NOPERM is both: a user who
/// may not run XADD (or MULTI) can publish nothing, while a user whose ACL key patterns leave out
/// one stream can still publish every other. Redis words the first "... permissions to run the
/// 'xadd' command" and the second "... permissions to access one of the keys used as arguments"
/// (7.0) or "... to access the 'k' key" / "No permissions to access a key" (7.2 and later): a
/// NOPERM that speaks of a key and not of a command is the entry's.
fn is_broker_wide(error: &redis::ServerError) -> bool {
    if error.code() == "NOPERM" {
        let details = error.details().unwrap_or_default().to_ascii_lowercase();
        return !details.contains("key") || details.contains("command");
    }
    BROKER_WIDE_CODES.contains(&error.code())
}

/// Defers PostgreSQL's signals (latch wake-ups, SIGHUP, SIGTERM, procsignals) while a Redis round
/// trip is in flight. With a socket timeout set (SO_RCVTIMEO), Linux does not restart a read that a
/// signal interrupts: it fails with EINTR, and a pipeline would be abandoned half-read and published
/// again. Deferred signals are delivered when the guard drops, at most `outbox.redis_timeout` later.
/// SIGQUIT (immediate shutdown) is left alone.
pub(crate) struct SignalsDeferred {
    previous: libc::sigset_t,
}

impl SignalsDeferred {
    pub(crate) fn new() -> Self {
        // SAFETY: plain libc signal-set manipulation on this (single) thread's mask.
        unsafe {
            let mut block: libc::sigset_t = std::mem::zeroed();
            let mut previous: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut block);
            for signal in [
                libc::SIGHUP,
                libc::SIGINT,
                libc::SIGTERM,
                libc::SIGUSR1,
                libc::SIGUSR2,
                libc::SIGURG,
                libc::SIGALRM,
                libc::SIGCHLD,
            ] {
                libc::sigaddset(&mut block, signal);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut previous);
            SignalsDeferred { previous }
        }
    }
}

impl Drop for SignalsDeferred {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.previous, std::ptr::null_mut()) };
    }
}

/// A client library error as text: RedisError's text never contains the URL, so it is safe to log
/// and store.
pub fn describe_error(error: &redis::RedisError) -> String {
    error.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(text: &str) -> redis::ServerError {
        match redis::parse_redis_value(format!("-{text}\r\n").as_bytes()) {
            Ok(redis::Value::ServerError(error)) => error,
            other => panic!("not an error reply: {other:?}"),
        }
    }

    #[test]
    fn a_pipeline_is_the_resp_the_client_library_would_send() {
        let mut pipeline = Pipeline::default();
        pipeline.begin_block(true);
        pipeline.entry(4);
        for arg in ["XADD", "k", "*", "f"] {
            pipeline.arg(arg.as_bytes());
        }
        pipeline.end_block();
        pipeline.wait(1, Duration::from_millis(250));
        let mut expected = Vec::new();
        for cmd in [
            redis::cmd("ASKING"),
            redis::cmd("MULTI"),
            redis::cmd("XADD").arg("k").arg("*").arg("f").clone(),
            redis::cmd("EXEC"),
            redis::cmd("WAIT").arg(1).arg(250).clone(),
        ] {
            cmd.write_packed_command(&mut expected);
        }
        assert_eq!(pipeline.bytes, expected);
        assert_eq!(pipeline.blocks, vec![(1, true)]);
    }

    #[test]
    fn moved_and_ask_name_the_slot_and_the_node() {
        assert_eq!(
            Redirect::parse(&server_error("MOVED 3999 127.0.0.1:6381")),
            Some(Redirect { ask: false, slot: 3999, host: "127.0.0.1".into(), port: 6381 })
        );
        assert_eq!(
            Redirect::parse(&server_error("ASK 12 [::1]:7002")),
            Some(Redirect { ask: true, slot: 12, host: "::1".into(), port: 7002 })
        );
        assert_eq!(Redirect::parse(&server_error("WRONGTYPE Operation against a key")), None);
    }

    #[test]
    fn refusals_are_told_apart() {
        assert!(is_broker_wide(&server_error("OOM command not allowed")));
        assert!(is_broker_wide(&server_error("CLUSTERDOWN The cluster is down")));
        assert!(!is_broker_wide(&server_error("WRONGTYPE Operation against a key holding the wrong kind of value")));
        assert!(!is_broker_wide(&server_error(
            "NOPERM this user has no permissions to access one of the keys used as arguments"
        )));
        assert!(is_broker_wide(&server_error("NOPERM this user has no permissions to run the 'xadd' command")));
        // Redis 8.2's wording (tests/hardening.rs sees it from a real server under REDIS_VERSION=8.2).
        assert!(!is_broker_wide(&server_error("NOPERM No permissions to access a key")));
        assert!(is_broker_wide(&server_error("NOPERM User relay has no permissions to run the 'xadd' command")));
    }
}
