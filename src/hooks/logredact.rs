//! Keeps Redis credentials out of the server log. The relay never logs a URL with its password
//! (outbox_sink's `describe_target`), but PostgreSQL itself can: on every reload that changes a
//! setting, the postmaster logs `parameter "outbox.redis_url" changed to "<the raw value>"`; with
//! `log_statement` a superuser's `ALTER SYSTEM SET outbox.redis_url = ...` is logged whole, and so
//! is any statement that fails. An `emit_log_hook`, installed while preloading so that the
//! postmaster and every backend have it, masks the credentials of every Redis URL in a log
//! message before it is written, and hides the statement of an error raised while running one
//! that names the setting.

use std::ffi::{CStr, CString};

use outbox_protocol::redis_url;
use outbox_sink::redis::redact_url;
use pgrx::pg_sys;

static mut PREVIOUS_HOOK: pg_sys::emit_log_hook_type = None;

/// Installs the hook; called from `_PG_init` while preloading.
pub fn init() {
    // SAFETY: runs once in the postmaster while preloading; the previous hook is chained.
    unsafe {
        PREVIOUS_HOOK = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(on_emit_log);
    }
}

/// Runs inside error reporting, in every process: it must never raise. No `pg_guard` (an error
/// here could only recurse), no allocation but `pstrdup` into the current (error) context, and
/// any panic is caught and the message left as it was.
unsafe extern "C-unwind" fn on_emit_log(edata: *mut pg_sys::ErrorData) {
    // SAFETY: chaining to the previously installed hook with the same argument.
    unsafe {
        if let Some(previous) = PREVIOUS_HOOK {
            previous(edata);
        }
    }
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: PostgreSQL passes the ErrorData being emitted; its strings are NUL-terminated
        // or NULL, and replacing one with a pstrdup'd copy is what elog.c's own helpers do.
        unsafe {
            let edata = &mut *edata;
            for field in [&mut edata.message, &mut edata.detail, &mut edata.detail_log, &mut edata.context] {
                redact_field(field);
            }
            if !pg_sys::debug_query_string.is_null() {
                let statement = CStr::from_ptr(pg_sys::debug_query_string).to_bytes().to_ascii_lowercase();
                // Any case: URL schemes are case-insensitive.
                if contains(&statement, b"redis") || contains(&statement, b"unix://") {
                    edata.hide_stmt = true;
                }
            }
        }
    });
}

