//! Every `outbox.*` setting: the statics PostgreSQL writes into, their registration, and typed
//! accessors. Settings the relays read are `SUSET`, so that each database can have its own with
//! `ALTER DATABASE ... SET` (a relay starts again when its database's settings change); those the
//! launcher reads for all databases (`outbox.databases`, `outbox.workers`) are `SIGHUP`, or
//! `POSTMASTER` when they shape worker registration or shared memory (`outbox.max_databases`).
//! The trace context an application passes to `outbox_enqueue` (`outbox.traceparent`,
//! `outbox.tracestate`) is `USERSET`, meant for `SET LOCAL`. Settings that may hold a secret are
//! `SUPERUSER_ONLY` and never logged.
//!
//! Each setting is described once for PostgreSQL, in its registration below (what `pg_settings`
//! shows), and once for people, in README's "Settings" table; a pg_test at the end checks that the
//! table lists exactly these settings with these defaults. The statics say only their default and
//! when a change takes effect.
//!
//! One file, longer than most, on purpose: every setting is declared, registered and read here,
//! so that there is one place to look for any of them (ParadeDB's and plrust's gucs.rs do the same).

use std::ffi::CString;
use std::os::raw::c_char;
use std::time::Duration;

use outbox_sink::redis::redact_url;
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::{pg_sys, PostgresGucEnum};

/// `outbox.redis_url` (default `redis://127.0.0.1:6379`, reload).
static REDIS_URL: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"redis://127.0.0.1:6379"));

/// `outbox.redis_password_file` (default empty, reload).
static REDIS_PASSWORD_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// `outbox.redis_tls_ca_file`, `outbox.redis_tls_cert_file`, `outbox.redis_tls_key_file`
/// (default empty, reload).
static REDIS_TLS_CA_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static REDIS_TLS_CERT_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static REDIS_TLS_KEY_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// How the relay finds Redis (`outbox.redis_mode`), as PostgreSQL lists the values; the relay's
/// settings turn it into outbox_sink's `RedisMode` (a crate without pgrx).
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum RedisMode {
    #[name = c"standalone"]
    Standalone,
    #[name = c"sentinel"]
    Sentinel,
    #[name = c"cluster"]
    Cluster,
}

/// `outbox.redis_mode` (default `standalone`, reload).
static REDIS_MODE: GucSetting<RedisMode> = GucSetting::<RedisMode>::new(RedisMode::Standalone);

/// `outbox.redis_sentinel_master` (default empty, reload).
static REDIS_SENTINEL_MASTER: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// `outbox.redis_wait_replicas` (default 0, reload).
static REDIS_WAIT_REPLICAS: GucSetting<i32> = GucSetting::<i32>::new(0);

/// `outbox.redis_timeout` (default 5s, reload).
static REDIS_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5_000);

/// `outbox.databases` (default empty = every database that has the extension, reload).
static DATABASES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// `outbox.database` (retired, restart).
static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// `outbox.workers` (default 1, reload).
static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);

/// `outbox.batch_size` (default 100, reload).
static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(100);

/// `outbox.poll_interval` (default 1s, reload).
static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1_000);

/// `outbox.linger` (default 10ms, reload).
static LINGER_MS: GucSetting<i32> = GucSetting::<i32>::new(10);

/// `outbox.stream` (default `outbox:{aggregate_type}`, reload).
static STREAM_TEMPLATE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"outbox:{aggregate_type}"));

/// `outbox.stream_maxlen` (default 0 = never trim, reload).
static STREAM_MAXLEN: GucSetting<i32> = GucSetting::<i32>::new(0);

/// How `outbox.stream_maxlen` trims (README, "Trimming").
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum StreamTrim {
    /// `XADD ... MAXLEN ~ n`: Redis trims whether or not the entries were read.
    #[name = c"length"]
    Length,
    /// `XADD ... ACKED MAXLEN = n` (Redis 8.2 or later): only entries every consumer group has
    /// acknowledged are trimmed; the length is a target, not a bound.
    #[name = c"acked"]
    Acked,
}

/// `outbox.stream_trim` (default `length`, reload).
static STREAM_TRIM: GucSetting<StreamTrim> = GucSetting::<StreamTrim>::new(StreamTrim::Length);

/// `outbox.max_payload_size` (default 1MB, at most 512MB, superuser may change per session).
static MAX_PAYLOAD_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);
pub const MAX_PAYLOAD_SIZE_CEILING: i32 = 512 * 1024 * 1024;

