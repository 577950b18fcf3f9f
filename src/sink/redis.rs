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
}

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
        RedisSink { config: None, connection: None }
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
            self.connection = Some(connect(config)?);
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
        let mut pipe = redis::pipe();
        pipe.atomic();
        for event in events {
            let cmd = pipe.cmd("XADD").arg(event.stream_key(stream_template));
            if let Some(maxlen) = maxlen {
                cmd.arg("MAXLEN").arg("~").arg(maxlen);
            }
            cmd.arg("*");
            for (field, value) in event.fields() {
                cmd.arg(field).arg(value);
            }
        }
        let packed = pipe.get_packed_pipeline();
        let timeout = self.config.as_ref().map_or(Duration::from_secs(5), |c| c.timeout);
        let _quiet = SignalsDeferred::new();
        let connection = self.connection()?;
        let outcome = exchange(connection, &packed, events.len(), Instant::now() + timeout);
        if outcome.is_err() {
            // Replies may still be in flight: this connection's stream can no longer be trusted.
            self.connection = None;
        }
        outcome
    }
}

/// Sends a packed MULTI + `count` commands + EXEC and reads every reply before `deadline`. The
/// client library applies the read timeout per reply, so a Redis that stops answering would hold a
/// batch for `count` timeouts; the deadline bounds the whole exchange instead.
fn exchange(
    connection: &mut redis::Connection,
    packed: &[u8],
    count: usize,
    deadline: Instant,
) -> Result<Vec<EntryOutcome>, BrokerError> {
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
            refused_at_queueing.push((index, error));
        }
    }
    let exec = next_reply()?;
    if let Some((_, error)) = refused_at_queueing.iter().find(|(_, e)| is_broker_wide_code(e.code())) {
        return Err(BrokerError(error.to_string()));
    }
    if !refused_at_queueing.is_empty() {
        // Refused for the entry itself at queueing time (never seen with XADD, kept for safety):
        // those entries are rejected, the rest of the discarded transaction goes again next round.
        let mut outcomes = vec![EntryOutcome::NotSent; count];
        for (index, error) in refused_at_queueing {
            outcomes[index] = EntryOutcome::Rejected(error.to_string());
        }
        return Ok(outcomes);
    }
    match exec {
        redis::Value::Array(replies) if replies.len() == count => Ok(replies
            .into_iter()
            .map(|reply| match reply {
                redis::Value::ServerError(error) if is_broker_wide_code(error.code()) => {
                    EntryOutcome::BrokerRefused(error.to_string())
                }
                redis::Value::ServerError(error) => EntryOutcome::Rejected(error.to_string()),
                _ => EntryOutcome::Published,
            })
            .collect()),
        redis::Value::ServerError(error) => Err(BrokerError(error.to_string())),
        other => Err(BrokerError(format!("unexpected EXEC reply from Redis: {other:?}"))),
    }
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
    if matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
        // rustls needs a process-wide crypto provider; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let client = redis::Client::open(info).map_err(|e| BrokerError(describe_error(&e)))?;
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

/// Reads the password from a file that only the server's OS user may read (like libpq's
/// `.pgpass`, a group- or world-accessible file is refused). Trailing newlines are ignored.
pub fn read_password_file(path: &str) -> Result<String, BrokerError> {
    let metadata = fs::metadata(path)
        .map_err(|e| BrokerError(format!("cannot read outbox.redis_password_file \"{path}\": {e}")))?;
    if metadata.mode() & 0o077 != 0 {
        return Err(BrokerError(format!(
            "outbox.redis_password_file \"{path}\" has group or world access; it must be readable by its owner only (chmod 600)"
        )));
    }
    let contents = fs::read_to_string(path)
        .map_err(|e| BrokerError(format!("cannot read outbox.redis_password_file \"{path}\": {e}")))?;
    let password = contents.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        return Err(BrokerError(format!("outbox.redis_password_file \"{path}\" is empty")));
    }
    Ok(password.to_string())
}

/// `host:port` (or the socket path) of a Redis URL, for log lines. Never includes credentials.
pub fn describe_target(url: &str) -> String {
    match url.trim().into_connection_info() {
        Ok(info) => match info.addr() {
            ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
            ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port} (TLS)"),
            ConnectionAddr::Unix(path) => path.display().to_string(),
            _ => "(unknown address)".into(),
        },
        Err(_) => redact_url(url),
    }
}

/// The URL with any password replaced by `****` (and a lone user-info, which some clients read as
/// a password, masked too). Used wherever a URL is shown: `SHOW`, `pg_settings`, log lines.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return if url.contains('@') { "****".into() } else { url.to_string() };
    };
    let (scheme, rest) = url.split_at(scheme_end + 3);
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rfind('@') {
        None => url.to_string(),
        Some(at) => {
            let (userinfo, host) = authority.split_at(at);
            let masked = match userinfo.find(':') {
                Some(colon) => format!("{}:****", &userinfo[..colon]),
                None => "****".to_string(),
            };
            format!("{scheme}{masked}{host}{path}")
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
    fn describe_target_never_shows_credentials() {
        assert_eq!(describe_target("redis://:pw@10.1.2.3:7000/0"), "10.1.2.3:7000");
        assert_eq!(describe_target("redis://localhost"), "localhost:6379");
        assert!(!describe_target("not a url :pw@").contains("pw"));
    }

    #[test]
    fn bad_urls_are_reported_without_the_secret() {
        let config = |url: &str| RedisConfig { url: url.into(), password_file: None, timeout: Duration::from_secs(1) };
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
        };
        assert_eq!(connection_info(&config).unwrap().redis_settings().password(), Some("hunter2"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
