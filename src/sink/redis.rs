//! The only code that speaks to Redis: connecting (URL, password file, timeouts, TLS), publishing
//! a batch as one pipeline of XADDs, and telling failures of Redis as a whole from rejections of
//! one entry.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use crate::entry::OutboxEvent;

/// Everything needed to reach Redis, as configured by the `outbox.redis_*` settings.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub url: String,
    pub password_file: Option<String>,
    pub timeout: Duration,
    pub tls: TlsFiles,
}

/// `outbox.redis_tls_*`: where the certificates for a `rediss://` connection are. Read at every
/// (re)connect, so that rotated files take effect at the next connection.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
pub struct TlsFiles {
    /// CA certificates (PEM) the server's certificate must chain to; `None`: the system's roots.
    pub ca_file: Option<String>,
    /// Client certificate and key (PEM) for servers that require them (mutual TLS).
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

impl TlsFiles {
    fn any(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }
}

/// Redis as a whole is unusable: unreachable, timing out, out of memory, loading, read-only,
/// misconfigured. Never the events' fault, so it never counts against them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerError(pub String);

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What happened to one entry of a published batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryOutcome {
    /// Redis stored the entry.
    Published,
    /// Redis refused this entry because of the entry itself (e.g. WRONGTYPE: its stream key holds
    /// another type). Other entries are unaffected.
    Rejected(String),
    /// Redis refused this entry for a reason that concerns the whole server (OOM, LOADING, ...).
    BrokerRefused(String),
    /// Not executed: Redis discarded the transaction because another entry was refused. It goes
    /// back untouched and is sent again next round.
    NotSent,
}

/// A lazily (re)connected Redis connection.
pub struct RedisSink {
    config: Option<RedisConfig>,
    connection: Option<redis::Connection>,
    /// Redis's `proto-max-bulk-len`, the longest argument it accepts, as read at connect; `None`
    /// when the relay's user may not read the configuration (ACLs; managed services that disable
    /// CONFIG).
    max_argument: Option<u64>,
}

/// Redis's default `proto-max-bulk-len` (512 MB): the most any event may carry in one argument.
const DEFAULT_MAX_ARGUMENT: u64 = 512 * 1024 * 1024;
/// The smallest `proto-max-bulk-len` Redis can be configured with (1 MB): with the limit unknown,
/// an event with a longer argument might be over it.
const SMALLEST_MAX_ARGUMENT: u64 = 1024 * 1024;

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

impl Default for RedisSink {
    fn default() -> Self {
        Self::new()
    }
}

impl RedisSink {
    pub fn new() -> Self {
        RedisSink { config: None, connection: None, max_argument: None }
    }

    /// Applies (possibly new) settings; a changed configuration drops the current connection so
    /// the next publish connects with the new one.
    pub fn configure(&mut self, config: RedisConfig) {
        if self.config.as_ref() != Some(&config) {
            self.connection = None;
            self.config = Some(config);
        }
    }

    /// Where this sink publishes, for log lines: host and port only, never credentials.
    pub fn describe(&self) -> String {
        self.config.as_ref().map(|c| describe_target(&c.url)).unwrap_or_else(|| "(unconfigured)".into())
    }

    pub fn is_connected(&self) -> bool {
        self.connection.is_some()
    }

    fn connection(&mut self) -> Result<&mut redis::Connection, BrokerError> {
        if self.connection.is_none() {
            let config = self.config.as_ref().ok_or_else(|| BrokerError("outbox.redis_url is not set".into()))?;
            let mut connection = connect(config)?;
            self.max_argument = max_argument(&mut connection);
            self.connection = Some(connection);
        }
        // The branch above either filled the slot or returned.
        self.connection.as_mut().ok_or_else(|| BrokerError("no connection".into()))
    }