/// `outbox.allowed_streams` (default `*`, superuser only).
static ALLOWED_STREAMS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"*"));

/// `outbox.lease` (default 30s, reload).
static LEASE_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);

/// How events of one aggregate are ordered on their way to Redis.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ordering {
    /// An event waits until every earlier event of its aggregate is delivered (or skipped).
    #[name = c"aggregate"]
    Aggregate,
    /// Nothing waits: oldest first, but a retried event may arrive after later ones.
    #[name = c"none"]
    None,
}

/// `outbox.ordering` (default `aggregate`, reload).
static ORDERING: GucSetting<Ordering> = GucSetting::<Ordering>::new(Ordering::Aggregate);

/// `outbox.max_attempts` (default 10, reload).
static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(10);

/// `outbox.retry_delay` (default 1s, reload).
static RETRY_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(1_000);

/// `outbox.retention` (default 7 days, reload).
static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);

/// `outbox.alert_age` (default 5min, reload).
static ALERT_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(300);

/// `outbox.log_min_duration` (default 1s, reload).
static LOG_MIN_DURATION_MS: GucSetting<i32> = GucSetting::<i32>::new(1_000);

/// `outbox.enabled` (default on, reload).
static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(true);

/// `outbox.replay_on_loss` (default off, reload).
static REPLAY_ON_LOSS: GucSetting<bool> = GucSetting::<bool>::new(false);

/// The fields a stream entry carries (README, "Stream entries").
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum EntryFormat {
    /// outbox_pg's own fields: `event_id`, `aggregate_seq`, `payload`, ...
    #[name = c"native"]
    Native,
    /// CloudEvents 1.0 attributes, one field each: `specversion`, `id`, `source`, `data`, ...
    #[name = c"cloudevents"]
    CloudEvents,
}

/// `outbox.entry_format` (default `native`, reload).
static ENTRY_FORMAT: GucSetting<EntryFormat> = GucSetting::<EntryFormat>::new(EntryFormat::Native);

/// `outbox.cloudevents_source` (default `/outbox/{database}/{aggregate_type}`, reload).
static CLOUDEVENTS_SOURCE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"/outbox/{database}/{aggregate_type}"));

/// `outbox.traceparent`, `outbox.tracestate` (default empty; any role, any time, meant for
/// `SET LOCAL` in the enqueuing transaction).
static TRACEPARENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static TRACESTATE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// `outbox.max_databases` (default 16, server start).
static MAX_DATABASES: GucSetting<i32> = GucSetting::<i32>::new(16);

/// Registers every setting. `outbox.database` is `POSTMASTER`, which PostgreSQL only allows while
/// preloading, so it is defined only then.
pub fn init(preloading: bool) {
    define_redis_settings();
    define_database_settings(preloading);
    define_pacing_settings();
    define_stream_settings();
    define_delivery_settings();
    define_housekeeping_settings();
    define_entry_settings();
    // SAFETY: called from _PG_init with a valid, static, NUL-terminated prefix.
    unsafe { pg_sys::MarkGUCPrefixReserved(c"outbox".as_ptr()) };
}

