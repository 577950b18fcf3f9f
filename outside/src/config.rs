//! The relay's settings: the `outbox.*` settings of src/guc.rs that a relay outside the server
//! reads, with the same names, units, ranges and defaults, plus `database_url`. Each comes from,
//! highest first: a flag (`--batch-size 50`, `--batch-size=50`), the environment
//! (`OUTBOX_BATCH_SIZE`), a file named by `--config FILE` or `OUTBOX_CONFIG` in postgresql.conf's
//! syntax (`name = value`, `#` comments, names with or without `outbox.`), then the default.
//!
//! Not mirrored, on purpose: `max_payload_size`, `allowed_streams`, `traceparent`, `tracestate`
//! (read by `outbox_enqueue` in the writers' sessions: set them in the database), `databases`,
//! `database`, `max_databases`, `workers` (one process relays one database; several processes
//! share its shards as the server's relays do), `enabled` (stop the process).
//!
//! The Redis password comes only from `redis_password_file` or `OUTBOX_REDIS_PASSWORD`: a Redis
//! URL that carries one is refused from every source (a flag shows in `ps`, a file or the
//! environment gets copied into tickets), saying how to pass it instead.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use outbox_sink::entry::{EntryFormat, EntrySettings};
use outbox_sink::{RedisConfig, RedisMode, TlsFiles};

/// The environment variable that holds the Redis password (never a flag, never a file's line).
pub const REDIS_PASSWORD_ENV: &str = "OUTBOX_REDIS_PASSWORD";
/// The environment variable that names the configuration file (as `--config`).
pub const CONFIG_ENV: &str = "OUTBOX_CONFIG";

/// The unit of an integer setting, as PostgreSQL's `GUC_UNIT_*`: the value is stored in it, and a
/// value may be written with any unit of its family (`5s` for a setting in milliseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    None,
    Ms,
    S,
}

/// A string setting's check: the reason a value cannot be, if it cannot.
type Check = fn(&str) -> Result<(), String>;

#[derive(Clone, Copy, Debug)]
enum Type {
    /// A string; its check refuses a bad one with the reason.
    Str(Option<Check>),
    Int {
        min: i64,
        max: i64,
        unit: Unit,
    },
    Bool,
    Enum(&'static [&'static str]),
}

/// One setting: its name (that of `outbox.NAME`), type, default as written, and a line of help.
struct Spec {
    name: &'static str,
    kind: Type,
    default: &'static str,
    help: &'static str,
}

const fn int(min: i64, max: i64, unit: Unit) -> Type {
    Type::Int { min, max, unit }
}

const I32_MAX: i64 = i32::MAX as i64;

