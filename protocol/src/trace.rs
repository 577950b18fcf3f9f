//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): what a valid `traceparent` and
//! `tracestate` look like. `outbox_enqueue` refuses an event whose trace context breaks these rules
//! (from its headers or from `outbox.traceparent`/`outbox.tracestate`), the relay writes only
//! trace contexts that keep them, and a consumer may rely on them. Each check returns why a value
//! is wrong, in words that fit after "is not a valid traceparent: ".

/// The most bytes a `tracestate` may have (the specification's limit for what vendors propagate).
pub const TRACESTATE_MAX_LEN: usize = 512;
/// The most list members a `tracestate` may have.
pub const TRACESTATE_MAX_MEMBERS: usize = 32;

/// The form a `traceparent` takes, for messages.
pub const TRACEPARENT_FORM: &str =
    "00-<32 lowercase hex: trace id>-<16 lowercase hex: parent id>-<2 lowercase hex: flags>";

fn lower_hex(part: &str) -> bool {
    part.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The hints of an error refusing a traceparent or a tracestate (`outbox_enqueue`'s, and the
/// check hooks of `outbox.traceparent` and `outbox.tracestate`).
pub const TRACEPARENT_HINT: &str =
    "A W3C traceparent looks like '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01': \
     version 00, lowercase hex, trace id and parent id not all zeros. Pass the one your tracer gives, or none.";
pub const TRACESTATE_HINT: &str = "A W3C tracestate looks like 'rojo=00f067aa0ba902b7,congo=t61rcWkgMzE': at most 32 \
     key=value members and 512 bytes. Pass the one your tracer gives, or none.";

/// Checks a `traceparent` of version `00`: `00-` 32 lowercase hex digits (the trace id, not all
/// zeros) `-` 16 (the parent span id, not all zeros) `-` 2 (the flags). Other versions are refused:
/// version 00 is the only one defined, and what a later one adds is not known here.
pub fn check_traceparent(value: &str) -> Result<(), String> {
    let parts: Vec<&str> = value.split('-').collect();
    let [version, trace_id, parent_id, flags] = parts.as_slice() else {
        return Err(format!("it must be four parts separated by '-': {TRACEPARENT_FORM}"));
    };
    if *version != "00" {
        return Err(if version.len() == 2 && lower_hex(version) {
            format!("version {version} is not supported, only 00")
        } else {
            "the version must be 00".to_string()
        });
    }
    for (name, part, len) in [("trace id", trace_id, 32), ("parent id", parent_id, 16), ("flags", flags, 2)] {
        if part.len() != len || !lower_hex(part) {
            return Err(format!("the {name} must be {len} lowercase hex digits, got {:?}", shorten(part)));
        }
        if name != "flags" && part.bytes().all(|b| b == b'0') {
            return Err(format!("the {name} must not be all zeros"));
        }
    }
    Ok(())
}

/// Checks a `tracestate`: at most 512 bytes, a comma-separated list of at most 32 members
/// `key=value` (blanks around members allowed, empty members ignored), keys unique. A key is
/// lowercase letters, digits and `_-*/`, starting with a letter, at most 256 characters, or
/// `tenant@system` (tenant at most 241, system at most 14 characters, starting with a letter); a
/// value is 1 to 256 printable ASCII characters but `,` and `=`, not ending in a blank.
pub fn check_tracestate(value: &str) -> Result<(), String> {
    if value.len() > TRACESTATE_MAX_LEN {
        return Err(format!("it is {} bytes long, the limit is {TRACESTATE_MAX_LEN}", value.len()));
    }
    let mut keys: Vec<&str> = Vec::new();
    for member in value.split(',') {
        let member = member.trim_matches([' ', '\t']);
        if member.is_empty() {
            continue;
        }
        let Some((key, member_value)) = member.split_once('=') else {
            return Err(format!("member {:?} is not key=value", shorten(member)));
        };
        if !valid_key(key) {
            return Err(format!(
                "key {:?} is not valid: lowercase letters, digits and _-*/ starting with a letter (or tenant@system)",
                shorten(key)
            ));
        }
        if !valid_value(member_value) {
            return Err(format!(
                "the value of {key:?} is not valid: 1 to 256 printable ASCII characters but ',' and '=', not ending in a blank"
            ));
        }
        if keys.contains(&key) {
            return Err(format!("key {key:?} appears more than once"));
        }
        keys.push(key);
        if keys.len() > TRACESTATE_MAX_MEMBERS {
            return Err(format!("it has more than {TRACESTATE_MAX_MEMBERS} members"));
        }
    }
    Ok(())
}

fn key_char(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'*' | b'/')
}

fn valid_key(key: &str) -> bool {
    let bytes = key.as_bytes();
    match key.split_once('@') {
        None => {
            (1..=256).contains(&bytes.len()) && bytes[0].is_ascii_lowercase() && bytes.iter().copied().all(key_char)
        }
        Some((tenant, system)) => {
            let (tenant, system) = (tenant.as_bytes(), system.as_bytes());
            (1..=241).contains(&tenant.len())
                && (tenant[0].is_ascii_lowercase() || tenant[0].is_ascii_digit())
                && tenant.iter().copied().all(key_char)
                && (1..=14).contains(&system.len())
                && system[0].is_ascii_lowercase()
                && system.iter().copied().all(key_char)
        }
    }
}

fn valid_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    (1..=256).contains(&bytes.len())
        && bytes.iter().all(|&b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
        && bytes[bytes.len() - 1] != b' '
}

/// A value as a message shows it: at most 60 characters.
fn shorten(value: &str) -> String {
    if value.chars().count() <= 60 {
        value.to_string()
    } else {
        let head: String = value.chars().take(60).collect();
        format!("{head}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparents_of_version_00_are_checked_part_by_part() {
        assert_eq!(check_traceparent(VALID), Ok(()));
        assert_eq!(check_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"), Ok(()));
        for (bad, why) in [
            ("", "four parts"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "four parts"),
            ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version 01 is not supported"),
            ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version ff"),
            ("0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "the version must be 00"),
            ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "trace id must be 32 lowercase"),
            ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", "trace id must be 32"),
            ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", "trace id must not be all zeros"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "parent id must not be all zeros"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bg-01", "parent id must be 16"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1", "flags must be 2"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", "four parts"),
            (" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version must be 00"),
        ] {
            let error = check_traceparent(bad).expect_err(bad);
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn tracestates_follow_the_list_grammar() {
        for good in [
            "",
            "congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            " rojo=1 ,\tcongo=2,,",
            "tenant1@vendor=x",
            "0tenant@v=x",
            "a_-*/9=va lue",
        ] {
            assert_eq!(check_tracestate(good), Ok(()), "{good:?}");
        }
        for (bad, why) in [
            ("rojo", "is not key=value"),
            ("Rojo=1", "key \"Rojo\""),
            ("9rojo=1", "key \"9rojo\""),
            ("rojo=", "the value of \"rojo\""),
            ("rojo=a=b", "the value of \"rojo\""),
            ("rojo=1 ,rojo=2", "appears more than once"),
            ("t@Vendor=1", "key \"t@Vendor\""),
            ("t@vendorvendorvendor=1", "key"),
            ("rojo=caf\u{e9}", "the value of"),
        ] {
            let error = check_tracestate(bad).expect_err(bad);
            assert!(error.contains(why), "{bad}: {error}");
        }
        let many: Vec<String> = (0..33).map(|n| format!("k{n}=v")).collect();
        assert!(check_tracestate(&many.join(",")).unwrap_err().contains("more than 32 members"));
        assert_eq!(check_tracestate(&many[..32].join(",")), Ok(()));
        let long = format!("k={}", "v".repeat(256));
        assert!(check_tracestate(&format!("{long},{}", long.replace('k', "l")))
            .unwrap_err()
            .contains("the limit is 512"));
        assert!(check_tracestate(&format!("k={}", "v".repeat(257))).is_err());
    }
}