/// Where Redis is and how the relay reaches it: URL, password file, TLS files, topology, replicas,
/// timeout.
fn define_redis_settings() {
    // SAFETY: `show_redis_url` is a `#[pg_guard]`ed show hook that only reads the setting.
    unsafe {
        // The URL may hold a password. SUPERUSER_ONLY alone is not enough: members of
        // pg_read_all_settings (pg_monitor) see such settings too, and pg_settings shows the raw
        // value in its reset_val and boot_val columns, past the show hook. NO_SHOW_ALL keeps the
        // setting out of pg_settings and SHOW ALL altogether; SHOW and current_setting() go
        // through the show hook, which masks the credentials for everyone.
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.redis_url",
            c"Redis URL the relay publishes to (redis:// or rediss://).",
            c"May contain a password: shown only masked, and left out of pg_settings. \
              Prefer outbox.redis_password_file for the password.",
            &REDIS_URL,
            GucContext::Suset,
            GucFlags::SUPERUSER_ONLY | GucFlags::NO_SHOW_ALL,
            Some(check_redis_url),
            None,
            Some(show_redis_url),
        );
    }
    GucRegistry::define_string_guc(
        c"outbox.redis_password_file",
        c"File holding the Redis password (overrides one in outbox.redis_url).",
        c"Read at every connect; keeps the password out of settings and logs.",
        &REDIS_PASSWORD_FILE,
        GucContext::Suset,
        GucFlags::SUPERUSER_ONLY,
    );
    for (name, short, setting) in [
        (
            c"outbox.redis_tls_ca_file",
            c"CA certificates (PEM) a rediss:// server's certificate must chain to; empty: the system's roots.",
            &REDIS_TLS_CA_FILE,
        ),
        (
            c"outbox.redis_tls_cert_file",
            c"Client certificate (PEM) for Redis servers that require mutual TLS.",
            &REDIS_TLS_CERT_FILE,
        ),
        (
            c"outbox.redis_tls_key_file",
            c"Client key (PEM) for outbox.redis_tls_cert_file; must be readable by its owner only.",
            &REDIS_TLS_KEY_FILE,
        ),
    ] {
        GucRegistry::define_string_guc(
            name,
            short,
            c"Read at every connect; the server's certificate is always verified.",
            setting,
            GucContext::Suset,
            GucFlags::SUPERUSER_ONLY,
        );
    }
    GucRegistry::define_enum_guc(
        c"outbox.redis_mode",
        c"How outbox.redis_url is read: standalone (one node), sentinel (the sentinels) or cluster (seed nodes).",
        c"With sentinel, the relay asks the sentinels for outbox.redis_sentinel_master at every connect; with cluster, it routes each stream key to its slot's master.",
        &REDIS_MODE,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_sentinel_master",
        c"Name of the master the sentinels monitor (outbox.redis_mode = sentinel).",
        c"",
        &REDIS_SENTINEL_MASTER,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.redis_wait_replicas",
        c"Replicas that must acknowledge each batch (Redis WAIT) before it counts as published.",
        c"0 (default): a batch counts once the master has it, and a failover can lose what the replica had not received yet. 1 or more: a failover to an acknowledged replica loses nothing; fewer replicas in time is a Redis failure, retried.",
        &REDIS_WAIT_REPLICAS,
        0,
        16,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.redis_timeout",
        c"Connect, read and write timeout for Redis.",
        c"A Redis that does not answer within it counts as unavailable; the batch is retried later.",
        &REDIS_TIMEOUT_MS,
        10,
        600_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
}

/// Which databases are relayed, and how many at most (`preloading`: see `init`).
fn define_database_settings(preloading: bool) {
    if preloading {
        GucRegistry::define_int_guc(
            c"outbox.max_databases",
            c"Most databases relayed at once: each has an entry in shared memory, sized at server start.",
            c"Databases beyond it, in the order of outbox.databases or else of their OIDs, get no relay and refuse outbox_enqueue.",
            &MAX_DATABASES,
            1,
            pg_sys::MAX_BACKENDS as i32,
            GucContext::Postmaster,
            GucFlags::empty(),
        );
        GucRegistry::define_string_guc(
            c"outbox.database",
            c"Retired: use outbox.databases. If set while outbox.databases is empty, only this database is relayed.",
            c"Takes effect at server start.",
            &DATABASE,
            GucContext::Postmaster,
            GucFlags::empty(),
        );
    }
    GucRegistry::define_string_guc(
        c"outbox.databases",
        c"Comma-separated databases whose outboxes are relayed; empty: every database where outbox_pg is installed.",
        c"Each relayed database gets outbox.workers relays, each in a max_worker_processes slot.",
        &DATABASES,
        GucContext::Sighup,
        GucFlags::empty(),
    );
}

