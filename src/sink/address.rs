//! Where Redis is, as `outbox.redis_url` says: one node's URL, or several nodes in one URL
//! (`redis://[user[:password]@]host1:port1,host2:port2/db`, the sentinels or the cluster's seed
//! nodes); the password file; and how a URL is shown (host and port only, or masked). Nothing here
//! talks to Redis, and no error text ever contains a password.

use std::fs;
use std::os::unix::fs::MetadataExt;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use super::BrokerError;

/// The URL of each node a (possibly multi-host) `outbox.redis_url` names, in the order given, each
/// with the URL's scheme, credentials, database and query. A password may hold `,` or `@`: the
/// credentials end at the *last* `@`, and only what follows them is split into hosts.
pub fn node_urls(url: &str) -> Vec<String> {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else {
        return vec![url.to_string()];
    };
    let (scheme, rest) = (&url[..scheme_end + 3], &url[scheme_end + 3..]);
    let (userinfo, after_credentials) = match rest.rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    };
    let hosts_end = after_credentials.find(['/', '?', '#']).unwrap_or(after_credentials.len());
    let (hosts, tail) = after_credentials.split_at(hosts_end);
    if !hosts.contains(',') {
        return vec![url.to_string()];
    }
    hosts
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .map(|host| format!("{scheme}{userinfo}{host}{tail}"))
        .collect()
}

/// Parses one node's URL and applies the password file. Error texts never contain the URL's
/// credentials.
pub fn connection_info(url: &str, password_file: Option<&str>) -> Result<ConnectionInfo, BrokerError> {
    let url = url.trim();
    if url.is_empty() {
        return Err(BrokerError("outbox.redis_url is empty".into()));
    }
    if !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("redis+unix://")) {
        return Err(BrokerError("outbox.redis_url must start with redis://, rediss:// or redis+unix://".into()));
    }
    let info = url
        .into_connection_info()
        .map_err(|_| BrokerError(format!("outbox.redis_url is not a valid Redis URL: {}", redact_url(url))))?;
    match password_file {
        None => Ok(info),
        Some(path) => {
            let password = read_password_file(path)?;
            let settings = info.redis_settings().clone().set_password(password);
            Ok(info.set_redis_settings(settings))
        }
    }
}

/// `info` pointed at another node (one the cluster or a sentinel named), keeping its credentials,
/// database and TLS choice.
pub fn at_node(info: &ConnectionInfo, host: &str, port: u16) -> ConnectionInfo {
    let addr = match info.addr() {
        ConnectionAddr::TcpTls { .. } => {
            ConnectionAddr::TcpTls { host: host.to_string(), port, insecure: false, tls_params: None }
        }
        _ => ConnectionAddr::Tcp(host.to_string(), port),
    };
    info.clone().set_addr(addr)
}

/// Refuses a secret file that its group or others may access (as libpq does for `.pgpass`).
pub fn private_file(setting: &str, path: &str) -> Result<(), BrokerError> {
    let metadata = fs::metadata(path).map_err(|e| BrokerError(format!("cannot read {setting} \"{path}\": {e}")))?;
    if metadata.mode() & 0o077 != 0 {
        return Err(BrokerError(format!(
            "{setting} \"{path}\" has group or world access; it must be readable by its owner only (chmod 600)"
        )));
    }
    Ok(())
}

/// Reads the password from a file that only the server's OS user may read (like libpq's
/// `.pgpass`, a group- or world-accessible file is refused). Trailing newlines are ignored.
pub fn read_password_file(path: &str) -> Result<String, BrokerError> {
    private_file("outbox.redis_password_file", path)?;
    let contents = fs::read_to_string(path)
        .map_err(|e| BrokerError(format!("cannot read outbox.redis_password_file \"{path}\": {e}")))?;
    let password = contents.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        return Err(BrokerError(format!("outbox.redis_password_file \"{path}\" is empty")));
    }
    Ok(password.to_string())
}

/// `host:port` (or the socket path) of each node a Redis URL names, for log lines. Never includes
/// credentials: a URL that does not parse is shown by its location only (what follows the
/// credentials), marked invalid.
pub fn describe_target(url: &str) -> String {
    let nodes: Vec<String> = node_urls(url).iter().map(|node| describe_node(node)).collect();
    if nodes.iter().any(|node| node.ends_with("(invalid outbox.redis_url)")) {
        return match location(url.trim()) {
            "" => "(invalid outbox.redis_url)".into(),
            location => format!("{location} (invalid outbox.redis_url)"),
        };
    }
    nodes.join(", ")
}

fn describe_node(url: &str) -> String {
    match url.trim().into_connection_info() {
        Ok(info) => describe_addr(info.addr()),
        Err(_) => "(invalid outbox.redis_url)".into(),
    }
}

/// `host:port` of an address, `(TLS)` marked.
pub fn describe_addr(addr: &ConnectionAddr) -> String {
    match addr {
        ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port} (TLS)"),
        ConnectionAddr::Unix(path) => path.display().to_string(),
        _ => "(unknown address)".into(),
    }
}