/// Every setting, in the order `--help` lists them. Names, ranges and defaults are src/guc.rs's.
const SPECS: &[Spec] = &[
    Spec {
        name: "database_url",
        kind: Type::Str(Some(check_database_url)),
        default: "",
        help: "The database to relay (postgresql://... or key=value, sslmode as libpq's); one per process. Required.",
    },
    Spec {
        name: "redis_url",
        kind: Type::Str(Some(check_redis_url)),
        default: "redis://127.0.0.1:6379",
        help: "Redis URL (redis:// or rediss://), without a password.",
    },
    Spec {
        name: "redis_password_file",
        kind: Type::Str(None),
        default: "",
        help: "File holding the Redis password (or set OUTBOX_REDIS_PASSWORD).",
    },
    Spec {
        name: "redis_tls_ca_file",
        kind: Type::Str(None),
        default: "",
        help: "CA certificates (PEM) for rediss://; empty: the system's roots.",
    },
    Spec { name: "redis_tls_cert_file", kind: Type::Str(None), default: "", help: "Client certificate (PEM)." },
    Spec { name: "redis_tls_key_file", kind: Type::Str(None), default: "", help: "Client key (PEM)." },
    Spec {
        name: "redis_mode",
        kind: Type::Enum(&["standalone", "sentinel", "cluster"]),
        default: "standalone",
        help: "How redis_url is read: one node, the sentinels, or cluster seed nodes.",
    },
    Spec {
        name: "redis_sentinel_master",
        kind: Type::Str(None),
        default: "",
        help: "The master's name the sentinels monitor (redis_mode = sentinel).",
    },
    Spec {
        name: "redis_wait_replicas",
        kind: int(0, 16, Unit::None),
        default: "0",
        help: "Replicas that must acknowledge each batch (Redis WAIT).",
    },
    Spec {
        name: "redis_timeout",
        kind: int(10, 600_000, Unit::Ms),
        default: "5s",
        help: "Connect, read and write timeout for Redis.",
    },
    Spec {
        name: "batch_size",
        kind: int(1, 10_000, Unit::None),
        default: "100",
        help: "Due events a round takes from the failure path.",
    },
    Spec {
        name: "poll_interval",
        kind: int(10, 3_600_000, Unit::Ms),
        default: "1s",
        help: "How often the relay looks for work when no commit woke it.",
    },
    Spec {
        name: "linger",
        kind: int(0, 10_000, Unit::Ms),
        default: "10ms",
        help: "Under steady commits, the most the relay waits after a round to gather the next.",
    },
    Spec {
        name: "stream",
        kind: Type::Str(Some(outbox_sink::entry::check_stream_template)),
        default: "outbox:{aggregate_type}",
        help: "Stream key template for events enqueued without a stream.",
    },
    Spec {
        name: "stream_maxlen",
        kind: int(0, I32_MAX, Unit::None),
        default: "0",
        help: "Stream length each XADD trims to; 0 never trims.",
    },
    Spec {
        name: "stream_trim",
        kind: Type::Enum(&["length", "acked"]),
        default: "length",
        help: "How stream_maxlen trims: length, or acked (Redis 8.2 or later).",
    },
    Spec {
        name: "lease",
        kind: int(1_000, 86_400_000, Unit::Ms),
        default: "30s",
        help: "How old a relay's lease may grow before other relays take its shards.",
    },
    Spec {
        name: "ordering",
        kind: Type::Enum(&["aggregate", "none"]),
        default: "aggregate",
        help: "Per-aggregate ordering of deliveries: aggregate or none.",
    },
    Spec {
        name: "max_attempts",
        kind: int(1, 1_000_000, Unit::None),
        default: "10",
        help: "Rejections of an event by Redis before it is dead-lettered.",
    },
    Spec {
        name: "retry_delay",
        kind: int(1, 300_000, Unit::Ms),
        default: "1s",
        help: "First per-event backoff after a rejection; doubles, at most 5 minutes.",
    },
    Spec {
        name: "retention",
        kind: int(0, I32_MAX, Unit::S),
        default: "7d",
        help: "How long published events are kept at least; 0 keeps them.",
    },
    Spec {
        name: "alert_age",
        kind: int(0, I32_MAX, Unit::S),
        default: "5min",
        help: "Age of the oldest pending event above which a WARNING is logged; 0 disables.",
    },
    Spec {
        name: "log_min_duration",
        kind: int(-1, I32_MAX, Unit::Ms),
        default: "1s",
        help: "Rounds and housekeeping taking at least this long are logged; -1 disables.",
    },
    Spec {
        name: "replay_on_loss",
        kind: Type::Bool,
        default: "off",
        help: "Replay what Redis lost of a stream as soon as it is noticed.",
    },
    Spec {
        name: "entry_format",
        kind: Type::Enum(&["native", "cloudevents"]),
        default: "native",
        help: "The fields of each stream entry: native or cloudevents.",
    },
    Spec {
        name: "cloudevents_source",
        kind: Type::Str(Some(outbox_sink::entry::check_source_template)),
        default: "/outbox/{database}/{aggregate_type}",
        help: "The source attribute of CloudEvents entries.",
    },
];

fn check_redis_url(url: &str) -> Result<(), String> {
    if outbox_protocol::redis_url::has_password(url) {
        return Err(format!(
            "it carries a password; leave it out of the URL and put it in a file named by redis_password_file, or in the environment variable {REDIS_PASSWORD_ENV}"
        ));
    }
    Ok(())
}