/// How many relays per database, how much a round takes, how often an idle relay looks.
fn define_pacing_settings() {
    GucRegistry::define_int_guc(
        c"outbox.workers",
        c"Number of relay workers sharing the load.",
        c"Each needs a slot in max_worker_processes. Per-aggregate order holds across them.",
        &WORKERS,
        1,
        crate::shared::databases::MAX_RELAYS as i32,
        GucContext::Sighup,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.batch_size",
        c"Due events a round takes from the failure path.",
        c"",
        &BATCH_SIZE,
        1,
        10_000,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.poll_interval",
        c"How often the relay looks for work when no commit woke it.",
        c"Commits that enqueue wake the relay at once; this is only the safety net.",
        &POLL_INTERVAL_MS,
        10,
        3_600_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.linger",
        c"Under a steady stream of commits, the most the relay waits after a round to gather the next.",
        c"The latency it may add to save CPU at high rates; 0 sends every round at once (docs/worker.md, \"Coalescing\").",
        &LINGER_MS,
        0,
        10_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
}

/// Which streams events go to, how they are trimmed, how large an event may be.
fn define_stream_settings() {
    // SAFETY: `check_allowed_streams` is a `#[pg_guard]`ed check hook that only reads the value.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.allowed_streams",
            c"Comma-separated glob patterns of the Redis streams events may be written to.",
            c"Checked by outbox_enqueue, for an explicit stream and for the outbox.stream template alike. \
              * matches any run of characters, ? one character, \\ makes the next one literal.",
            &ALLOWED_STREAMS,
            GucContext::Suset,
            GucFlags::empty(),
            Some(check_allowed_streams),
            None,
            None,
        );
    }
    // SAFETY: `check_stream_template` is a `#[pg_guard]`ed check hook that only reads the value.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.stream",
            c"Stream key template for events enqueued without a stream.",
            c"{aggregate_type} and {event_type} are replaced by the event's values.",
            &STREAM_TEMPLATE,
            GucContext::Suset,
            GucFlags::empty(),
            Some(check_stream_template),
            None,
            None,
        );
    }
    GucRegistry::define_int_guc(
        c"outbox.stream_maxlen",
        c"Stream length each XADD trims to (MAXLEN ~; exact with outbox.stream_trim = acked); 0 never trims.",
        c"",
        &STREAM_MAXLEN,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_enum_guc(
        c"outbox.stream_trim",
        c"How outbox.stream_maxlen trims: length (whatever was read) or acked (what every consumer group acknowledged).",
        c"acked needs Redis 8.2 or later (XADD ... ACKED); against an older Redis the relay publishes nothing and says why.",
        &STREAM_TRIM,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.max_payload_size",
        c"Largest payload (as JSON text) outbox_enqueue accepts.",
        c"",
        &MAX_PAYLOAD_SIZE,
        1,
        MAX_PAYLOAD_SIZE_CEILING,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
}

/// How events are delivered: leases, ordering, the failure path, the switch, repairs.
fn define_delivery_settings() {
    GucRegistry::define_int_guc(
        c"outbox.lease",
        c"How old a relay's lease may grow before the other relays take its shards over.",
        c"The shards of a relay that exited are taken at once; this bounds how long a hung relay keeps them.",
        &LEASE_MS,
        1_000,
        86_400_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_enum_guc(
        c"outbox.ordering",
        c"Per-aggregate ordering of deliveries: aggregate (wait for earlier events) or none.",
        c"With aggregate, a failed event holds back the later events of its aggregate until it is retried or skipped.",
        &ORDERING,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.max_attempts",
        c"Rejections by Redis caused by the event itself before it is dead-lettered.",
        c"Failures of Redis as a whole (unreachable, OOM, LOADING, ...) never count.",
        &MAX_ATTEMPTS,
        1,
        1_000_000,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_int_guc(
        c"outbox.retry_delay",
        c"First per-event backoff after Redis rejected an event; doubles per rejection, at most 5 minutes.",
        c"",
        &RETRY_DELAY_MS,
        1,
        300_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_bool_guc(
        c"outbox.enabled",
        c"Whether the relay publishes; off pauses it while enqueue keeps working.",
        c"",
        &ENABLED,
        GucContext::Suset,
        GucFlags::empty(),
    );
    GucRegistry::define_bool_guc(
        c"outbox.replay_on_loss",
        c"Whether the relays replay what Redis lost of a stream as soon as they notice it.",
        c"Off: the loss is logged and shown in outbox.stats.redis_data_loss and outbox.redis_losses, and outbox.repair_losses() replays it.",
        &REPLAY_ON_LOSS,
        GucContext::Suset,
        GucFlags::empty(),
    );
}

/// Retention, the age alert, slow-round logs.
fn define_housekeeping_settings() {
    GucRegistry::define_int_guc(
        c"outbox.retention",
        c"How long published events are kept at least; 0 keeps them. They are removed a whole log table at a time.",
        c"Failed events are never removed by retention; outbox.purge() removes published ones sooner on request.",
        &RETENTION_S,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.alert_age",
        c"Age of the oldest pending event above which the relay logs a WARNING; 0 disables.",
        c"Checked every second, also while outbox.enabled is off.",
        &ALERT_AGE_S,
        0,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.log_min_duration",
        c"Relay rounds and housekeeping passes taking at least this long are logged with their phases; -1 disables.",
        c"A round is claim, publish to Redis and settle; housekeeping is the reaper, the age check and retention.",
        &LOG_MIN_DURATION_MS,
        -1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    #[cfg(feature = "fault-injection")]
    crate::faults::define_setting();
}

/// What an entry carries: its format, the CloudEvents source, trace context.
fn define_entry_settings() {
    GucRegistry::define_enum_guc(
        c"outbox.entry_format",
        c"The fields of each stream entry: native (outbox_pg's own) or cloudevents (CloudEvents 1.0 attributes).",
        c"cloudevents writes one field per attribute, as the Kafka binding's binary mode does, with data as its own field.",
        &ENTRY_FORMAT,
        GucContext::Suset,
        GucFlags::empty(),
    );
    // SAFETY: the check hooks are `#[pg_guard]`ed and only read the proposed value.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.cloudevents_source",
            c"The source attribute of CloudEvents entries (outbox.entry_format = cloudevents).",
            c"{database}, {aggregate_type} and {event_type} are replaced by the event's values, percent-encoded for the part of the URI they stand in.",
            &CLOUDEVENTS_SOURCE,
            GucContext::Suset,
            GucFlags::empty(),
            Some(check_cloudevents_source),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.traceparent",
            c"W3C traceparent of the events enqueued while it is set, unless their headers carry one.",
            c"Set it with SET LOCAL in the enqueuing transaction: outbox_enqueue stores it in the event's headers and the relay writes it as an entry field.",
            &TRACEPARENT,
            GucContext::Userset,
            GucFlags::empty(),
            Some(check_traceparent),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.tracestate",
            c"W3C tracestate that goes with outbox.traceparent.",
            c"Set it with SET LOCAL in the enqueuing transaction, together with outbox.traceparent.",
            &TRACESTATE,
            GucContext::Userset,
            GucFlags::empty(),
            Some(check_tracestate),
            None,
            None,
        );
    }
}

fn string_of(setting: &GucSetting<Option<CString>>) -> String {
    setting.get().map(|value| value.to_string_lossy().into_owned()).unwrap_or_default()
}

pub fn redis_url() -> String {
    string_of(&REDIS_URL)
}

/// The password file path, or `None` when unset.
pub fn redis_password_file() -> Option<String> {
    Some(string_of(&REDIS_PASSWORD_FILE)).filter(|path| !path.is_empty())
}

pub fn redis_tls_ca_file() -> Option<String> {
    Some(string_of(&REDIS_TLS_CA_FILE)).filter(|path| !path.is_empty())
}

pub fn redis_tls_cert_file() -> Option<String> {
    Some(string_of(&REDIS_TLS_CERT_FILE)).filter(|path| !path.is_empty())
}

pub fn redis_tls_key_file() -> Option<String> {
    Some(string_of(&REDIS_TLS_KEY_FILE)).filter(|path| !path.is_empty())
}

pub fn redis_mode() -> RedisMode {
    REDIS_MODE.get()
}

pub fn redis_sentinel_master() -> String {
    string_of(&REDIS_SENTINEL_MASTER)
}

pub fn redis_wait_replicas() -> u32 {
    REDIS_WAIT_REPLICAS.get().max(0) as u32
}

pub fn redis_timeout() -> Duration {
    Duration::from_millis(REDIS_TIMEOUT_MS.get().max(1) as u64)
}

/// The databases the launcher may relay, `None` meaning every database with the extension:
/// `outbox.databases`, or else the retired `outbox.database`.
pub fn databases() -> Option<Vec<String>> {
    let listed = parse_database_list(&string_of(&DATABASES));
    if !listed.is_empty() {
        return Some(listed);
    }
    Some(retired_database()).filter(|name| !name.is_empty()).map(|name| vec![name])
}

/// Whether `outbox.databases` lists databases (rather than the retired `outbox.database`, or none).
pub fn databases_listed() -> bool {
    !parse_database_list(&string_of(&DATABASES)).is_empty()
}

/// `outbox.database`, if set (retired).
pub fn retired_database() -> String {
    string_of(&DATABASE)
}

/// Splits `a, b,"c d"` into names: commas separate, blanks around names are dropped, double quotes
/// keep a name's commas and blanks (as identifiers are quoted).
pub fn parse_database_list(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut was_quoted = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                current.push('"');
                chars.next();
            }
            '"' => {
                if !quoted && current.trim().is_empty() {
                    current.clear();
                }
                quoted = !quoted;
                was_quoted = true;
            }
            ',' if !quoted => {
                let name = if was_quoted { current.clone() } else { current.trim().to_string() };
                if !name.is_empty() {
                    names.push(name);
                }
                current.clear();
                was_quoted = false;
            }
            c if !quoted && was_quoted && c.is_whitespace() => {}
            c => current.push(c),
        }
    }
    let name = if was_quoted { current } else { current.trim().to_string() };
    if !name.is_empty() {
        names.push(name);
    }
    names
}

