//! Log lines on standard error, as the server's log shows the worker's: a timestamp, the pid, a
//! level (`LOG`, `WARNING`, `FATAL`) and the message. Nothing logged ever shows a password: URLs
//! are shown through `redact_any_url`, and every line is scrubbed of the secrets registered with
//! `hide` (the database's and Redis's passwords), whatever printed them.

use std::io::Write;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Log,
    Warning,
    Fatal,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Log => "LOG",
            Level::Warning => "WARNING",
            Level::Fatal => "FATAL",
        }
    }
}

static SECRETS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Masks `secret` in every line logged from now on (empty and one-character secrets are not
/// registered: masking every `a` would make the log unreadable and protect nothing).
pub fn hide(secret: &str) {
    if secret.chars().count() < 2 {
        return;
    }
    if let Ok(mut secrets) = SECRETS.lock() {
        if !secrets.iter().any(|known| known == secret) {
            secrets.push(secret.to_string());
        }
    }
}

/// `text` with every registered secret replaced by `****`.
pub fn scrub(text: &str) -> String {
    let mut text = text.to_string();
    if let Ok(secrets) = SECRETS.lock() {
        for secret in secrets.iter() {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), "****");
            }
        }
    }
    text
}

/// Writes one line to standard error.
pub fn log(level: Level, message: &str) {
    let line = format_line(SystemTime::now(), level, message);
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

pub fn info(message: &str) {
    log(Level::Log, message);
}

pub fn warning(message: &str) {
    log(Level::Warning, message);
}

/// The line for `message` at `now`: `2026-12-05 11:41:35.123 UTC [pid] LOG:  message\n`, the
/// message scrubbed and on one line.
pub fn format_line(now: SystemTime, level: Level, message: &str) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs();
    let (year, month, day) = civil_from_days((seconds / 86_400) as i64);
    let of_day = seconds % 86_400;
    let message = scrub(message).replace('\n', " ");
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03} UTC [{}] {}:  {message}\n",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60,
        since.subsec_millis(),
        std::process::id(),
        level.name()
    )
}

/// The date of a day counted from 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// A line logged once per change: the same message again logs nothing, another one logs, and
/// `clear` forgets (the next message logs whatever it is). `log_state` keys the line by a state
/// instead of its text: a state's first message is logged, the others of the same state are not.
#[derive(Default)]
pub struct OncePerChange {
    last: Option<String>,
}

impl OncePerChange {
    /// Logs `message` unless it was the last one logged here; true when it logged.
    pub fn log(&mut self, level: Level, message: &str) -> bool {
        self.log_state(level, message, message)
    }

    /// Logs `message` unless the last line logged here was of `state`; true when it logged. For
    /// retries whose errors differ in their text while the state is the same (a Redis that is
    /// down refuses, resets or times out connections by turns).
    pub fn log_state(&mut self, level: Level, state: &str, message: &str) -> bool {
        if self.last.as_deref() == Some(state) {
            return false;
        }
        log(level, message);
        self.last = Some(state.to_string());
        true
    }

    /// Whether the last line logged here was of `state` (`log_state`) or was `state` (`log`).
    pub fn is(&self, state: &str) -> bool {
        self.last.as_deref() == Some(state)
    }

    pub fn clear(&mut self) {
        self.last = None;
    }
}

/// A Redis URL (`redis://`, `rediss://`, lists of them) or a database URL (`postgresql://...` or
/// `key=value ...`) with every password shown as `****`.
pub fn redact_any_url(url: &str) -> String {
    let trimmed = url.trim_start();
    if trimmed.starts_with("redis://") || trimmed.starts_with("rediss://") || trimmed.starts_with("unix://") {
        outbox_protocol::redis_url::redact(url)
    } else {
        redact_database_url(url)
    }
}

/// A database URL with its password shown as `****`: the password of a `postgresql://` URL's
/// credentials, a `password=` query parameter, or a key/value string's `password=` (quoted or
/// not). The rest is kept: it says where the relay connects.
pub fn redact_database_url(url: &str) -> String {
    if let Some(scheme_end) = url.find("://") {
        let (scheme, rest) = url.split_at(scheme_end + 3);
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let authority = match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                let user = userinfo.split(':').next().unwrap_or_default();
                if userinfo.contains(':') {
                    format!("{user}:****{}", &authority[at..])
                } else {
                    authority.to_string()
                }
            }
            None => authority.to_string(),
        };
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let query: Vec<String> = query
                    .split('&')
                    .map(|pair| match pair.split_once('=') {
                        Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=****"),
                        _ => pair.to_string(),
                    })
                    .collect();
                format!("{path}?{}", query.join("&"))
            }
            None => tail.to_string(),
        };
        return format!("{scheme}{authority}{tail}");
    }
    if !looks_like_key_value(url) {
        // Neither form (a mistyped scheme, `postgresql:/`, `user:pw@host`): where its password is
        // cannot be told, so none of it is shown.
        return NOT_A_DATABASE_URL.into();
    }
    redact_key_value(url)
}

