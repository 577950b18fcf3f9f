//! How a Redis URL names its nodes, and how it is shown without its secrets.
//!
//! One setting names one node or several (a Sentinel's sentinels, a Cluster's seed nodes), in any
//! of the forms other Redis clients take:
//! - one URL: `redis://[user[:password]@]host:port[/db][?query]`;
//! - the compact list: `redis://[user[:password]@]host1:port1,host2:port2[/db][?query]`, whose
//!   scheme, credentials and suffix apply to every node;
//! - full URLs separated by commas: `redis://h1:1,redis://h2:2` (each with its own credentials),
//!   or a mix of both.
//!
//! A password may hold `,`, `@`, `/`, `?` or `#` unencoded: credentials end at the *last* `@` of a
//! URL. A new URL starts only at a comma followed by a Redis scheme (`redis://`, `rediss://`,
//! `redis+unix://`, `unix://`); a password containing such a sequence must be percent-encoded (or,
//! better, kept in a password file). Nothing here shows a password: errors and descriptions name
//! nodes by what follows the credentials.

/// The schemes a Redis URL may have; a comma followed by one of them starts another URL.
const SCHEMES: [&str; 4] = ["redis://", "rediss://", "redis+unix://", "unix://"];

/// Splits `url` at the commas that start another full URL, keeping each piece intact (trimmed).
pub fn full_urls(url: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for (comma, _) in url.match_indices(',') {
        let next = url[comma + 1..].trim_start();
        if SCHEMES.iter().any(|scheme| next.starts_with(scheme)) {
            pieces.push(url[start..comma].trim());
            start = comma + 1;
        }
    }
    pieces.push(url[start..].trim());
    pieces.into_iter().filter(|piece| !piece.is_empty()).collect()
}

/// One URL per node `url` names, in the order given: each compact list expanded with its scheme,
/// credentials and suffix. The error (without any credentials) names the part that is wrong, by
/// its position in a list of several and its location.
pub fn node_urls(url: &str) -> Result<Vec<String>, String> {
    let pieces = full_urls(url);
    if pieces.is_empty() {
        return Err("is empty".to_string());
    }
    let which = |index: usize, piece: &str| {
        if pieces.len() > 1 {
            format!("part {} of {} ({})", index + 1, pieces.len(), shown_location(piece))
        } else {
            format!("({})", shown_location(piece))
        }
    };
    let mut nodes = Vec::new();
    for (index, piece) in pieces.iter().enumerate() {
        let Some(scheme_end) = piece.find("://") else {
            return Err(format!("{} must start with redis://, rediss:// (TLS) or redis+unix://", which(index, piece)));
        };
        let (scheme, rest) = (&piece[..scheme_end + 3], &piece[scheme_end + 3..]);
        if !SCHEMES.contains(&scheme) {
            return Err(format!("{} must start with redis://, rediss:// (TLS) or redis+unix://", which(index, piece)));
        }
        if scheme.ends_with("unix://") {
            // A socket path has no host list to split.
            nodes.push(piece.to_string());
            continue;
        }
        let (credentials, after) = match rest.rfind('@') {
            Some(at) => rest.split_at(at + 1),
            None => ("", rest),
        };
        if after.contains("://") {
            return Err(format!(
                "{} holds a URL whose scheme is not redis://, rediss:// or redis+unix://",
                which(index, piece)
            ));
        }
        let hosts_end = after.find(['/', '?', '#']).unwrap_or(after.len());
        let (hosts, suffix) = after.split_at(hosts_end);
        for host in hosts.split(',') {
            if host.trim().is_empty() {
                return Err(format!("{} has an empty node in its host list", which(index, piece)));
            }
            nodes.push(format!("{scheme}{credentials}{}{suffix}", host.trim()));
        }
    }
    Ok(nodes)
}

/// What follows the credentials of one URL and precedes any query or fragment: host(s), port(s)
/// and database. Safe to show: `****` instead when a secret may be in it (found by attack): a URL
/// other than a socket's, without credentials, whose location is not plainly hosts, ports and a
/// database number (a URL whose `@` was forgotten, `redis://:s3cret10.0.0.1:6379`, holds its
/// password there; so does one whose scheme is mistyped), and a URL whose last `@` follows a `?`
/// in a URL with a `pass=` or `password=` parameter (the `@` is then the password's own).
pub fn location(url: &str) -> &str {
    let scheme_end = url.find("://");
    let rest = scheme_end.map_or(url, |end| &url[end + 3..]);
    let at = rest.rfind('@');
    if at.is_some_and(|at| rest[..at].contains('?')) && query_has_secret(url) {
        return "****";
    }
    let (rest, credentials) = match at {
        Some(at) => (&rest[at + 1..], true),
        None => (rest, false),
    };
    let location = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    if !credentials && !is_socket(url) && !is_plain_location(location) {
        return "****";
    }
    location
}

/// A socket URL, whose location is a path.
fn is_socket(url: &str) -> bool {
    let lower = url.trim_start().to_ascii_lowercase();
    lower.starts_with("redis+unix://") || lower.starts_with("unix://")
}