pub fn workers() -> usize {
    WORKERS.get().clamp(1, crate::shared::databases::MAX_RELAYS as i32) as usize
}

pub fn batch_size() -> usize {
    BATCH_SIZE.get().max(1) as usize
}

pub fn poll_interval() -> Duration {
    Duration::from_millis(POLL_INTERVAL_MS.get().max(1) as u64)
}

pub fn linger() -> Duration {
    Duration::from_millis(LINGER_MS.get().max(0) as u64)
}

pub fn stream_template() -> String {
    string_of(&STREAM_TEMPLATE)
}

/// `None` when trimming is off.
pub fn stream_maxlen() -> Option<u64> {
    Some(STREAM_MAXLEN.get() as u64).filter(|&n| n > 0)
}

pub fn stream_trim() -> StreamTrim {
    STREAM_TRIM.get()
}

pub fn max_payload_size() -> i32 {
    MAX_PAYLOAD_SIZE.get()
}

pub fn allowed_streams() -> String {
    string_of(&ALLOWED_STREAMS)
}

pub fn lease_ms() -> i32 {
    LEASE_MS.get()
}

pub fn lease() -> std::time::Duration {
    std::time::Duration::from_millis(LEASE_MS.get().max(1) as u64)
}

pub fn ordering() -> Ordering {
    ORDERING.get()
}