/// What a database URL that is neither a `postgresql://` URL nor `key=value` pairs is shown as.
pub const NOT_A_DATABASE_URL: &str = "(hidden: neither a postgresql:// URL nor key=value pairs)";

/// Whether `conninfo` starts as libpq's `key=value` pairs do: a keyword, then `=` (spaces allowed).
pub fn looks_like_key_value(conninfo: &str) -> bool {
    let rest = conninfo.trim_start();
    let keyword_end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
    keyword_end > 0 && rest[keyword_end..].trim_start().starts_with('=')
}

/// `host=h password='x y' user=u` with the password's value masked.
fn redact_key_value(conninfo: &str) -> String {
    let mut out = String::new();
    let mut rest = conninfo;
    while let Some(at) = find_password_key(rest) {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let eq = after.find('=').map_or(after.len(), |eq| eq + 1);
        out.push_str(&after[..eq]);
        let value = after[eq..].trim_start();
        let skipped = after[eq..].len() - value.len();
        out.push_str(&after[eq..eq + skipped]);
        out.push_str("****");
        let value_len = if let Some(quoted) = value.strip_prefix('\'') {
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        chars.next();
                    }
                    '\'' => {
                        end = i + 1;
                        break;
                    }
                    _ => {}
                }
            }
            1 + end
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        rest = &value[value_len.min(value.len())..];
    }
    out.push_str(rest);
    out
}

/// Where a `password` key (followed by optional blanks and `=`) starts in `text`, at a word start.
fn find_password_key(text: &str) -> Option<usize> {
    let lower = text.to_ascii_lowercase();
    let mut from = 0;
    while let Some(found) = lower[from..].find("password") {
        let at = from + found;
        let word_start = at == 0 || lower.as_bytes()[at - 1].is_ascii_whitespace();
        let after = lower[at + "password".len()..].trim_start();
        if word_start && after.starts_with('=') {
            return Some(at);
        }
        from = at + "password".len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn database_urls_lose_their_passwords() {
        assert_eq!(redact_database_url("postgresql://app:s3cret@db:5432/app"), "postgresql://app:****@db:5432/app");
        assert_eq!(
            redact_database_url("postgres://app@db/app?sslmode=require&password=s3cret"),
            "postgres://app@db/app?sslmode=require&password=****"
        );
        assert_eq!(redact_database_url("postgresql:///app"), "postgresql:///app");
        assert_eq!(redact_database_url("host=db password='s3 cret' user=app"), "host=db password=**** user=app");
        assert_eq!(redact_database_url("host=db password = s3cret"), "host=db password = ****");
        assert_eq!(redact_database_url("passwordless=1 host=db"), "passwordless=1 host=db");
        for mistyped in ["postgresql//app:s3cret@db/app", "postgresql:/app:s3cret@db/app", "app:s3cret@db/app"] {
            assert_eq!(redact_database_url(mistyped), NOT_A_DATABASE_URL);
        }
        assert_eq!(redact_database_url(" host = db"), " host = db");
    }

    #[test]
    fn redis_urls_lose_their_passwords() {
        let shown = redact_any_url("redis://user:hunter2@r:6379/0");
        assert!(!shown.contains("hunter2") && shown.contains("r:6379"), "{shown}");
        assert!(!redact_any_url("rediss://:hunter2@a:1,rediss://:hunter2@b:2").contains("hunter2"));
    }

    #[test]
    fn no_logged_line_shows_a_password() {
        hide("s3cret-db");
        hide("x");
        let url = "postgresql://app:s3cret-db@db/app";
        // Even a message that forgot to redact the URL is scrubbed.
        let line = format_line(SystemTime::now(), Level::Warning, &format!("cannot connect to {url}: refused"));
        assert!(!line.contains("s3cret-db"), "{line}");
        assert!(line.contains("WARNING:  cannot connect to postgresql://app:****@db/app"), "{line}");
        assert!(format_line(SystemTime::now(), Level::Log, "x marks").contains("x marks"));
        let line = format_line(SystemTime::now(), Level::Log, &format!("relaying {}", redact_any_url(url)));
        assert!(!line.contains("s3cret-db"));
    }

    #[test]
    fn lines_carry_a_utc_timestamp_and_the_level() {
        let at = UNIX_EPOCH + Duration::from_millis(1_796_470_895_123);
        let line = format_line(at, Level::Log, "ready\nsecond");
        assert!(line.starts_with("2026-12-05 11:41:35.123 UTC ["), "{line}");
        assert!(line.ends_with("] LOG:  ready second\n"), "{line}");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn once_per_change_logs_changes_only() {
        let mut once = OncePerChange::default();
        assert!(once.log(Level::Log, "a"));
        assert!(!once.log(Level::Log, "a"));
        assert!(once.log(Level::Log, "b"));
        once.clear();
        assert!(once.log(Level::Log, "b"));
        assert!(once.log_state(Level::Warning, "down", "down: refused"));
        assert!(!once.log_state(Level::Warning, "down", "down: reset"));
        assert!(once.is("down"));
        assert!(once.log(Level::Log, "up"));
        assert!(once.log_state(Level::Warning, "down", "down: refused"));
    }
}