    /// XADDs every event to its stream in one MULTI/EXEC pipeline and reports, per event and in
    /// the same order, whether Redis stored it. `Err` means the batch's fate is unknown (connection
    /// lost, or no complete answer within `outbox.redis_timeout`): treat every entry as not
    /// published; some may be, which is the at-least-once duplicate consumers deduplicate by
    /// `event_id`.
    ///
    /// MULTI/EXEC makes a failure of Redis as a whole all-or-nothing for the batch: Redis refuses
    /// to queue a write while out of memory (or loading, or read-only), and then discards the
    /// whole transaction. Without it, an OOM that starts or ends in the middle of a pipeline
    /// would store later events of an aggregate while refusing earlier ones. Errors an entry
    /// causes itself (WRONGTYPE) still come back per entry from EXEC.
    pub fn publish(
        &mut self,
        events: &[OutboxEvent],
        stream_template: &str,
        maxlen: Option<u64>,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let _quiet = SignalsDeferred::new();
        // Connect first: that is where the size limit below is learnt.
        self.connection()?;
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
            match self.exchange_segment(events, &segment, stream_template, maxlen) {
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

    /// One MULTI/EXEC exchange of the events at `indexes`, their outcomes in the same order.
    fn exchange_segment(
        &mut self,
        events: &[OutboxEvent],
        indexes: &[usize],
        stream_template: &str,
        maxlen: Option<u64>,
    ) -> Result<Vec<EntryOutcome>, BrokerError> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for &index in indexes {
            let event = &events[index];
            let cmd = pipe.cmd("XADD").arg(event.stream_key(stream_template));
            if let Some(maxlen) = maxlen {
                cmd.arg("MAXLEN").arg("~").arg(maxlen);
            }
            cmd.arg("*");
            for (field, value) in event.fields() {
                cmd.arg(field).arg(value.as_ref());
            }
        }
        let packed = pipe.get_packed_pipeline();
        let timeout = self.config.as_ref().map_or(Duration::from_secs(5), |c| c.timeout);
        let connection = self.connection()?;
        let exchanged = exchange(connection, &packed, indexes.len(), Instant::now() + timeout);
        let keep_connection = matches!(&exchanged, Ok(sent) if !sent.connection_closed);
        if !keep_connection {
            // Replies may still be in flight, or Redis closed the connection after a protocol
            // error: this connection's stream can no longer be trusted.
            self.connection = None;
        }
        exchanged.map(|sent| sent.outcomes)
    }

    /// Whether Redis answers a PING on a fresh connection.
    fn answers_ping(&mut self) -> bool {
        self.connection = None;
        match self.connection() {
            Ok(connection) => redis::cmd("PING").query::<String>(connection).is_ok(),
            Err(_) => false,
        }
    }
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

/// Reads Redis's `proto-max-bulk-len`; `None` when the relay's user may not (ACLs, managed
/// services that rename CONFIG). Then an event that may be over a lowered limit is sent alone
/// (see `publish`), and a protocol error is pinned on the entry that caused it (`exchange`).
fn max_argument(connection: &mut redis::Connection) -> Option<u64> {
    let reply: redis::RedisResult<Vec<String>> =
        redis::cmd("CONFIG").arg("GET").arg("proto-max-bulk-len").query(connection);
    reply.ok().and_then(|pair| pair.get(1).and_then(|value| value.parse().ok()))
}

/// What one exchange produced.
struct Exchanged {
    outcomes: Vec<EntryOutcome>,
    /// Redis closed the connection (after a protocol error).
    connection_closed: bool,
}

/// Sends a packed MULTI + `count` commands + EXEC and reads every reply before `deadline`. The
/// client library applies the read timeout per reply, so a Redis that stops answering would hold a
/// batch for `count` timeouts; the deadline bounds the whole exchange instead.
fn exchange(
    connection: &mut redis::Connection,
    packed: &[u8],
    count: usize,
    deadline: Instant,
) -> Result<Exchanged, BrokerError> {
    connection.send_packed_command(packed).map_err(|e| BrokerError(describe_error(&e)))?;
    let mut next_reply = || -> Result<redis::Value, BrokerError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BrokerError("Redis did not answer within outbox.redis_timeout".into()));
        }
        connection
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .and_then(|_| connection.recv_response())
            .map_err(|e| BrokerError(describe_error(&e)))
    };
    // MULTI
    if let redis::Value::ServerError(error) = next_reply()? {
        return Err(BrokerError(error.to_string()));
    }
    // One QUEUED (or a refusal) per command. A refusal makes Redis discard the transaction.
    let mut refused_at_queueing = Vec::new();
    for index in 0..count {
        if let redis::Value::ServerError(error) = next_reply()? {
            if is_protocol_error(&error) {
                // Redis could not read this command (an argument over proto-max-bulk-len, say)
                // and closes the connection: the entry is at fault, the others were not executed.
                let mut outcomes = vec![EntryOutcome::NotSent; count];
                outcomes[index] = EntryOutcome::Rejected(format!(
                    "Redis could not read this entry and closed the connection ({error}): an argument longer than \
                     its proto-max-bulk-len?"
                ));
                return Ok(Exchanged { outcomes, connection_closed: true });
            }
            refused_at_queueing.push((index, error));
        }
    }
    let exec = next_reply()?;
    if let Some((_, error)) = refused_at_queueing.iter().find(|(_, e)| is_broker_wide(e)) {
        return Err(BrokerError(error.to_string()));
    }
    if !refused_at_queueing.is_empty() {
        // Refused for the entry itself at queueing time (a key the Redis user may not write):
        // those entries are rejected, the rest of the discarded transaction goes again next round.
        let mut outcomes = vec![EntryOutcome::NotSent; count];
        for (index, error) in refused_at_queueing {
            outcomes[index] = EntryOutcome::Rejected(error.to_string());
        }
        return Ok(Exchanged { outcomes, connection_closed: false });
    }
    match exec {
        redis::Value::Array(replies) if replies.len() == count => Ok(Exchanged {
            outcomes: replies
                .into_iter()
                .map(|reply| match reply {
                    redis::Value::ServerError(error) if is_broker_wide(&error) => {
                        EntryOutcome::BrokerRefused(error.to_string())
                    }
                    redis::Value::ServerError(error) => EntryOutcome::Rejected(error.to_string()),
                    _ => EntryOutcome::Published,
                })
                .collect(),
            connection_closed: false,
        }),
        redis::Value::ServerError(error) => Err(BrokerError(error.to_string())),
        other => Err(BrokerError(format!("unexpected EXEC reply from Redis: {other:?}"))),
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
    is_broker_wide_code(error.code())
}

/// Defers PostgreSQL's signals (latch wake-ups, SIGHUP, SIGTERM, procsignals) while a Redis round
/// trip is in flight. With a socket timeout set (SO_RCVTIMEO), Linux does not restart a read that a
/// signal interrupts: it fails with EINTR, and a pipeline would be abandoned half-read and published
/// again. Deferred signals are delivered when the guard drops, at most `outbox.redis_timeout` later.
/// SIGQUIT (immediate shutdown) is left alone.
struct SignalsDeferred {
    previous: libc::sigset_t,
}

impl SignalsDeferred {
    fn new() -> Self {
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

/// Whether a server error code concerns Redis as a whole rather than one entry.
pub fn is_broker_wide_code(code: &str) -> bool {
    BROKER_WIDE_CODES.contains(&code)
}

fn describe_error(error: &redis::RedisError) -> String {
    // RedisError's text never contains the URL, so it is safe to log and store.
    error.to_string()
}

fn connect(config: &RedisConfig) -> Result<redis::Connection, BrokerError> {
    let info = connection_info(config)?;
    let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
    if tls {
        // rustls needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let client = if tls && config.tls.any() {
        redis::Client::build_with_tls(info, tls_certificates(&config.tls)?)
    } else if config.tls.any() {
        // Certificates for a plain connection: better refuse than send in the clear what the
        // operator meant to protect.
        return Err(BrokerError(
            "outbox.redis_tls_ca_file, _cert_file or _key_file is set but outbox.redis_url is not a rediss:// URL"
                .into(),
        ));
    } else {
        redis::Client::open(info)
    }
    .map_err(|e| BrokerError(describe_error(&e)))?;
    let connection = client.get_connection_with_timeout(config.timeout).map_err(|e| BrokerError(describe_error(&e)))?;
    connection
        .set_read_timeout(Some(config.timeout))
        .and_then(|_| connection.set_write_timeout(Some(config.timeout)))
        .map_err(|e| BrokerError(describe_error(&e)))?;
    Ok(connection)
}

/// Parses the URL and applies the password file. Error texts never contain the URL or password.
pub fn connection_info(config: &RedisConfig) -> Result<ConnectionInfo, BrokerError> {
    let url = config.url.trim();
    if url.is_empty() {
        return Err(BrokerError("outbox.redis_url is empty".into()));
    }
    if !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("redis+unix://")) {
        return Err(BrokerError("outbox.redis_url must start with redis://, rediss:// or redis+unix://".into()));
    }
    let info = url
        .into_connection_info()
        .map_err(|_| BrokerError(format!("outbox.redis_url is not a valid Redis URL: {}", redact_url(url))))?;
    match &config.password_file {
        None => Ok(info),
        Some(path) => {
            let password = read_password_file(path)?;
            let settings = info.redis_settings().clone().set_password(password);
            Ok(info.set_redis_settings(settings))
        }
    }
}

/// Reads the certificates named by `outbox.redis_tls_*`. The server's certificate is verified
/// against `ca_file` (or the system's roots) and the host name or address in the URL, always: there
/// is no setting that turns verification off.
fn tls_certificates(files: &TlsFiles) -> Result<redis::TlsCertificates, BrokerError> {
    let read = |setting: &str, path: &str| {
        fs::read(path).map_err(|e| BrokerError(format!("cannot read {setting} \"{path}\": {e}")))
    };
    let root_cert = match &files.ca_file {
        Some(path) => Some(read("outbox.redis_tls_ca_file", path)?),
        None => None,
    };
    let client_tls = match (&files.cert_file, &files.key_file) {
        (Some(cert), Some(key)) => {
            // The key is a secret, kept like the password file: owner-only.
            private_file("outbox.redis_tls_key_file", key)?;
            Some(redis::ClientTlsConfig {
                client_cert: read("outbox.redis_tls_cert_file", cert)?,
                client_key: read("outbox.redis_tls_key_file", key)?,
            })
        }
        (None, None) => None,
        _ => {
            return Err(BrokerError(
                "outbox.redis_tls_cert_file and outbox.redis_tls_key_file must be set together".into(),
            ))
        }
    };
    Ok(redis::TlsCertificates { client_tls, root_cert })
}

/// Refuses a secret file that its group or others may access (as libpq does for `.pgpass`).
fn private_file(setting: &str, path: &str) -> Result<(), BrokerError> {
    let metadata = fs::metadata(path).map_err(|e| BrokerError(format!("cannot read {setting} \"{path}\": {e}")))?;
    if metadata.mode() & 0o077 != 0 {
        return Err(BrokerError(format!(
            "{setting} \"{path}\" has group or world access; it must be readable by its owner only (chmod 600)"
        )));
    }
    Ok(())
}

/// Reads the password from a file that only the server's OS user may read (like libpq's
/// `.pgpass`, a group- or world-accessible file is refused). Trailing newlines are ignored.
pub fn read_password_file(path: &str) -> Result<String, BrokerError> {
    private_file("outbox.redis_password_file", path)?;
    let contents = fs::read_to_string(path)
        .map_err(|e| BrokerError(format!("cannot read outbox.redis_password_file \"{path}\": {e}")))?;
    let password = contents.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        return Err(BrokerError(format!("outbox.redis_password_file \"{path}\" is empty")));
    }
    Ok(password.to_string())
}

/// `host:port` (or the socket path) of a Redis URL, for log lines. Never includes credentials: a
/// URL that does not parse is shown by its location only (what follows the credentials), marked
/// invalid.
pub fn describe_target(url: &str) -> String {
    match url.trim().into_connection_info() {
        Ok(info) => match info.addr() {
            ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
            ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port} (TLS)"),
            ConnectionAddr::Unix(path) => path.display().to_string(),
            _ => "(unknown address)".into(),
        },
        Err(_) => match location(url.trim()) {
            "" => "(invalid outbox.redis_url)".into(),
            location => format!("{location} (invalid outbox.redis_url)"),
        },
    }
}