pub fn max_attempts() -> i32 {
    MAX_ATTEMPTS.get()
}

pub fn retry_delay_ms() -> i32 {
    RETRY_DELAY_MS.get()
}

/// Seconds, `None` when events are kept forever.
pub fn retention_s() -> Option<i32> {
    Some(RETENTION_S.get()).filter(|&s| s > 0)
}

/// `None` when alerting is off.
pub fn alert_age() -> Option<Duration> {
    Some(ALERT_AGE_S.get()).filter(|&s| s > 0).map(|s| Duration::from_secs(s as u64))
}

/// `None` when slow-round logging is off.
pub fn log_min_duration() -> Option<Duration> {
    Some(LOG_MIN_DURATION_MS.get()).filter(|&ms| ms >= 0).map(|ms| Duration::from_millis(ms as u64))
}

pub fn enabled() -> bool {
    ENABLED.get()
}

pub fn replay_on_loss() -> bool {
    REPLAY_ON_LOSS.get()
}

pub fn entry_format() -> EntryFormat {
    ENTRY_FORMAT.get()
}

pub fn cloudevents_source() -> String {
    string_of(&CLOUDEVENTS_SOURCE)
}

/// A string setting's value, `None` when unset or empty; an unset one is not copied (enqueue reads
/// these on every call).
fn non_empty(setting: &GucSetting<Option<CString>>) -> Option<String> {
    // SAFETY: the setting's storage, which PostgreSQL keeps NULL or pointing at a NUL-terminated
    // string for as long as the setting has that value.
    let unset = unsafe {
        let raw = *setting.as_ptr();
        raw.is_null() || *raw == 0
    };
    if unset {
        None
    } else {
        Some(string_of(setting))
    }
}

/// `outbox.traceparent`, `None` when not set.
pub fn traceparent() -> Option<String> {
    non_empty(&TRACEPARENT)
}

/// `outbox.tracestate`, `None` when not set.
pub fn tracestate() -> Option<String> {
    non_empty(&TRACESTATE)
}

/// `outbox.max_databases` as it was at server start (a `POSTMASTER` setting).
pub fn max_databases() -> usize {
    MAX_DATABASES.get().max(1) as usize
}

/// Shows `outbox.redis_url` with its password masked, in `SHOW`, `current_setting()` and
/// `pg_settings` alike, so that even superusers' monitoring never prints the secret.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn show_redis_url() -> *const c_char {
    thread_local! {
        static SHOWN: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
    }
    let masked = CString::new(redact_url(&redis_url())).unwrap_or_default();
    // PostgreSQL copies the returned string before the next call, so a per-process buffer is enough.
    SHOWN.with(|shown| {
        *shown.borrow_mut() = masked;
        shown.borrow().as_ptr()
    })
}

