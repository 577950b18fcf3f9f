//! Consumer settings and their defaults, and the checks that can be made without touching the
//! network or the file system (those happen at connect time, see `crate::connection`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::error::ConsumerError;
use outbox_protocol::redis_url;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

/// How the Redis deployment is organised, which decides how `redis_url` is read and where keys
/// live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum RedisMode {
    /// One server (or a primary reached through one address): `redis_url` names it.
    #[default]
    Standalone,
    /// Redis Cluster: `redis_url` lists seed nodes, commands are routed by hash slot and MOVED/ASK
    /// redirections are followed. Dedup keys are hash-tagged with the stream so that they live in
    /// the stream's slot (see [`ConsumerConfig::dedup_key`]).
    Cluster,
}

impl RedisMode {
    /// The name used by the CLI and in messages: `standalone` or `cluster`.
    pub fn as_str(self) -> &'static str {
        match self {
            RedisMode::Standalone => "standalone",
            RedisMode::Cluster => "cluster",
        }
    }
}

impl fmt::Display for RedisMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RedisMode {
    type Err = String;

    /// Parses `standalone` or `cluster` (case-insensitive); the error names the accepted values.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.to_ascii_lowercase().as_str() {
            "standalone" => Ok(RedisMode::Standalone),
            "cluster" => Ok(RedisMode::Cluster),
            _ => Err(format!("invalid Redis mode {text:?}: expected standalone or cluster")),
        }
    }
}