/// Plainly a TCP URL's location: nodes (`host`, `host:port`, `[v6]` or `[v6]:port`, joined by
/// commas) and an optional `/` with a database number. Nothing a password could hide in.
pub fn is_plain_location(location: &str) -> bool {
    let (nodes, database) = location.split_once('/').unwrap_or((location, ""));
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    let port = |text: Option<&str>| text.is_none_or(digits);
    let plain_node = |node: &str| {
        let node = node.trim();
        // An empty node (a list's typo) hides nothing.
        if node.is_empty() {
            return true;
        }
        match node.strip_prefix('[') {
            Some(v6) => v6.split_once(']').is_some_and(|(address, after)| {
                !address.is_empty()
                    && address.bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
                    && (after.is_empty() || port(after.strip_prefix(':')) && after.starts_with(':'))
            }),
            None => {
                let (host, port_text) = match node.split_once(':') {
                    Some((host, port_text)) => (host, Some(port_text)),
                    None => (node, None),
                };
                !host.is_empty()
                    && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
                    && port(port_text)
            }
        }
    };
    (database.is_empty() || digits(database)) && nodes.split(',').all(plain_node)
}

/// `location` quoted for an error message.
fn shown_location(url: &str) -> String {
    format!("{:?}", location(url))
}

/// Whether any URL in `url` carries a secret: a password in its credentials (anything after a `:`
/// there, or anything that is not plainly a user name), or a `pass=` (the redis crate reads a
/// socket URL's password from it) or `password=` query parameter, its name percent-decoded and in
/// any case. Every URL of a list counts, and so does a value that is not a Redis URL at all: this
/// decides what may be stored where every role can read it, so it errs on the side of a secret.
pub fn has_password(url: &str) -> bool {
    full_urls(url).iter().any(|piece| {
        let rest = piece.find("://").map_or(*piece, |end| &piece[end + 3..]);
        let in_credentials = rest.rfind('@').is_some_and(|at| {
            let userinfo = &rest[..at];
            // `user@host` names a user only; `:password@` or `user:password@` carries a secret.
            !userinfo.chars().all(|c| c.is_ascii_alphanumeric() || "-_.~%".contains(c))
        });
        // No credentials, and a location that may hide a password (`location` shows `****`).
        in_credentials || query_has_secret(piece) || location(piece) == "****"
    })
}

/// Whether any `name=value` parameter in `url` (after a `?`, `&` or `;`) is named `pass` or
/// `password` once percent-decoded, in any case.
fn query_has_secret(url: &str) -> bool {
    let lower = url.to_ascii_lowercase();
    if lower.contains("password=") {
        return true;
    }
    lower.split(['?', '&', ';']).skip(1).any(|parameter| {
        let name = parameter.split('=').next().unwrap_or_default();
        parameter.contains('=') && matches!(percent_decoded(name).trim(), "pass" | "password")
    })
}

/// `text` with `%XX` escapes decoded and `+` as a blank (as query strings are read), lowercased.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|hex| u8::from_str_radix(hex, 16).ok()) {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).to_ascii_lowercase()
}