/// The value a string setting's check hook is asked about; `None` for NULL (nothing to check).
///
/// # Safety
/// `newval` points at the proposed value, a NUL-terminated string or NULL, as PostgreSQL passes it.
unsafe fn proposed_value(newval: *mut *mut c_char) -> Option<String> {
    // SAFETY: per the contract above.
    unsafe {
        let value = *newval;
        (!value.is_null()).then(|| std::ffi::CStr::from_ptr(value).to_string_lossy().into_owned())
    }
}

/// Refuses an `outbox.redis_url` that carries a password when it comes from the catalog
/// (`ALTER DATABASE ... SET`, `ALTER ROLE ... SET`, a function's `SET` clause): those values are
/// stored in `pg_db_role_setting` and `pg_proc`, which every role can read. The password then
/// belongs in `outbox.redis_password_file`, which may be set per database too.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_redis_url(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    source: pg_sys::GucSource::Type,
) -> bool {
    let from_catalog = matches!(
        source,
        pg_sys::GucSource::PGC_S_TEST
            | pg_sys::GucSource::PGC_S_DATABASE
            | pg_sys::GucSource::PGC_S_USER
            | pg_sys::GucSource::PGC_S_DATABASE_USER
    );
    if !from_catalog {
        return true;
    }
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    let Some(value) = (unsafe { proposed_value(newval) }) else { return true };
    if !outbox_sink::address::has_password(&value) {
        return true;
    }
    // SAFETY: as in check_string: palloc'd copies of static strings.
    unsafe {
        pg_sys::GUC_check_errmsg_string = pg_sys::pstrdup(
            c"outbox.redis_url may not carry a password when set with ALTER DATABASE, ALTER ROLE or a function's SET clause: every role can read those settings"
                .as_ptr(),
        );
        pg_sys::GUC_check_errhint_string = pg_sys::pstrdup(
            c"Leave the password out of the URL and set outbox.redis_password_file (per database too), or set the URL in postgresql.conf."
                .as_ptr(),
        );
    }
    false
}

/// A string setting's check hook body: `check` says why the proposed value cannot be, if it
/// cannot; PostgreSQL then refuses it with 22023, naming it, with the reason as its DETAIL and
/// `hint` as its HINT. NULL passes.
///
/// # Safety
/// `newval` is what PostgreSQL passes a string setting's check hook.
unsafe fn check_string(
    newval: *mut *mut c_char,
    check: impl FnOnce(&str) -> Result<(), String>,
    hint: Option<&str>,
) -> bool {
    // SAFETY: per the contract above.
    let Some(value) = (unsafe { proposed_value(newval) }) else { return true };
    let Err(reason) = check(&value) else { return true };
    let detail = CString::new(reason).unwrap_or_default();
    let hint = hint.map(|hint| CString::new(hint).unwrap_or_default());
    // SAFETY: both strings must be palloc'd, as the GUC_check_errdetail and GUC_check_errhint
    // macros make them; pstrdup copies into the current memory context.
    unsafe {
        pg_sys::GUC_check_errdetail_string = pg_sys::pstrdup(detail.as_ptr());
        if let Some(hint) = hint {
            pg_sys::GUC_check_errhint_string = pg_sys::pstrdup(hint.as_ptr());
        }
    }
    false
}

/// Refuses an `outbox.allowed_streams` that does not parse (an empty pattern, a trailing `\`).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_allowed_streams(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    unsafe { check_string(newval, outbox_sink::streams::validate, None) }
}

/// Refuses a blank or overlong `outbox.stream`.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_stream_template(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    let hint = "Use a Redis key of 1 to 512 bytes, such as 'outbox:{aggregate_type}'.";
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    unsafe { check_string(newval, outbox_sink::entry::check_stream_template, Some(hint)) }
}

/// Refuses an `outbox.cloudevents_source` that is not a URI reference or names an unknown
/// placeholder.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_cloudevents_source(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    let hint = "Use a URI reference such as '/outbox/{database}/{aggregate_type}' or 'https://example.com/billing'.";
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    unsafe { check_string(newval, outbox_sink::entry::check_source_template, Some(hint)) }
}