/// Everything a [`crate::Consumer`] needs to know. Build it with [`ConsumerConfig::new`], which
/// fills in the defaults, then change the public fields as needed before
/// [`crate::Consumer::connect`] (which validates it).
///
/// Note that the defaults derived from other fields (`dedup_prefix` from `group`,
/// `dead_letter_stream` from `stream`) are computed by `new`; change them too if you change
/// `group` or `stream` afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// Redis connection URL, e.g. `redis://127.0.0.1:6379/0`, `rediss://host:6380/` for TLS, or
    /// `redis://user:password@host:6379/` for an ACL user. In cluster mode, a list of seed nodes:
    /// `redis://[user:password@]host1:port1,host2:port2/` (scheme and credentials of the front
    /// apply to every node) or comma-separated full URLs.
    pub redis_url: String,
    /// Standalone (default) or Redis Cluster; see [`RedisMode`].
    pub redis_mode: RedisMode,
    /// A file holding the password, which then overrides any password in `redis_url`, so that it
    /// stays out of the command line and the environment. It must be accessible by its owner only
    /// (like libpq's `.pgpass`); trailing newlines are ignored. Read at every (re)connect.
    pub password_file: Option<PathBuf>,
    /// CA certificates (PEM) the server's certificate must chain to, for a `rediss://` URL.
    /// `None`: the system's trust store. The certificate and the host name (or IP address) in the
    /// URL are always verified; there is no setting to turn that off.
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) for servers that require mutual TLS; needs `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// Private key (PEM) of `tls_cert_file`; must be accessible by its owner only.
    pub tls_key_file: Option<PathBuf>,
    /// The stream key to consume, e.g. `outbox:order`.
    pub stream: String,
    /// The consumer group; each group sees every event once, shared among its consumers.
    pub group: String,
    /// This consumer's name within the group. Must be unique among live consumers of the group,
    /// since Redis tracks pending entries per name. Default: `<hostname>-<pid>`.
    pub consumer_name: String,
    /// Where the group starts when this consumer creates it: `0` (default) for the whole stream,
    /// so events relayed before the first consumer started are not missed, or `$` for new ones only.
    pub group_start_id: String,
    /// Most entries read per XREADGROUP or XAUTOCLAIM call. Default 100.
    pub batch_size: usize,
    /// How long XREADGROUP blocks waiting for new entries. Default 1 s. Zero means do not block
    /// (Redis would read `BLOCK 0` as "forever", which would make shutdown impossible).
    pub block_timeout: Duration,
    /// Prefix of the dedup keys `<prefix>:<event_id>`. Default `outbox:dedup:<group>`, so that
    /// two groups consuming the same stream deduplicate independently.
    pub dedup_prefix: String,
    /// How long a dedup key is kept after the event was processed. Default 24 h. A copy of an
    /// event delivered later than this is processed again, so keep it well above the longest
    /// redelivery delay you expect. Whole seconds; at least 1 s.
    pub dedup_ttl: Duration,
    /// An entry delivered to some consumer and not acknowledged for this long is reclaimed with
    /// XAUTOCLAIM. Default 30 s. Must exceed the handler's longest run, or a slow handler's event
    /// is reclaimed and run a second time concurrently.
    pub claim_idle_timeout: Duration,
    /// How often this consumer scans for idle pending entries. Default 5 s. While a scan has more
    /// pages, the next page is fetched on the next poll regardless.
    pub claim_interval: Duration,
    /// An entry is dead-lettered once its handler has failed on its `max_deliveries`-th delivery,
    /// or when it is reclaimed with more deliveries than this (e.g. its handler crashes the
    /// process). Default 5; at least 1.
    pub max_deliveries: u64,
    /// Stream receiving dead-lettered entries. Default `<stream>:dead`.
    pub dead_letter_stream: String,
    /// How many consecutive transient failures (lost connection, ...) [`crate::Consumer::run`]
    /// rides out by reconnecting, with backoff, before it returns the error. Default 10.
    pub reconnect_attempts: u32,
    /// Acknowledge with `XACKDEL ... ACKED` instead of `XACK`, so that an entry every consumer
    /// group has acknowledged is deleted at once: for streams the relay trims by acknowledgement
    /// (`outbox.stream_trim = 'acked'`), where it would otherwise stay until the next XADD trims
    /// it. Used only when the server has `XACKDEL` (Redis 8.2 or later, asked at connect); else
    /// `XACK`, as with `false` (the default). See [`crate::Consumer::acknowledges_with`].
    pub delete_acked: bool,
}

/// Default [`ConsumerConfig::batch_size`].
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// Default [`ConsumerConfig::block_timeout`].
pub const DEFAULT_BLOCK_TIMEOUT: Duration = Duration::from_secs(1);
/// Default [`ConsumerConfig::dedup_ttl`].
pub const DEFAULT_DEDUP_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default [`ConsumerConfig::claim_idle_timeout`].
pub const DEFAULT_CLAIM_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`ConsumerConfig::claim_interval`].
pub const DEFAULT_CLAIM_INTERVAL: Duration = Duration::from_secs(5);
/// Default [`ConsumerConfig::max_deliveries`].
pub const DEFAULT_MAX_DELIVERIES: u64 = 5;
/// Default [`ConsumerConfig::reconnect_attempts`].
pub const DEFAULT_RECONNECT_ATTEMPTS: u32 = 10;

/// Upper bound for durations sent to Redis in milliseconds: keeps the arithmetic far from
/// overflow and catches unit mistakes (a "timeout" of years).
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

impl ConsumerConfig {
    /// A configuration for consuming `stream` as part of `group`, with every other setting at
    /// its default.
    pub fn new(redis_url: impl Into<String>, stream: impl Into<String>, group: impl Into<String>) -> Self {
        let stream = stream.into();
        let group = group.into();
        ConsumerConfig {
            redis_url: redis_url.into(),
            redis_mode: RedisMode::Standalone,
            password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            consumer_name: default_consumer_name(),
            group_start_id: "0".to_string(),
            batch_size: DEFAULT_BATCH_SIZE,
            block_timeout: DEFAULT_BLOCK_TIMEOUT,
            dedup_prefix: format!("outbox:dedup:{group}"),
            dedup_ttl: DEFAULT_DEDUP_TTL,
            claim_idle_timeout: DEFAULT_CLAIM_IDLE_TIMEOUT,
            claim_interval: DEFAULT_CLAIM_INTERVAL,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter_stream: format!("{stream}:dead"),
            reconnect_attempts: DEFAULT_RECONNECT_ATTEMPTS,
            delete_acked: false,
            stream,
            group,
        }
    }

    /// Checks that the settings can work together; the error names the setting and its value.
    pub fn validate(&self) -> Result<(), ConsumerError> {
        let invalid = |message: String| Err(ConsumerError::InvalidConfig(message));
        for (name, value) in [
            ("redis_url", &self.redis_url),
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer_name", &self.consumer_name),
            ("group_start_id", &self.group_start_id),
            ("dedup_prefix", &self.dedup_prefix),
            ("dead_letter_stream", &self.dead_letter_stream),
        ] {
            if value.is_empty() {
                return invalid(format!("{name} must not be empty"));
            }
        }
        if self.dead_letter_stream == self.stream {
            return invalid(format!(
                "dead_letter_stream must differ from stream (both are {:?}), or dead letters would be consumed again",
                self.stream
            ));
        }
        if self.batch_size == 0 {
            return invalid("batch_size must be at least 1, got 0".to_string());
        }
        if self.max_deliveries == 0 {
            return invalid("max_deliveries must be at least 1, got 0".to_string());
        }
        if self.dedup_ttl < Duration::from_secs(1) {
            return invalid(format!("dedup_ttl must be at least 1 s, got {:?}", self.dedup_ttl));
        }
        if self.claim_idle_timeout < Duration::from_millis(1) {
            // Zero would let XAUTOCLAIM take entries that another consumer is handling right now.
            return invalid(format!("claim_idle_timeout must be at least 1 ms, got {:?}", self.claim_idle_timeout));
        }
        for (name, value) in [
            ("block_timeout", self.block_timeout),
            ("dedup_ttl", self.dedup_ttl),
            ("claim_idle_timeout", self.claim_idle_timeout),
            ("claim_interval", self.claim_interval),
        ] {
            if value > MAX_DURATION {
                return invalid(format!("{name} must be at most one year, got {value:?}"));
            }
        }
        for (name, value) in [
            ("password_file", &self.password_file),
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
        ] {
            if value.as_ref().is_some_and(|path| path.as_os_str().is_empty()) {
                return invalid(format!("{name} must not be an empty path"));
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return invalid("tls_cert_file and tls_key_file must be set together (mutual TLS needs both)".to_string());
        }
        // The URL: its form for the mode, TLS consistency; never echoes credentials.
        check_url(self).map_err(ConsumerError::InvalidConfig)?;
        if self.redis_mode == RedisMode::Cluster {
            let tag = hash_slot_part(&self.stream);
            let probe = format!("{}:{{{tag}}}:", self.dedup_prefix);
            if hash_slot_part(&probe) != tag {
                return invalid(format!(
                    "in cluster mode the dedup keys <dedup_prefix>:{{<stream>}}:<event_id> must hash to the stream's slot, \
                     which dedup_prefix {:?} with stream {:?} prevents: dedup_prefix must not contain '{{' (unless it \
                     holds the stream's own hash tag), and a stream without a hash tag must not contain '}}'",
                    self.dedup_prefix, self.stream
                ));
            }
        }
        Ok(())
    }

    /// The dedup key of an event: `<dedup_prefix>:<event_id>` in standalone mode. In cluster mode
    /// `<dedup_prefix>:{<tag>}:<event_id>`, where `<tag>` is the part of the stream name Redis
    /// Cluster hashes (its hash tag if it has one, else the whole name), so that the key lives in
    /// the stream's slot and "mark done + acknowledge" stays one atomic script on one node.
    pub fn dedup_key(&self, event_id: &str) -> String {
        match self.redis_mode {
            RedisMode::Standalone => format!("{}:{event_id}", self.dedup_prefix),
            RedisMode::Cluster => format!("{}:{{{}}}:{event_id}", self.dedup_prefix, hash_slot_part(&self.stream)),
        }
    }
}

/// The part of a key that Redis Cluster hashes to find its slot: the content of the first
/// `{...}` when it is not empty, otherwise the whole key (the rule of the Redis Cluster spec).
pub(crate) fn hash_slot_part(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        let rest = &key[open + 1..];
        if let Some(close) = rest.find('}') {
            if close > 0 {
                return &rest[..close];
            }
        }
    }
    key
}

/// The default consumer name, `<hostname>-<pid>`: unique per process on a host, and it tells an
/// operator reading XINFO CONSUMERS where a consumer runs. Several consumers in one process
/// (threads) need names of their own.
pub fn default_consumer_name() -> String {
    let host = hostname().unwrap_or_else(|| "localhost".to_string());
    format!("{host}-{}", std::process::id())
}

#[cfg(unix)]
#[allow(unsafe_code)]
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call, and
    // gethostname writes at most that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    // A name that filled the buffer may lack its NUL (truncated); fall back rather than guess.
    let end = buf.iter().position(|&b| b == 0)?;
    let name = String::from_utf8_lossy(buf.get(..end)?).into_owned();
    (!name.is_empty()).then_some(name)
}

#[cfg(not(unix))]
fn hostname() -> Option<String> {
    std::env::var("COMPUTERNAME").ok().filter(|name| !name.is_empty())
}

/// Checks `redis_url` against the mode and the TLS settings without connecting: it must parse,
/// name one server (standalone) or only TCP nodes of one TLS mode and database 0 (cluster), must
/// not ask to skip certificate verification, and must be `rediss://` if certificates are given.
pub(crate) fn check_url(config: &ConsumerConfig) -> Result<(), String> {
    node_infos(config).map(|_| ())
}