/// `url` with every password masked: for each URL, its scheme, the user name (when it is plainly
/// one), `****` for the password, and the location; queries and fragments are dropped, since some
/// clients read credentials from them. Whatever characters a password holds, none is shown.
pub fn redact(url: &str) -> String {
    let url = url.trim();
    if url.is_empty() {
        return String::new();
    }
    full_urls(url).iter().map(|piece| redact_one(piece)).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return "(invalid: not a redis:// URL)".into();
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
    fn a_url_whose_at_sign_was_forgotten_shows_no_location() {
        // The password typed without its `@`: nothing of the location is shown.
        assert_eq!(location("redis://:s3cretPW127.0.0.1:6379/1"), "****");
        assert_eq!(location("rediss://app:s3cretPW10.0.0.1:6380"), "****");
        assert_eq!(redact("redis://:s3cretPW127.0.0.1:6379/1"), "redis://****");
        // Plain locations are shown as they are.
        for plain in
            ["h", "h:6379", "10.0.0.1:6379/2", "[::1]:6379", "[::1]", "a:1,b:2,c:3/0", "my-host.example_1:7000"]
        {
            assert_eq!(location(&format!("redis://{plain}")), plain);
            assert!(is_plain_location(plain), "{plain}");
        }
        assert!(is_plain_location("h2:1,,h3:1"), "an empty node hides nothing");
        for not_plain in [":pw127.0.0.1:6379", "u:pwh:1", "h:1/x", "h:notaport", "[::1]x", "h:1,:pw"] {
            assert!(!is_plain_location(not_plain), "{not_plain}");
        }
        // With credentials, what follows the `@` is the location whatever it holds; a socket
        // URL's location is a path.
        assert_eq!(location("redis://u:pw@h:notaport"), "h:notaport");
        assert_eq!(location("redis+unix:///var/run/redis.sock"), "/var/run/redis.sock");
        // A mistyped scheme, a missing one, and a password parameter holding an `@`.
        assert_eq!(location("valkey://:PW6127.0.0.1:6379"), "****");
        assert_eq!(location("redis//:PW7127.0.0.1:6379"), "****");
        assert_eq!(redact("redis://h:1/0?password=PW5@x"), "redis://h:****@****");
        // What may hide a password counts as one where every role can read it.
        assert!(has_password("redis://:HIDDENpw127.0.0.1:6379/0"));
        assert!(has_password("valkey://:PW6127.0.0.1:6379"));
        assert!(!has_password("redis://127.0.0.1:6379/0") && !has_password("redis://relay@h:1,h2:2"));
    }

    #[test]
    fn every_form_names_its_nodes() {
        assert_eq!(node_urls("redis://h:1/0").unwrap(), ["redis://h:1/0"]);
        assert_eq!(
            node_urls("redis://app:p,a@ss@s1:26379, s2:26379,s3/0?protocol=resp2").unwrap(),
            [
                "redis://app:p,a@ss@s1:26379/0?protocol=resp2",
                "redis://app:p,a@ss@s2:26379/0?protocol=resp2",
                "redis://app:p,a@ss@s3/0?protocol=resp2"
            ]
        );
        assert_eq!(
            node_urls("rediss://[::1]:7000,[::1]:7001").unwrap(),
            ["rediss://[::1]:7000", "rediss://[::1]:7001"]
        );
        assert_eq!(node_urls("redis://a:1/,redis://b:2/").unwrap(), ["redis://a:1/", "redis://b:2/"]);
        assert_eq!(
            node_urls("redis://u:p@a:1, rediss://v:q@b:2,c:3").unwrap(),
            ["redis://u:p@a:1", "rediss://v:q@b:2", "rediss://v:q@c:3"]
        );
        assert_eq!(node_urls("redis+unix:///run/redis.sock").unwrap(), ["redis+unix:///run/redis.sock"]);
    }

    #[test]
    fn a_bad_part_is_named_without_its_secret() {
        let error = node_urls("redis://u:s3cret@a:1,http://b:2").unwrap_err();
        assert!(error.contains("scheme is not"), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
        let error = node_urls("redis://u:s3cret@a:1,redis://v:t0p@b:2,,c:3").unwrap_err();
        assert!(error.contains("part 2 of 2") && error.contains("empty node"), "{error}");
        assert!(!error.contains("s3cret") && !error.contains("t0p"), "{error}");
        assert_eq!(node_urls("").unwrap_err(), "is empty");
        let error = node_urls("localhost:6379").unwrap_err();
        assert!(error.contains("\"localhost:6379\"") && error.contains("must start with"), "{error}");
    }

    #[test]
    fn passwords_are_told_from_user_names() {
        assert!(!has_password("redis://h:1"));
        assert!(!has_password("redis://relay@h:1"));
        assert!(has_password("redis://relay:pw@h:1"));
        assert!(has_password("redis://:pw@h:1"));
        assert!(has_password("redis://h:1/0?password=x"));
        assert!(has_password("redis://u:p@a:1,b:2"));
        assert!(has_password("redis://a:1,redis://u:p@b:2"));
        // A socket URL's password is its `pass=` parameter (the redis crate reads it there).
        assert!(has_password("redis+unix:///tmp/redis.sock?pass=S3cretUnix"));
        assert!(has_password("redis+unix:///tmp/redis.sock?db=0&pass=S3cretRole"));
        assert!(has_password("unix:///tmp/redis.sock?db=0&PASS=x"));
        assert!(has_password("redis+unix:///tmp/redis.sock?p%61ss=x"));
        assert!(has_password("redis://h:1/0?Password=x"));
        assert!(has_password("redis://h:1, redis+unix:///s?pass=x"));
        assert!(has_password("redis://h:1,h2:2,redis://a:1,rediss://:pw@b:2"));
        assert!(has_password("h:1?pass=x"), "not a Redis URL, still a secret");
        assert!(has_password("REDIS://u:pw@h:1"));
        assert!(!has_password("redis+unix:///tmp/redis.sock?db=0&user=relay"));
        assert!(!has_password("redis://h:1/0?protocol=resp3"));
        assert!(!has_password("redis://h:1/0?passive=1"));
    }

    #[test]
    fn redact_masks_passwords_only() {
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact("redis://:s3cret@h:1/0"), "redis://:****@h:1/0");
        assert_eq!(redact("rediss://app:s3cret@h:1"), "rediss://app:****@h:1");
        assert_eq!(redact("redis://s3cret@h"), "redis://****@h");
        assert_eq!(redact("redis://u:p@ss@h/0"), "redis://u:****@h/0");
        assert!(!redact("garbage:s3cret@x").contains("s3cret"));
        assert_eq!(redact("redis://u:p,w@a:1,b:2/0"), "redis://u:****@a:1,b:2/0");
        assert_eq!(redact("redis://u:p1@a:1,redis://v:p2@b:2"), "redis://u:****@a:1,redis://v:****@b:2");
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
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