/// Refuses an `outbox.traceparent` that is not a W3C traceparent of version 00 (empty unsets it).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_traceparent(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    let check = |value: &str| if value.is_empty() { Ok(()) } else { outbox_protocol::trace::check_traceparent(value) };
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    unsafe { check_string(newval, check, Some(outbox_protocol::trace::TRACEPARENT_HINT)) }
}

/// Refuses an `outbox.tracestate` that is not a W3C tracestate.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_tracestate(
    newval: *mut *mut c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes a check hook a valid pointer to the proposed value.
    unsafe {
        check_string(newval, outbox_protocol::trace::check_tracestate, Some(outbox_protocol::trace::TRACESTATE_HINT))
    }
}

#[cfg(test)]
mod unit {
    use super::parse_database_list;

    #[test]
    fn database_lists_split_on_commas_and_honour_quotes() {
        assert_eq!(parse_database_list(""), Vec::<String>::new());
        assert_eq!(parse_database_list(" app , billing,,"), vec!["app", "billing"]);
        assert_eq!(parse_database_list(r#"app, "Sales, EU" ,"say ""hi""""#), vec!["app", "Sales, EU", r#"say "hi""#]);
    }
}

/// README's "Settings" table against the settings this library defines: the same names, the same
/// defaults (as `SHOW` prints them), so that the table can be trusted.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// A default as `SHOW` prints it: a number with the largest unit that divides it exactly.
    fn shown(value: &str, unit: Option<&str>) -> String {
        let Ok(number) = value.parse::<i64>() else { return value.to_string() };
        let units: &[(&str, i64)] = match unit {
            Some("ms") => &[("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1_000), ("ms", 1)],
            Some("s") => &[("d", 86_400), ("h", 3_600), ("min", 60), ("s", 1)],
            Some("B") => &[("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10), ("B", 1)],
            Some("kB") => &[("TB", 1 << 30), ("GB", 1 << 20), ("MB", 1 << 10), ("kB", 1)],
            _ => &[],
        };
        if number <= 0 {
            return number.to_string();
        }
        units
            .iter()
            .find(|(_, size)| number % size == 0)
            .map_or(number.to_string(), |(name, size)| format!("{}{name}", number / size))
    }

    /// README's settings table: (names in the row's first cell, the default as written).
    fn readme_rows() -> Vec<(Vec<String>, String)> {
        let readme = include_str!("../README.md");
        let start = readme.find("\n## Settings\n").expect("README has a Settings section");
        let section = &readme[start + 1..];
        let section = &section[..section[1..].find("\n## ").map_or(section.len(), |end| end + 1)];
        section
            .lines()
            .filter(|line| line.starts_with("| `outbox."))
            .map(|line| {
                let cells: Vec<&str> = line.split(" | ").collect();
                let names =
                    cells[0].split('`').filter(|part| part.starts_with("outbox.")).map(str::to_string).collect();
                let default = cells[1].trim().trim_matches('`');
                (names, if default == "empty" { String::new() } else { default.to_string() })
            })
            .collect()
    }

    #[pg_test]
    fn readme_lists_every_setting_with_its_default() {
        // Every setting but outbox.redis_url, which pg_settings leaves out (it may hold a password).
        let defined: Vec<(String, String)> = Spi::connect(|client| {
            client
                .select(
                    "SELECT name::text, coalesce(boot_val, ''), unit FROM pg_settings WHERE name LIKE 'outbox.%' ORDER BY name",
                    None,
                    &[],
                )
                .unwrap()
                .map(|row| {
                    let unit: Option<String> = row.get(3).unwrap();
                    (row.get::<String>(1).unwrap().unwrap(), shown(&row.get::<String>(2).unwrap().unwrap(), unit.as_deref()))
                })
                .collect()
        });
        let rows = readme_rows();
        let documented = |name: &str| rows.iter().find(|(names, _)| names.iter().any(|n| n == name));
        for (name, default) in &defined {
            // The retired outbox.database is described in outbox.databases' row.
            if name == "outbox.database" {
                continue;
            }
            let Some((_, written)) = documented(name) else { panic!("README's Settings table lacks {name}") };
            assert_eq!(written, default, "README's default of {name}");
        }
        let (_, url_default) = documented("outbox.redis_url").expect("README documents outbox.redis_url");
        assert_eq!(url_default, "redis://127.0.0.1:6379");
        for (names, _) in &rows {
            for name in names {
                assert!(
                    name == "outbox.redis_url" || defined.iter().any(|(n, _)| n == name),
                    "README documents {name}, which this library does not define"
                );
            }
        }
    }
}