fn check_database_url(url: &str) -> Result<(), String> {
    let trimmed = url.trim_start();
    let scheme = trimmed.split_once("://").map(|(scheme, _)| scheme.to_ascii_lowercase());
    if url.trim().is_empty()
        || matches!(scheme.as_deref(), Some("postgresql" | "postgres"))
        || crate::log::looks_like_key_value(url)
    {
        return Ok(());
    }
    Err("neither a postgresql:// URL nor key=value pairs (host=... dbname=...)".into())
}

/// Where a value came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File { path: PathBuf, line: usize },
    Env(String),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("the default"),
            Source::File { path, line } => write!(f, "{}, line {line}", path.display()),
            Source::Env(name) => write!(f, "the environment variable {name}"),
            Source::Flag(flag) => write!(f, "the flag {flag}"),
        }
    }
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Command {
    Run(Box<Config>),
    Help,
    Version,
}

/// A secret that never shows in `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(****)")
    }
}

/// The relay's settings, validated. Durations are as src/guc.rs's accessors return them.
#[derive(Clone, Debug)]
pub struct Config {
    pub database_url: String,
    pub redis_url: String,
    pub redis_password_file: Option<String>,
    /// `OUTBOX_REDIS_PASSWORD`, when set.
    pub redis_password: Option<Secret>,
    pub redis_tls: TlsFiles,
    pub redis_mode: RedisMode,
    pub redis_sentinel_master: String,
    pub redis_wait_replicas: u32,
    pub redis_timeout: Duration,
    pub batch_size: usize,
    pub poll_interval: Duration,
    pub linger: Duration,
    pub stream_template: String,
    /// None: never trim.
    pub stream_maxlen: Option<u64>,
    pub trim_acked: bool,
    pub lease: Duration,
    /// `ordering = aggregate`.
    pub ordered: bool,
    pub max_attempts: i32,
    pub retry_delay: Duration,
    /// None: kept forever.
    pub retention: Option<Duration>,
    /// None: no alert.
    pub alert_age: Option<Duration>,
    /// None: no slow-round log.
    pub log_min_duration: Option<Duration>,
    pub replay_on_loss: bool,
    pub cloudevents: bool,
    pub cloudevents_source: String,
    /// Where each setting's value came from.
    pub sources: HashMap<&'static str, Source>,
}

impl Config {
    /// `lease` in milliseconds, as the round's SQL functions take it.
    pub fn lease_ms(&self) -> i32 {
        self.lease.as_millis().min(i32::MAX as u128) as i32
    }

    /// `retention` in seconds, as the round's SQL functions take it (None: keep what was published
    /// until `outbox.purge`).
    pub fn retention_s(&self) -> Option<i32> {
        self.retention.map(|r| r.as_secs().min(i32::MAX as u64) as i32)
    }

    /// What outbox-sink needs to reach Redis. `password_file` is where the password is read from at
    /// each connect: `redis_password_file`, or the file the caller made of `OUTBOX_REDIS_PASSWORD`.
    pub fn redis_config(&self, password_file: Option<String>) -> RedisConfig {
        RedisConfig {
            url: self.redis_url.clone(),
            mode: self.redis_mode,
            sentinel_master: self.redis_sentinel_master.clone(),
            password_file: password_file.or_else(|| self.redis_password_file.clone()),
            timeout: self.redis_timeout,
            tls: self.redis_tls.clone(),
            wait_replicas: self.redis_wait_replicas,
            replay_losses_first: self.replay_on_loss,
        }
    }

    /// How entries are written; `database` is the database's name (CloudEvents' `{database}`).
    pub fn entry_settings(&self, database: &str) -> EntrySettings {
        EntrySettings {
            stream_template: self.stream_template.clone(),
            maxlen: self.stream_maxlen,
            trim_acked: self.trim_acked,
            format: if self.cloudevents {
                EntryFormat::CloudEvents {
                    source_template: self.cloudevents_source.clone(),
                    database: database.to_string(),
                }
            } else {
                EntryFormat::Native
            },
        }
    }
}

/// A setting's value as text, with where it came from.
type Raw = HashMap<&'static str, (String, Source)>;

fn spec(name: &str) -> Option<&'static Spec> {
    let name = name.strip_prefix("outbox.").unwrap_or(name);
    SPECS.iter().find(|spec| spec.name == name)
}

