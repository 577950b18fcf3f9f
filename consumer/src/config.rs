//! Consumer settings and their defaults.

use std::time::Duration;

use crate::error::ConsumerError;

/// Everything a [`crate::Consumer`] needs to know. Build it with [`ConsumerConfig::new`], which
/// fills in the defaults, then change the public fields as needed before
/// [`crate::Consumer::connect`] (which validates it).
///
/// Note that the defaults derived from other fields (`dedup_prefix` from `group`,
/// `dead_letter_stream` from `stream`) are computed by `new`; change them too if you change
/// `group` or `stream` afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// Redis connection URL, e.g. `redis://127.0.0.1:6379/0`.
    pub redis_url: String,
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
        Ok(())
    }
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
}