/// What follows the credentials and precedes any query or fragment: host(s), port(s) and database.
/// Credentials end at the *last* `@`, since a password may hold `@`, `/`, `?` or `#` unencoded.
fn location(url: &str) -> &str {
    let rest = url.find("://").map_or(url, |end| &url[end + 3..]);
    let rest = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
    &rest[..rest.find(['?', '#']).unwrap_or(rest.len())]
}

/// Whether the URL carries a password (anything after a `:` in its credentials, or a
/// `password=` query parameter).
pub fn has_password(url: &str) -> bool {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else { return false };
    let rest = &url[scheme_end + 3..];
    let in_credentials = rest.rfind('@').is_some_and(|at| {
        let userinfo = &rest[..at];
        // `user@host` names a user only; `:password@` or `user:password@` (or anything that is not
        // plainly a user name) carries a secret.
        !userinfo.chars().all(|c| c.is_ascii_alphanumeric() || "-_.~%".contains(c))
    });
    in_credentials || url.contains("password=")
}

/// The URL with its credentials masked, as `SHOW outbox.redis_url` prints it: scheme, user name
/// (when it is plainly one), `****` for the password, and the location; the query and fragment are
/// dropped, since some clients read credentials from them. Whatever characters the password holds,
/// none of it is shown.
pub fn redact_url(url: &str) -> String {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else {
        return if url.is_empty() { String::new() } else { "(invalid: not a redis:// URL)".into() };
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
    fn redact_masks_passwords_only() {
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("redis://:s3cret@h:1/0"), "redis://:****@h:1/0");
        assert_eq!(redact_url("rediss://app:s3cret@h:1"), "rediss://app:****@h:1");
        assert_eq!(redact_url("redis://s3cret@h"), "redis://****@h");
        assert_eq!(redact_url("redis://u:p@ss@h/0"), "redis://u:****@h/0");
        assert!(!redact_url("garbage:s3cret@x").contains("s3cret"));
        assert_eq!(redact_url("redis://u:p,w@a:1,b:2/0"), "redis://u:****@a:1,b:2/0");
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
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn unparseable_urls_are_described_by_location_only() {
        let described = describe_target("redis://:p/a?s#s@127.0.0.1:6379");
        assert!(!described.contains("p/a") && !described.contains("s#s"), "{described}");
        assert!(described.contains("127.0.0.1:6379") && described.contains("invalid"), "{described}");
        assert_eq!(describe_target("redis://:only-a-secret@"), "(invalid outbox.redis_url)");
    }

    #[test]
    fn describe_target_never_shows_credentials() {
        assert_eq!(describe_target("redis://:pw@10.1.2.3:7000/0"), "10.1.2.3:7000");
        assert_eq!(describe_target("redis://localhost"), "localhost:6379");
        assert!(!describe_target("not a url :pw@").contains("pw"));
        assert_eq!(describe_target("rediss://u:p,w@a:1, b:2"), "a:1 (TLS), b:2 (TLS)");
    }

    #[test]
    fn a_multi_host_url_names_each_node_with_the_same_credentials() {
        assert_eq!(node_urls("redis://h:1/0"), ["redis://h:1/0"]);
        assert_eq!(
            node_urls("redis://app:p,a@ss@s1:26379, s2:26379,s3/0?protocol=resp2"),
            [
                "redis://app:p,a@ss@s1:26379/0?protocol=resp2",
                "redis://app:p,a@ss@s2:26379/0?protocol=resp2",
                "redis://app:p,a@ss@s3/0?protocol=resp2"
            ]
        );
        assert_eq!(node_urls("rediss://[::1]:7000,[::1]:7001"), ["rediss://[::1]:7000", "rediss://[::1]:7001"]);
        let info = connection_info("redis://app:pw@a:1,b:2", None);
        assert!(info.is_err(), "a multi-host URL is not one node's URL");
    }

    #[test]
    fn passwords_are_told_from_user_names() {
        assert!(!has_password("redis://h:1"));
        assert!(!has_password("redis://relay@h:1"));
        assert!(has_password("redis://relay:pw@h:1"));
        assert!(has_password("redis://:pw@h:1"));
        assert!(has_password("redis://h:1/0?password=x"));
        assert!(has_password("redis://u:p@a:1,b:2"));
    }

    #[test]
    fn bad_urls_are_reported_without_the_secret() {
        for url in ["", "http://x", "redis://:s3cret@[bad"] {
            let Err(err) = connection_info(url, None) else { panic!("accepted {url}") };
            assert!(!err.0.contains("s3cret"), "{err}");
        }
        assert!(connection_info("redis://:pw@127.0.0.1:1/2", None).is_ok());
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
        let info = connection_info("redis://:inurl@127.0.0.1:1", Some(path_str)).unwrap();
        assert_eq!(info.redis_settings().password(), Some("hunter2"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