fn env_name(name: &str) -> String {
    format!("OUTBOX_{}", name.to_ascii_uppercase())
}

/// Parses the command line (without the program's name) and the environment `env`.
pub fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Command, String> {
    let mut flags: Raw = HashMap::new();
    let mut config_file: Option<(PathBuf, Source)> = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            _ => {}
        }
        let Some(flag) = arg.strip_prefix("--") else {
            return Err(format!(
                "unexpected argument {arg:?}; settings are flags such as --database-url URL (see --help)"
            ));
        };
        let (flag, inline) = match flag.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_string())),
            None => (flag, None),
        };
        let shown = format!("--{flag}");
        let mut value = || match inline.clone() {
            Some(value) => Ok(value),
            None => args.next().cloned().ok_or_else(|| format!("{shown} needs a value")),
        };
        if flag == "config" {
            config_file = Some((PathBuf::from(value()?), Source::Flag(shown)));
            continue;
        }
        if flag == "redis-password" {
            return Err(format!(
                "--redis-password is refused: a flag shows in ps; put the password in a file named by --redis-password-file, or in the environment variable {REDIS_PASSWORD_ENV}"
            ));
        }
        let name = flag.replace('-', "_");
        let Some(spec) = SPECS.iter().find(|spec| spec.name == name) else {
            return Err(format!("unknown flag {shown} (see --help)"));
        };
        flags.insert(spec.name, (value()?, Source::Flag(shown)));
    }
    if config_file.is_none() {
        if let Some(path) = env.get(CONFIG_ENV).filter(|path| !path.is_empty()) {
            config_file = Some((PathBuf::from(path), Source::Env(CONFIG_ENV.into())));
        }
    }
    let mut raw: Raw = HashMap::new();
    if let Some((path, source)) = config_file {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read the configuration file {} (from {source}): {e}", path.display()))?;
        raw.extend(parse_file(&text, &path)?);
    }
    for spec in SPECS {
        let name = env_name(spec.name);
        if let Some(value) = env.get(&name) {
            raw.insert(spec.name, (value.clone(), Source::Env(name)));
        }
    }
    raw.extend(flags);
    let password = env.get(REDIS_PASSWORD_ENV).filter(|password| !password.is_empty()).cloned().map(Secret);
    build(raw, password).map(|config| Command::Run(Box::new(config)))
}

/// A postgresql.conf-style file: `name = value` or `name value`, `#` comments, values bare or in
/// single quotes (`''` for a quote), names with or without the `outbox.` prefix.
fn parse_file(text: &str, path: &std::path::Path) -> Result<Raw, String> {
    let mut raw = Raw::new();
    for (index, line) in text.lines().enumerate() {
        let source = Source::File { path: path.to_path_buf(), line: index + 1 };
        let (name, value) = parse_line(line).map_err(|why| format!("{source}: {why}"))?.unzip();
        let (Some(name), Some(value)) = (name, value) else { continue };
        let Some(spec) = spec(&name) else {
            return Err(format!("{source}: unknown setting {name:?} (see --help)"));
        };
        raw.insert(spec.name, (value, source));
    }
    Ok(raw)
}

/// One line of a configuration file: `None` for a blank or comment line.
fn parse_line(line: &str) -> Result<Option<(String, String)>, String> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let end = line.find(|c: char| c.is_whitespace() || c == '=' || c == '#').unwrap_or(line.len());
    let name = line[..end].to_string();
    let mut rest = line[end..].trim_start();
    if let Some(after) = rest.strip_prefix('=') {
        rest = after.trim_start();
    }
    let value = if let Some(quoted) = rest.strip_prefix('\'') {
        let mut value = String::new();
        let mut chars = quoted.chars().peekable();
        loop {
            match chars.next() {
                None => return Err(format!("the value of {name} has no closing quote")),
                Some('\'') if chars.peek() == Some(&'\'') => {
                    chars.next();
                    value.push('\'');
                }
                Some('\'') => break,
                Some(c) => value.push(c),
            }
        }
        let tail: String = chars.collect();
        let tail = tail.trim_start();
        if !tail.is_empty() && !tail.starts_with('#') {
            return Err(format!("unexpected {tail:?} after the value of {name}"));
        }
        value
    } else {
        let bare = rest.split('#').next().unwrap_or_default().trim();
        if bare.is_empty() {
            return Err(format!("{name} has no value"));
        }
        bare.to_string()
    };
    Ok(Some((name, value)))
}