/// What follows the credentials and precedes any query or fragment: host, port and database.
/// Credentials end at the *last* `@`, since a password may hold `@`, `/`, `?` or `#` unencoded.
fn location(url: &str) -> &str {
    let rest = url.find("://").map_or(url, |end| &url[end + 3..]);
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    &rest[..rest.find(['?', '#']).unwrap_or(rest.len())]
}

/// The URL with its credentials masked, as `SHOW outbox.redis_url` prints it: scheme, user name
/// (when it is plainly one), `****` for the password, and the location; the query and fragment are
/// dropped, since some clients read credentials from them. Whatever characters the password holds,
/// none of it is shown.
pub fn redact_url(url: &str) -> String {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else {
        return if url.is_empty() { String::new() } else { "(invalid: not a redis:// URL)".into() };
    };
    let scheme = &url[..scheme_end + 3];
    let rest = &url[scheme_end + 3..];
    let location = location(url);
    match rest.rfind('@') {
        None => format!("{scheme}{location}"),
        Some(at) => {
            let userinfo = &rest[..at];
            match userinfo.find(':') {
                Some(colon) if !userinfo[..colon].contains(['/', '?', '#']) => {
                    format!("{scheme}{}:****@{location}", &userinfo[..colon])
                }
                _ => format!("{scheme}****@{location}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_masks_passwords_only() {
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("redis://:s3cret@h:1/0"), "redis://:****@h:1/0");
        assert_eq!(redact_url("rediss://app:s3cret@h:1"), "rediss://app:****@h:1");
        assert_eq!(redact_url("redis://s3cret@h"), "redis://****@h");
        assert_eq!(redact_url("redis://u:p@ss@h/0"), "redis://u:****@h/0");
        assert!(!redact_url("garbage:s3cret@x").contains("s3cret"));
    }

    #[test]
    fn redact_hides_passwords_holding_reserved_characters() {
        for (url, shown) in [
            ("redis://:p/a?s#s@127.0.0.1:6379", "redis://:****@127.0.0.1:6379"),
            ("redis://app:se@cr/et@h:1/2", "redis://app:****@h:1/2"),
            ("rediss://app:x?y#z@h:1/0?protocol=resp3", "rediss://app:****@h:1/0"),
            ("redis://h:1/0?password=s3cret", "redis://h:1/0"),
            ("redis://us/er:pw@h", "redis://****@h"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn unparseable_urls_are_described_by_location_only() {
        let described = describe_target("redis://:p/a?s#s@127.0.0.1:6379");
        assert!(!described.contains("p/a") && !described.contains("s#s"), "{described}");
        assert!(described.contains("127.0.0.1:6379") && described.contains("invalid"), "{described}");
        assert_eq!(describe_target("redis://:only-a-secret@"), "(invalid outbox.redis_url)");
    }

    #[test]
    fn oversized_events_are_refused_and_hold_back_their_aggregate_only() {
        let event = |id: i64, aggregate_id: &str, payload_len: usize| OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "t".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: id,
            event_type: "x".into(),
            payload: "p".repeat(payload_len),
            headers: None,
            stream: None,
            created_at: String::new(),
        };
        let events = [event(1, "a", 10), event(2, "a", 2000), event(3, "b", 10), event(4, "a", 10)];
        let (outcomes, sendable) = refuse_oversized(&events, 1000);
        assert_eq!(sendable, [0, 2]);
        assert!(matches!(&outcomes[1], EntryOutcome::Rejected(e) if e.contains("payload is 2000 bytes")));
        assert_eq!(outcomes[3], EntryOutcome::NotSent);
    }

    #[test]
    fn with_the_limit_unknown_large_events_go_alone_in_batch_order() {
        let event = |id: i64, payload_len: usize| OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "t".into(),
            aggregate_id: id.to_string(),
            aggregate_seq: 1,
            event_type: "x".into(),
            payload: "p".repeat(payload_len),
            headers: None,
            stream: None,
            created_at: String::new(),
        };
        let events = [event(1, 10), event(2, 10), event(3, 5000), event(4, 10), event(5, 6000), event(6, 7000)];
        let all = [0, 1, 2, 3, 4, 5];
        assert_eq!(segments(&events, &all, None), vec![all.to_vec()]);
        assert_eq!(segments(&events, &all, Some(1000)), vec![vec![0, 1], vec![2], vec![3], vec![4], vec![5]]);
    }

    #[test]
    fn describe_target_never_shows_credentials() {
        assert_eq!(describe_target("redis://:pw@10.1.2.3:7000/0"), "10.1.2.3:7000");
        assert_eq!(describe_target("redis://localhost"), "localhost:6379");
        assert!(!describe_target("not a url :pw@").contains("pw"));
    }

    #[test]
    fn bad_urls_are_reported_without_the_secret() {
        let config = |url: &str| RedisConfig {
            url: url.into(),
            password_file: None,
            timeout: Duration::from_secs(1),
            tls: TlsFiles::default(),
        };
        for url in ["", "http://x", "redis://:s3cret@[bad"] {
            let Err(err) = connection_info(&config(url)) else { panic!("accepted {url}") };
            assert!(!err.0.contains("s3cret"), "{err}");
        }
        assert!(connection_info(&config("redis://:pw@127.0.0.1:1/2")).is_ok());
    }

    #[test]
    fn password_file_must_be_private() {
        let dir = std::env::temp_dir().join(format!("outbox_pg_pwtest_{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pw");
        fs::write(&path, "hunter2\n").unwrap();
        let path_str = path.to_str().unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_password_file(path_str).is_err());
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password_file(path_str).unwrap(), "hunter2");
        let config = RedisConfig {
            url: "redis://:inurl@127.0.0.1:1".into(),
            password_file: Some(path_str.into()),
            timeout: Duration::from_secs(1),
            tls: TlsFiles::default(),
        };
        assert_eq!(connection_info(&config).unwrap().redis_settings().password(), Some("hunter2"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
