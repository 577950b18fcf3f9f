//! Keeps Redis credentials out of the server log. The relay never logs a URL with its password
//! (see `sink::redis::describe_target`), but PostgreSQL itself can: on every reload that changes a
//! setting, the postmaster logs `parameter "outbox.redis_url" changed to "<the raw value>"`; with
//! `log_statement` a superuser's `ALTER SYSTEM SET outbox.redis_url = ...` is logged whole, and so
//! is any statement that fails. An `emit_log_hook`, installed while preloading so that the
//! postmaster and every backend have it, masks the credentials of every Redis URL in a log
//! message before it is written, and hides the statement of an error raised while running one
//! that names the setting.

use std::ffi::{CStr, CString};

use pgrx::pg_sys;

use crate::sink::redis::redact_url;

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
                let statement = CStr::from_ptr(pg_sys::debug_query_string).to_bytes();
                if contains(statement, b"redis_url")
                    || contains(statement, b"redis://")
                    || contains(statement, b"rediss://")
                {
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
pub fn redact_log_text(text: &str) -> Option<String> {
    // The reload message quotes the whole value: mask all of it, whatever characters the password
    // holds (quotes included).
    const CHANGED: &str = "parameter \"outbox.redis_url\" changed to \"";
    if let Some(value) = text.strip_prefix(CHANGED).and_then(|rest| rest.strip_suffix('"')) {
        return Some(format!("{CHANGED}{}\"", redact_url(value)));
    }
    if !text.contains("redis") || !text.contains("://") {
        return None;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut changed = false;
    while let Some(found) = find_url(rest) {
        let (start, end) = found;
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        changed = true;
        rest = &rest[end..];
    }
    out.push_str(rest);
    changed.then_some(out)
}

/// The byte range of the next `redis://`, `rediss://` or `redis+unix://` URL in `text`: from its
/// scheme to the next blank or quote.
fn find_url(text: &str) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(offset) = text[from..].find("redis") {
        let start = from + offset;
        let after_scheme = ["redis://", "rediss://", "redis+unix://"]
            .iter()
            .find(|scheme| text[start..].starts_with(*scheme))
            .map(|scheme| start + scheme.len());
        if let Some(body) = after_scheme {
            let end = text[body..]
                .find(|c: char| c.is_whitespace() || c == '\'' || c == '"')
                .map_or(text.len(), |e| body + e);
            return Some((start, end));
        }
        from = start + "redis".len();
    }
    None
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
    fn other_messages_are_left_alone() {
        assert_eq!(redact_log_text("checkpoint complete"), None);
        assert_eq!(redact_log_text("outbox_pg: publishing to Redis at h:1 again"), None);
        assert_eq!(
            redact_log_text("a url without credentials redis://h:1").as_deref(),
            Some("a url without credentials redis://h:1")
        );
    }
}