/// A value with a unit (`5s`, `10 min`) in `unit`, rounded as PostgreSQL rounds it.
fn parse_int(text: &str, unit: Unit) -> Result<i64, String> {
    let text = text.trim();
    let digits_end = text
        .char_indices()
        .find(|(at, c)| !(c.is_ascii_digit() || (*at == 0 && (*c == '-' || *c == '+'))))
        .map_or(text.len(), |(at, _)| at);
    let number: i64 = text[..digits_end].parse().map_err(|_| "not an integer".to_string())?;
    let suffix = text[digits_end..].trim();
    if suffix.is_empty() {
        return Ok(number);
    }
    let in_ms: i64 = match suffix {
        "ms" => 1,
        "s" => 1_000,
        "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ if unit == Unit::None => return Err(format!("{suffix:?} is not a unit this setting takes (it has none)")),
        _ => return Err(format!("{suffix:?} is not a unit; use ms, s, min, h or d")),
    };
    let base = match unit {
        Unit::None => return Err(format!("{suffix:?}: this setting takes no unit")),
        Unit::Ms => 1,
        Unit::S => 1_000,
    };
    let ms = number.checked_mul(in_ms).ok_or("out of range")?;
    // Rounded half away from zero, as PostgreSQL's convert_to_base_unit.
    Ok((ms as f64 / base as f64).round() as i64)
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" | "t" | "y" => Some(true),
        "off" | "false" | "no" | "0" | "f" | "n" => Some(false),
        _ => None,
    }
}

/// A setting's value, checked: the text if a string or an enum, else the number (bools 0/1).
enum Parsed {
    Text(String),
    Int(i64),
}

fn check(spec: &Spec, text: &str, source: &Source) -> Result<Parsed, String> {
    let bad = |why: String| {
        // A Redis URL's error never repeats the URL: it may hold a password.
        let shown = if spec.name == "redis_url" {
            outbox_protocol::redis_url::redact(text)
        } else if spec.name == "database_url" {
            crate::log::redact_database_url(text)
        } else {
            text.to_string()
        };
        format!("invalid value for {}: {shown:?} (from {source}): {why}", spec.name)
    };
    match spec.kind {
        Type::Str(check) => {
            if let Some(check) = check {
                check(text).map_err(bad)?;
            }
            Ok(Parsed::Text(text.to_string()))
        }
        Type::Int { min, max, unit } => {
            let value = parse_int(text, unit).map_err(bad)?;
            if value < min || value > max {
                let unit = match unit {
                    Unit::None => "",
                    Unit::Ms => "ms",
                    Unit::S => "s",
                };
                return Err(bad(format!("out of range [{min}{unit} .. {max}{unit}]")));
            }
            Ok(Parsed::Int(value))
        }
        Type::Bool => {
            parse_bool(text).map(|b| Parsed::Int(b as i64)).ok_or_else(|| bad("not a boolean (on or off)".into()))
        }
        Type::Enum(values) => {
            let lower = text.trim().to_ascii_lowercase();
            if values.contains(&lower.as_str()) {
                Ok(Parsed::Text(lower))
            } else {
                Err(bad(format!("available values: {}", values.join(", "))))
            }
        }
    }
}