/// # Safety
/// `field` points at a NUL-terminated string or NULL, allocated where PostgreSQL may free it.
unsafe fn redact_field(field: &mut *mut std::ffi::c_char) {
    if field.is_null() {
        return;
    }
    // SAFETY: checked non-NULL above; NUL-terminated per the contract.
    let text = unsafe { CStr::from_ptr(*field) }.to_string_lossy();
    if let Some(redacted) = redact_log_text(&text) {
        if let Ok(redacted) = CString::new(redacted) {
            // SAFETY: pstrdup copies into the current memory context (the error context here).
            *field = unsafe { pg_sys::pstrdup(redacted.as_ptr()) };
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// The message with the credentials of every Redis URL masked, or `None` when it holds none.
///
/// Conservative: a log line may hold a statement whose literal doubles quotes, a double-quoted
/// value, or a password with blanks, so a URL is not cut at a quote or a blank. After each
/// `redis://`, `rediss://`, `redis+unix://` or `unix://` (any case) everything up to the *last*
/// `@` before the next such scheme (or the end of the message) is credentials, masked unless it is
/// plainly a user name; and the value of every `pass=` or `password=` parameter is masked up to
/// the next `&` or the end of the SQL literal (a `'` that is not doubled or backslash-escaped),
/// else to the end of the message. More may be masked than a password, never less.
pub fn redact_log_text(text: &str) -> Option<String> {
    // The reload message quotes the whole value: mask all of it, whatever characters the password
    // holds (quotes included).
    const CHANGED: &str = "parameter \"outbox.redis_url\" changed to \"";
    if let Some(value) = text.strip_prefix(CHANGED).and_then(|rest| rest.strip_suffix('"')) {
        return Some(format!("{CHANGED}{}\"", redact_url(value)));
    }
    let lower = text.to_ascii_lowercase();
    if !lower.contains("://") && !lower.contains("pass") {
        return None;
    }
    let mut masks: Vec<(usize, usize, String)> = Vec::new();
    let starts = scheme_starts(&lower);
    for (index, &body) in starts.iter().enumerate() {
        let region_end = starts.get(index + 1).map_or(text.len(), |&next| scheme_start_before(&lower, next));
        let Some(at) = lower[body..region_end].rfind('@') else {
            // No credentials: unless the location is plainly hosts and ports, a password typed
            // without its `@` may be in it (`redis://:s3cret10.0.0.1:6379`), holding any
            // character: masked to the end of the region (the next URL, or the message's end).
            let tcp = lower[..body].ends_with("redis://") || lower[..body].ends_with("rediss://");
            let end =
                text[body..region_end].find(['?', '#', '"', '\'', ' ', ';', ')']).map_or(region_end, |e| body + e);
            if tcp && !redis_url::is_plain_location(&text[body..end]) {
                masks.push((body, region_end, "****".to_string()));
            }
            continue;
        };
        let userinfo = &text[body..body + at];
        if is_user_name(userinfo) {
            continue;
        }
        let shown = match userinfo.find(':') {
            Some(colon) if is_user_name(&userinfo[..colon]) => format!("{}:****", &userinfo[..colon]),
            _ => "****".to_string(),
        };
        masks.push((body, body + at, shown));
    }
    if !starts.is_empty() || lower.contains("redis") {
        for (start, end) in query_secrets(text, &lower) {
            masks.push((start, end, "****".to_string()));
        }
    }
    if masks.is_empty() {
        return None;
    }
    masks.sort_by_key(|&(start, _, _)| start);
    let mut out = String::with_capacity(text.len());
    let mut cursor = 0;
    for (start, end, shown) in masks {
        if end <= cursor {
            continue;
        }
        if start < cursor {
            // Overlaps what is masked already: mask the rest of it too.
            cursor = end;
            continue;
        }
        out.push_str(&text[cursor..start]);
        out.push_str(&shown);
        cursor = end;
    }
    out.push_str(&text[cursor..]);
    (out != text).then_some(out)
}

/// The schemes after which credentials may follow (compared lowercased).
const SCHEMES: [&str; 4] = ["redis://", "rediss://", "redis+unix://", "unix://"];

/// Where the body (after the scheme) of each Redis URL in `lower` starts.
fn scheme_starts(lower: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut from = 0;
    while let Some(offset) = lower[from..].find("://") {
        let colon = from + offset;
        let body = colon + 3;
        if SCHEMES.iter().any(|scheme| lower[..body].ends_with(scheme)) {
            starts.push(body);
        }
        from = body;
    }
    starts
}

/// Where the scheme of the URL whose body starts at `body` begins.
fn scheme_start_before(lower: &str, body: usize) -> usize {
    SCHEMES
        .iter()
        .filter(|scheme| lower[..body].ends_with(*scheme))
        .map(|scheme| body - scheme.len())
        .min()
        .unwrap_or(body)
}

/// Plainly a user name: nothing a password could hide in.
fn is_user_name(text: &str) -> bool {
    text.chars().all(|c| c.is_ascii_alphanumeric() || "-_.~%".contains(c))
}

/// The byte ranges of the values of `pass=` and `password=` parameters (any case): up to the next
/// `&`, or the `'` ending the SQL literal (`''` and `\'` do not end it), or the end of the text.
fn query_secrets(text: &str, lower: &str) -> Vec<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut ranges = Vec::new();
    for name in ["pass=", "password="] {
        for (found, _) in lower.match_indices(name) {
            let preceded_by_name_char =
                found > 0 && (bytes[found - 1].is_ascii_alphanumeric() || bytes[found - 1] == b'_');
            if preceded_by_name_char {
                continue;
            }
            let start = found + name.len();
            let mut end = start;
            while end < bytes.len() {
                match bytes[end] {
                    b'&' => break,
                    b'\'' if bytes.get(end + 1) == Some(&b'\'') => end += 2,
                    b'\'' if end > start && bytes[end - 1] == b'\\' => end += 1,
                    b'\'' => break,
                    _ => end += 1,
                }
            }
            if end > start {
                ranges.push((start, end.min(bytes.len())));
            }
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::redact_log_text;

    #[test]
    fn the_reload_message_is_masked_whatever_the_password_holds() {
        let logged = r#"parameter "outbox.redis_url" changed to "redis://app:p"a/s?s#@h:6379/0""#;
        assert_eq!(
            redact_log_text(logged).unwrap(),
            r#"parameter "outbox.redis_url" changed to "redis://app:****@h:6379/0""#
        );
    }

    #[test]
    fn urls_inside_statements_are_masked() {
        let logged = "statement: ALTER SYSTEM SET outbox.redis_url = 'rediss://:s3cret@cache:6380'; SELECT 1";
        assert_eq!(
            redact_log_text(logged).unwrap(),
            "statement: ALTER SYSTEM SET outbox.redis_url = 'rediss://:****@cache:6380'; SELECT 1"
        );
        let two = "from redis://:a@x:1 to redis://u:b@y:2";
        assert_eq!(redact_log_text(two).unwrap(), "from redis://:****@x:1 to redis://u:****@y:2");
    }

    #[test]
    fn a_url_whose_at_sign_was_forgotten_is_masked_whole() {
        let logged = r#"parameter "outbox.redis_url" changed to "redis://:s3cretPW127.0.0.1:6379/1""#;
        assert_eq!(redact_log_text(logged).unwrap(), r#"parameter "outbox.redis_url" changed to "redis://****""#);
        let logged = "statement: ALTER SYSTEM SET outbox.redis_url = 'rediss://app:s3cretPW10.0.0.1:6380/0'";
        assert_eq!(redact_log_text(logged).unwrap(), "statement: ALTER SYSTEM SET outbox.redis_url = 'rediss://****");
        let logged = "cannot publish to Redis: not a valid Redis URL: redis://:s3cretPW127.0.0.1:6379 (node 1 of 1)";
        assert!(!redact_log_text(logged).unwrap().contains("s3cretPW"));
        // A password holding a character that would end a URL elsewhere: masked to the end.
        for (url, fragment) in [
            ("redis://:pa#ss127.0.0.1:1/0", "ss127"),
            ("redis://:pa ss127.0.0.1:1/0", "ss127"),
            ("redis://:PW1?x=y127.0.0.1:1", "x=y"),
            ("redis://user:PW2)z127.0.0.1:1", ")z"),
        ] {
            let logged = format!("statement: ALTER SYSTEM SET outbox.redis_url = '{url}'");
            let masked = redact_log_text(&logged).unwrap();
            assert!(!masked.contains(fragment), "{masked}");
        }
        // Plain locations stay as they are.
        assert_eq!(redact_log_text("Redis is redis://127.0.0.1:6379/1 again"), None);
    }

    #[test]
    fn other_messages_are_left_alone() {
        assert_eq!(redact_log_text("checkpoint complete"), None);
        assert_eq!(redact_log_text("outbox_pg: publishing to Redis at h:1 again"), None);
        assert_eq!(redact_log_text("a url without credentials redis://h:1"), None);
        assert_eq!(redact_log_text("statement: SET outbox.redis_url = 'redis://relay@h:1'"), None);
    }

    /// Issue 28 review, 10b: a quote, a double quote or a blank in the password ended the URL.
    #[test]
    fn passwords_with_quotes_and_blanks_are_masked_whole() {
        for (logged, secret) in [
            ("statement: ALTER SYSTEM SET outbox.redis_url = 'redis://app:Qu''ote1@127.0.0.1:1'", "ote1"),
            ("statement: SET outbox.redis_url = 'redis://app:Dq\"uote2@127.0.0.1:1'", "uote2"),
            ("statement: ALTER ROLE nobody SET outbox.redis_url = 'redis://:Dq\"uote3@127.0.0.1:1'", "uote3"),
            ("statement: SELECT 'redis://app:Sp ace4@127.0.0.1:1'::text AS x, 1/0", "ace4"),
            ("invalid value for parameter \"outbox.redis_url\": \"redis://:a\"b c'd@h:1\"", "b c'd"),
            ("statement: SET outbox.redis_url = E'redis://u:x\\'y@h:1'", "y@h"),
            ("statement: ALTER ROLE r SET outbox.redis_url = 'REDIS://u:Upper5@h:1'", "Upper5"),
            ("statement: SET outbox.redis_url TO 'redis://u:p1@a:1, rediss://v:p@2@b:2'", "p1"),
            ("statement: SET outbox.redis_url TO 'redis://u:p1@a:1, rediss://v:p@2@b:2'", "p@2"),
        ] {
            let masked = redact_log_text(logged).unwrap_or_else(|| panic!("{logged}: nothing masked"));
            assert!(!masked.contains(secret), "{logged} -> {masked}");
        }
        assert_eq!(
            redact_log_text("statement: ALTER SYSTEM SET outbox.redis_url = 'redis://app:Qu''ote1@h:1'").unwrap(),
            "statement: ALTER SYSTEM SET outbox.redis_url = 'redis://app:****@h:1'"
        );
    }

    #[test]
    fn pass_and_password_parameters_are_masked_to_the_end_of_the_value() {
        for (logged, shown) in [
            (
                "statement: ALTER DATABASE d SET outbox.redis_url = 'redis+unix:///tmp/r.sock?db=0&pass=S3c''r et&x=1'",
                "statement: ALTER DATABASE d SET outbox.redis_url = 'redis+unix:///tmp/r.sock?db=0&pass=****&x=1'",
            ),
            (
                "statement: SET outbox.redis_url = 'redis://h:1/0?password=S3\"cr''et'; SELECT 1",
                "statement: SET outbox.redis_url = 'redis://h:1/0?password=****'; SELECT 1",
            ),
            (
                "invalid value for parameter \"outbox.redis_url\": \"unix:///s?PASS=a b\"",
                "invalid value for parameter \"outbox.redis_url\": \"unix:///s?PASS=****",
            ),
        ] {
            assert_eq!(redact_log_text(logged).unwrap(), shown, "{logged}");
        }
    }
}