/// The parsed node addresses of `redis_url` for the mode (one for standalone), after the checks
/// of [`check_url`].
pub(crate) fn node_infos(config: &ConsumerConfig) -> Result<Vec<ConnectionInfo>, String> {
    let url = config.redis_url.trim();
    let urls = node_urls(url)?;
    if config.redis_mode == RedisMode::Standalone && urls.len() > 1 {
        return Err(format!(
            "redis_url lists {} nodes, which is a Redis Cluster seed list: use cluster mode (--redis-mode cluster), \
             or give one server",
            urls.len()
        ));
    }
    let mut infos = Vec::with_capacity(urls.len());
    for (index, node) in urls.iter().enumerate() {
        let info = node.as_str().into_connection_info().map_err(|_| {
            let which = if urls.len() > 1 { format!(" (node {})", index + 1) } else { String::new() };
            format!("redis_url is not a valid Redis URL{which}: {}", describe_location(node))
        })?;
        match info.addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => return Err(invalid_url(
                "asks for #insecure TLS; the server's certificate is always verified (give its CA with tls_ca_file)",
            )),
            ConnectionAddr::Unix(_) if config.redis_mode == RedisMode::Cluster => {
                return Err(invalid_url("names a Unix socket; Redis Cluster nodes are reached over TCP"));
            }
            _ => {}
        }
        let settings = info.redis_settings();
        if settings.username().is_some() && settings.password().is_none() && config.password_file.is_none() {
            // The client would not authenticate at all and silently be the default user.
            return Err(invalid_url(
                "names a user but no password: put the password in the URL or, better, in password_file",
            ));
        }
        if config.redis_mode == RedisMode::Cluster && settings.db() != 0 {
            return Err(invalid_url("selects a database other than 0; Redis Cluster has database 0 only"));
        }
        infos.push(info);
    }
    let tls: Vec<bool> = infos.iter().map(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. })).collect();
    if tls.iter().any(|&t| t) && !tls.iter().all(|&t| t) {
        return Err(invalid_url("mixes rediss:// and redis:// nodes; use one scheme for all"));
    }
    let any_tls_file = config.tls_ca_file.is_some() || config.tls_cert_file.is_some() || config.tls_key_file.is_some();
    if any_tls_file && !tls.first().copied().unwrap_or(false) {
        // Better refuse than send in the clear what the operator meant to protect.
        return Err(
            "tls_ca_file, tls_cert_file or tls_key_file is set but redis_url is not a rediss:// URL".to_string()
        );
    }
    Ok(infos)
}