fn build(mut raw: Raw, redis_password: Option<Secret>) -> Result<Config, String> {
    let mut sources = HashMap::new();
    let mut text: HashMap<&'static str, String> = HashMap::new();
    let mut ints: HashMap<&'static str, i64> = HashMap::new();
    for spec in SPECS {
        let (value, source) = raw.remove(spec.name).unwrap_or_else(|| (spec.default.to_string(), Source::Default));
        match check(spec, &value, &source)? {
            Parsed::Text(value) => {
                text.insert(spec.name, value);
            }
            Parsed::Int(value) => {
                ints.insert(spec.name, value);
            }
        }
        sources.insert(spec.name, source);
    }
    let get = |name: &str| text.get(name).cloned().unwrap_or_default();
    let int = |name: &str| ints.get(name).copied().unwrap_or_default();
    let optional = |name: &str| Some(get(name)).filter(|value| !value.is_empty());
    let ms = |name: &str| Duration::from_millis(int(name).max(0) as u64);
    let database_url = get("database_url");
    if database_url.is_empty() {
        return Err("database_url is not set: pass --database-url URL (or OUTBOX_DATABASE_URL)".into());
    }
    if redis_password.is_some() && optional("redis_password_file").is_some() {
        return Err(format!(
            "both {REDIS_PASSWORD_ENV} and redis_password_file (from {}) are set: keep one",
            sources["redis_password_file"]
        ));
    }
    let redis_mode = match get("redis_mode").as_str() {
        "sentinel" => RedisMode::Sentinel,
        "cluster" => RedisMode::Cluster,
        _ => RedisMode::Standalone,
    };
    if redis_mode == RedisMode::Sentinel && get("redis_sentinel_master").is_empty() {
        return Err(format!(
            "redis_mode is sentinel (from {}) but redis_sentinel_master is not set",
            sources["redis_mode"]
        ));
    }
    Ok(Config {
        database_url,
        redis_url: get("redis_url"),
        redis_password_file: optional("redis_password_file"),
        redis_password,
        redis_tls: TlsFiles {
            ca_file: optional("redis_tls_ca_file"),
            cert_file: optional("redis_tls_cert_file"),
            key_file: optional("redis_tls_key_file"),
        },
        redis_mode,
        redis_sentinel_master: get("redis_sentinel_master"),
        redis_wait_replicas: int("redis_wait_replicas") as u32,
        redis_timeout: ms("redis_timeout"),
        batch_size: int("batch_size") as usize,
        poll_interval: ms("poll_interval"),
        linger: ms("linger"),
        stream_template: get("stream"),
        stream_maxlen: Some(int("stream_maxlen") as u64).filter(|&n| n > 0),
        trim_acked: get("stream_trim") == "acked",
        lease: ms("lease"),
        ordered: get("ordering") == "aggregate",
        max_attempts: int("max_attempts") as i32,
        retry_delay: ms("retry_delay"),
        retention: Some(int("retention")).filter(|&s| s > 0).map(|s| Duration::from_secs(s as u64)),
        alert_age: Some(int("alert_age")).filter(|&s| s > 0).map(|s| Duration::from_secs(s as u64)),
        log_min_duration: Some(int("log_min_duration"))
            .filter(|&ms| ms >= 0)
            .map(|ms| Duration::from_millis(ms as u64)),
        replay_on_loss: int("replay_on_loss") != 0,
        cloudevents: get("entry_format") == "cloudevents",
        cloudevents_source: get("cloudevents_source"),
        sources,
    })
}

/// `--help`: usage, then every setting with its flag, environment variable and default.
pub fn help() -> String {
    let mut out = String::from(
        "outbox-relay: publishes one database's outbox_pg log to Redis Streams from outside the server.\n\n\
         usage: outbox-relay --database-url URL [--redis-url URL] [--SETTING VALUE]... [--config FILE]\n\n\
         One process relays one database; run one per database (several processes on one database\n\
         share its shards). It runs until SIGTERM or SIGINT.\n\n\
         Each setting, highest first: --flag VALUE (or --flag=VALUE), the environment variable\n\
         OUTBOX_NAME, a file given by --config FILE or OUTBOX_CONFIG (postgresql.conf syntax:\n\
         `name = value`, # comments, names with or without `outbox.`), then the default.\n\
         Times take a unit (ms, s, min, h, d); a bare number is in the setting's unit.\n\
         The Redis password: redis_password_file or OUTBOX_REDIS_PASSWORD only, never in a URL.\n\n\
         settings (flag, environment, default):\n",
    );
    for spec in SPECS {
        let default = if spec.default.is_empty() { "(empty)".to_string() } else { spec.default.to_string() };
        let values = match spec.kind {
            Type::Enum(values) => format!(" [{}]", values.join(", ")),
            Type::Int { min, max, unit } => {
                let unit = match unit {
                    Unit::None => "",
                    Unit::Ms => " ms",
                    Unit::S => " s",
                };
                format!(" [{min} .. {max}{unit}]")
            }
            Type::Bool => " [on, off]".into(),
            Type::Str(_) => String::new(),
        };
        out.push_str(&format!(
            "  --{:<24} {:<30} default {default}{values}\n      {}\n",
            spec.name.replace('_', "-"),
            env_name(spec.name),
            spec.help
        ));
    }
    out.push_str(&format!(
        "  --config FILE              {CONFIG_ENV:<30} the configuration file\n  \
         {REDIS_PASSWORD_ENV} (environment only)      the Redis password\n"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn env(list: &[(&str, &str)]) -> HashMap<String, String> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn config(list: &[&str], vars: &[(&str, &str)]) -> Result<Config, String> {
        match parse(&args(list), &env(vars))? {
            Command::Run(config) => Ok(*config),
            other => Err(format!("{other:?}")),
        }
    }

    #[test]
    fn defaults_are_the_gucs() {
        let c = config(&["--database-url", "postgresql://localhost/app"], &[]).unwrap();
        assert_eq!(c.redis_url, "redis://127.0.0.1:6379");
        assert_eq!(c.batch_size, 100);
        assert_eq!(c.poll_interval, Duration::from_secs(1));
        assert_eq!(c.linger, Duration::from_millis(10));
        assert_eq!(c.redis_timeout, Duration::from_secs(5));
        assert_eq!(c.lease, Duration::from_secs(30));
        assert_eq!(c.retention, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(c.alert_age, Some(Duration::from_secs(300)));
        assert_eq!(c.log_min_duration, Some(Duration::from_secs(1)));
        assert_eq!(c.stream_template, "outbox:{aggregate_type}");
        assert_eq!(c.stream_maxlen, None);
        assert!(c.ordered && !c.trim_acked && !c.replay_on_loss && !c.cloudevents);
        assert_eq!(c.max_attempts, 10);
        assert_eq!(c.sources["batch_size"], Source::Default);
    }

    #[test]
    fn flags_beat_the_environment_which_beats_the_file() {
        let dir = std::env::temp_dir().join(format!("outbox-relay-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("relay.conf");
        std::fs::write(
            &file,
            "# comment\noutbox.batch_size = 7\npoll_interval '2s'  # trailing\nlinger=0\nstream = 'a''b'\n\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let c = config(
            &["--database-url=postgresql:///app", "--batch-size", "9", "--config", path],
            &[("OUTBOX_BATCH_SIZE", "8"), ("OUTBOX_POLL_INTERVAL", "3s")],
        )
        .unwrap();
        assert_eq!(c.batch_size, 9);
        assert_eq!(c.sources["batch_size"], Source::Flag("--batch-size".into()));
        assert_eq!(c.poll_interval, Duration::from_secs(3));
        assert_eq!(c.sources["poll_interval"], Source::Env("OUTBOX_POLL_INTERVAL".into()));
        assert_eq!(c.linger, Duration::ZERO);
        assert_eq!(c.sources["linger"], Source::File { path: file.clone(), line: 4 });
        assert_eq!(c.stream_template, "a'b");
        let c = config(&[], &[("OUTBOX_CONFIG", path), ("OUTBOX_DATABASE_URL", "host=x")]).unwrap();
        assert_eq!(c.batch_size, 7);
        assert_eq!(c.database_url, "host=x");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn units_convert_and_round_as_postgresql() {
        assert_eq!(parse_int("5s", Unit::Ms), Ok(5_000));
        assert_eq!(parse_int("10 min", Unit::Ms), Ok(600_000));
        assert_eq!(parse_int("7d", Unit::S), Ok(604_800));
        assert_eq!(parse_int("1500ms", Unit::S), Ok(2));
        assert_eq!(parse_int("250", Unit::Ms), Ok(250));
        assert_eq!(parse_int("-1", Unit::Ms), Ok(-1));
        assert!(parse_int("5s", Unit::None).is_err());
        assert!(parse_int("5 parsecs", Unit::Ms).is_err());
        assert!(parse_int("", Unit::Ms).is_err());
    }

    #[test]
    fn a_bad_value_names_the_setting_the_value_and_the_source() {
        let error = config(&["--database-url", "host=x", "--batch-size", "0"], &[]).unwrap_err();
        assert_eq!(
            error,
            "invalid value for batch_size: \"0\" (from the flag --batch-size): out of range [1 .. 10000]"
        );
        let error = config(&["--database-url", "host=x"], &[("OUTBOX_POLL_INTERVAL", "5")]).unwrap_err();
        assert_eq!(
            error,
            "invalid value for poll_interval: \"5\" (from the environment variable OUTBOX_POLL_INTERVAL): out of range [10ms .. 3600000ms]"
        );
        let error = config(&["--database-url", "host=x", "--ordering", "random"], &[]).unwrap_err();
        assert!(error.contains("ordering") && error.contains("aggregate, none"), "{error}");
        let error = config(&["--database-url", "host=x", "--stream", " "], &[]).unwrap_err();
        assert!(
            error.starts_with("invalid value for stream: \" \" (from the flag --stream): \" \" is blank"),
            "{error}"
        );
        let error = config(&["--database-url", "host=x", "--cloudevents-source", "/{nope}"], &[]).unwrap_err();
        assert!(error.starts_with("invalid value for cloudevents_source"), "{error}");
        assert!(config(&["--database-url", "host=x", "--no-such", "1"], &[])
            .unwrap_err()
            .contains("unknown flag --no-such"));
        assert!(config(&[], &[]).unwrap_err().contains("database_url is not set"));
        let error = config(&["--database-url", "host=x", "--redis-url", "redis//u:s3cret@r"], &[]).unwrap_err();
        assert!(error.contains("not a redis:// URL") && !error.contains("s3cret"), "{error}");
        let error = config(&["--database-url", "postgresql//app:s3cret@db/app"], &[]).unwrap_err();
        assert!(error.contains("neither a postgresql:// URL nor key=value") && !error.contains("s3cret"), "{error}");
    }

    #[test]
    fn a_redis_password_is_taken_from_the_environment_or_a_file_only() {
        let error = config(&["--database-url", "host=x", "--redis-url", "redis://:hunter2@r:6379"], &[]).unwrap_err();
        assert!(error.contains("redis_password_file") && error.contains(REDIS_PASSWORD_ENV), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
        assert!(config(&["--database-url", "host=x"], &[("OUTBOX_REDIS_URL", "redis://u:hunter2@r")]).is_err());
        assert!(config(&["--database-url", "host=x", "--redis-password", "p"], &[]).unwrap_err().contains("refused"));
        let c =
            config(&["--database-url", "host=x", "--redis-url", "redis://user@r:6379"], &[(REDIS_PASSWORD_ENV, "pw")])
                .unwrap();
        assert_eq!(c.redis_password, Some(Secret("pw".into())));
        assert!(!format!("{c:?}").contains("\"pw\""));
        let error = config(&["--database-url", "host=x", "--redis-password-file", "/f"], &[(REDIS_PASSWORD_ENV, "pw")])
            .unwrap_err();
        assert!(error.contains("keep one"), "{error}");
    }

    #[test]
    fn help_lists_every_setting_with_its_default() {
        let text = help();
        for spec in SPECS {
            assert!(text.contains(&format!("--{}", spec.name.replace('_', "-"))), "{}", spec.name);
            assert!(text.contains(&env_name(spec.name)));
        }
        assert!(text.contains("default 5min"));
    }

    #[test]
    fn the_file_syntax_is_postgresql_confs() {
        assert_eq!(parse_line("  # x"), Ok(None));
        assert_eq!(parse_line("a = 1"), Ok(Some(("a".into(), "1".into()))));
        assert_eq!(parse_line("a 'x # y' # z"), Ok(Some(("a".into(), "x # y".into()))));
        assert!(parse_line("a = 'open").is_err());
        assert!(parse_line("a =").is_err());
        assert!(parse_file("outbox.nope = 1", std::path::Path::new("f")).unwrap_err().contains("f, line 1"));
    }
}