pub(crate) fn invalid_url(what: &str) -> String {
    format!("redis_url {what}")
}

/// One URL per node `redis_url` names (the forms it may take: outbox_protocol's `redis_url`).
pub(crate) fn node_urls(url: &str) -> Result<Vec<String>, String> {
    redis_url::node_urls(url).map_err(|e| format!("redis_url {e}"))
}

/// What follows the credentials of a URL, up to any query: safe to show in an error.
fn describe_location(url: &str) -> String {
    format!("{:?}", redis_url::location(url))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ConsumerConfig {
        ConsumerConfig::new("redis://127.0.0.1/", "outbox:order", "billing")
    }

    #[test]
    fn defaults() {
        let c = config();
        assert_eq!(c.batch_size, 100);
        assert_eq!(c.block_timeout, Duration::from_secs(1));
        assert_eq!(c.dedup_prefix, "outbox:dedup:billing");
        assert_eq!(c.dedup_ttl, Duration::from_secs(86_400));
        assert_eq!(c.claim_idle_timeout, Duration::from_secs(30));
        assert_eq!(c.max_deliveries, 5);
        assert_eq!(c.dead_letter_stream, "outbox:order:dead");
        assert_eq!(c.group_start_id, "0");
        assert!(c.consumer_name.ends_with(&format!("-{}", std::process::id())), "{}", c.consumer_name);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn redis_mode_parses_and_prints() {
        assert_eq!("cluster".parse::<RedisMode>(), Ok(RedisMode::Cluster));
        assert_eq!("Standalone".parse::<RedisMode>(), Ok(RedisMode::Standalone));
        assert!("sentinel".parse::<RedisMode>().expect_err("unknown").contains("standalone or cluster"));
        assert_eq!(RedisMode::Cluster.to_string(), "cluster");
        assert_eq!(RedisMode::default(), RedisMode::Standalone);
    }

    #[test]
    fn hash_slot_part_follows_the_cluster_spec() {
        assert_eq!(hash_slot_part("outbox:order"), "outbox:order");
        assert_eq!(hash_slot_part("outbox:{order}:x"), "order");
        assert_eq!(hash_slot_part("{a}{b}"), "a");
        assert_eq!(hash_slot_part("a{}b"), "a{}b", "an empty tag hashes the whole key");
        assert_eq!(hash_slot_part("a{b"), "a{b");
        assert_eq!(hash_slot_part("{{a}"), "{a");
    }

    #[test]
    fn dedup_keys_are_unchanged_in_standalone_and_hash_tagged_in_cluster_mode() {
        let mut c = config();
        assert_eq!(c.dedup_key("e1"), "outbox:dedup:billing:e1");
        c.redis_mode = RedisMode::Cluster;
        assert_eq!(c.dedup_key("e1"), "outbox:dedup:billing:{outbox:order}:e1");
        assert_eq!(hash_slot_part(&c.dedup_key("e1")), hash_slot_part(&c.stream));
        c.stream = "outbox:{order}".to_string();
        c.dead_letter_stream = "outbox:{order}:dead".to_string();
        assert_eq!(c.dedup_key("e1"), "outbox:dedup:billing:{order}:e1");
        assert!(c.validate().is_ok());
        // A prefix holding the stream's own tag keeps the key in the stream's slot.
        c.dedup_prefix = "dedup:{order}".to_string();
        assert!(c.validate().is_ok());
        assert_eq!(hash_slot_part(&c.dedup_key("e1")), "order");
        // Any other brace in the prefix, or a stray '}' in an untagged stream name, would not.
        for (prefix, stream) in [("dedup:{x}", "outbox:{order}"), ("dedup{", "outbox:order"), ("d", "a}b")] {
            c.dedup_prefix = prefix.to_string();
            c.stream = stream.to_string();
            match c.validate() {
                Err(ConsumerError::InvalidConfig(m)) => assert!(m.contains("dedup_prefix"), "{m}"),
                other => panic!("{prefix} / {stream}: expected InvalidConfig, got {other:?}"),
            }
        }
        // Standalone mode does not care.
        c.redis_mode = RedisMode::Standalone;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn validation_names_the_setting() {
        type Change = fn(&mut ConsumerConfig);
        let cases: Vec<(Change, &str)> = vec![
            (|c| c.stream.clear(), "stream"),
            (|c| c.group.clear(), "group"),
            (|c| c.consumer_name.clear(), "consumer_name"),
            (|c| c.batch_size = 0, "batch_size"),
            (|c| c.max_deliveries = 0, "max_deliveries"),
            (|c| c.dedup_ttl = Duration::from_millis(500), "dedup_ttl"),
            (|c| c.claim_idle_timeout = Duration::ZERO, "claim_idle_timeout"),
            (|c| c.block_timeout = Duration::from_secs(400 * 86_400), "block_timeout"),
            (|c| c.dead_letter_stream = c.stream.clone(), "dead_letter_stream"),
            (|c| c.tls_cert_file = Some("c.crt".into()), "tls_key_file"),
            (|c| c.tls_key_file = Some("c.key".into()), "tls_cert_file"),
            (|c| c.password_file = Some("".into()), "password_file"),
            (|c| c.tls_ca_file = Some("ca.crt".into()), "rediss://"),
            (|c| c.redis_url = "redis://a:1,b:2".into(), "cluster"),
        ];
        for (change, name) in cases {
            let mut c = config();
            change(&mut c);
            match c.validate() {
                Err(ConsumerError::InvalidConfig(message)) => assert!(message.contains(name), "{message}"),
                other => panic!("{name}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    fn config_of(url: &str, mode: RedisMode) -> ConsumerConfig {
        let mut c = ConsumerConfig::new(url, "outbox:order", "billing");
        c.redis_mode = mode;
        c
    }

    #[test]
    fn compact_seed_list_shares_scheme_credentials_and_suffix() {
        assert_eq!(
            node_urls("redis://u:p@10.0.0.1:7000,10.0.0.2:7001/").expect("valid"),
            vec!["redis://u:p@10.0.0.1:7000/", "redis://u:p@10.0.0.2:7001/"]
        );
        assert_eq!(node_urls("rediss://h1:1, h2:2").expect("valid"), vec!["rediss://h1:1", "rediss://h2:2"]);
        // A comma (or an @) in the password does not split the list: credentials end at the last @.
        assert_eq!(
            node_urls("redis://u:a,b@c@h1:1,h2:2").expect("valid"),
            vec!["redis://u:a,b@c@h1:1", "redis://u:a,b@c@h2:2"]
        );
        assert_eq!(node_urls("redis://[::1]:7000").expect("valid"), vec!["redis://[::1]:7000"]);
    }

    #[test]
    fn full_url_lists_and_mixes() {
        assert_eq!(node_urls("redis://a:1/,redis://b:2/").expect("valid"), vec!["redis://a:1/", "redis://b:2/"]);
        assert_eq!(
            node_urls("redis://u:p@a:1,b:2,redis://c:3").expect("valid"),
            vec!["redis://u:p@a:1", "redis://u:p@b:2", "redis://c:3"]
        );
        assert!(node_urls("redis://a:1,,b:2").is_err());
        assert!(node_urls("a:1").is_err());
        assert!(node_urls("").is_err());
    }

    #[test]
    fn url_checks_name_the_problem_and_never_the_password() {
        let cases = [
            ("redis://u:secret@a:1,b:2", RedisMode::Standalone, "cluster mode"),
            ("rediss://u:secret@a:1/#insecure", RedisMode::Standalone, "#insecure"),
            ("rediss://u:secret@a:1,redis://u:secret@b:2", RedisMode::Cluster, "mixes"),
            ("redis://u:secret@a:1/3", RedisMode::Cluster, "database"),
            ("redis+unix:///tmp/r.sock", RedisMode::Cluster, "Unix socket"),
            ("http://u:secret@a:1", RedisMode::Standalone, "must start with redis://"),
            ("redis://u@a:1", RedisMode::Standalone, "no password"),
        ];
        for (url, mode, needle) in cases {
            match check_url(&config_of(url, mode)) {
                Err(message) => {
                    assert!(message.contains(needle), "{url}: {message}");
                    assert!(!message.contains("secret"), "{url}: {message}");
                }
                Ok(()) => panic!("{url} accepted"),
            }
        }
        assert!(check_url(&config_of("redis://u:secret@a:1/0", RedisMode::Standalone)).is_ok());
        assert!(check_url(&config_of("redis://a:1,b:2,c:3", RedisMode::Cluster)).is_ok());
        assert!(check_url(&config_of("rediss://a:1/", RedisMode::Cluster)).is_ok());
    }

    #[test]
    fn certificates_need_a_tls_url() {
        let mut c = config_of("redis://127.0.0.1:6379/", RedisMode::Standalone);
        c.tls_ca_file = Some("/tmp/ca.crt".into());
        let message = check_url(&c).expect_err("plain URL with a CA file");
        assert!(message.contains("rediss://"), "{message}");
        c.redis_url = "rediss://127.0.0.1:6379/".to_string();
        assert!(check_url(&c).is_ok());
    }
}
