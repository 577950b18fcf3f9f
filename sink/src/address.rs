//! Where Redis is, as `outbox.redis_url` says: one node's URL, or several nodes in one URL
//! (`redis://[user[:password]@]host1:port1,host2:port2/db`, the sentinels or the cluster's seed
//! nodes); the password file; and how a URL is shown (host and port only, or masked). Nothing here
//! talks to Redis, and no error text ever contains a password.

use std::path::Path;

use outbox_protocol::{redis_url, secret_files};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use super::BrokerError;

/// The URL of each node `outbox.redis_url` names, in the order given (the forms it may take:
/// outbox_protocol's `redis_url`). The error names the part that is wrong, never a password.
pub fn node_urls(url: &str) -> Result<Vec<String>, BrokerError> {
    redis_url::node_urls(url).map_err(|e| BrokerError(format!("outbox.redis_url {e}")))
}

/// Every node `url` names, parsed, with the password file applied. An error names the part that
/// is wrong: its position in the list and its location, never a password.
pub fn node_infos(url: &str, password_file: Option<&str>) -> Result<Vec<ConnectionInfo>, BrokerError> {
    let nodes = node_urls(url)?;
    let count = nodes.len();
    nodes
        .iter()
        .enumerate()
        .map(|(index, node)| {
            connection_info(node, password_file).map_err(|BrokerError(error)| {
                BrokerError(if count > 1 { format!("{error} (node {} of {count})", index + 1) } else { error })
            })
        })
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

/// Reads the password from a file that only the server's OS user may read (like libpq's
/// `.pgpass`, a group- or world-accessible file is refused). Trailing newlines are ignored.
pub fn read_password_file(path: &str) -> Result<String, BrokerError> {
    secret_files::read_password("outbox.redis_password_file", Path::new(path)).map_err(BrokerError)
}

/// `host:port` (or the socket path) of each node a Redis URL names, for log lines. Never includes
/// credentials: a URL that does not parse is shown by its location only (what follows the
/// credentials), marked invalid.
pub fn describe_target(url: &str) -> String {
    let invalid = || match location(url.trim()) {
        "" => "(invalid outbox.redis_url)".to_string(),
        location => format!("{location} (invalid outbox.redis_url)"),
    };
    let Ok(nodes) = redis_url::node_urls(url) else { return invalid() };
    let nodes: Vec<String> = nodes.iter().map(|node| describe_node(node)).collect();
    if nodes.iter().any(|node| node.ends_with("(invalid outbox.redis_url)")) {
        return invalid();
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

pub use redis_url::{has_password, location, redact as redact_url};

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

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
    fn a_multi_host_url_is_not_one_nodes_url() {
        // How a list names its nodes is outbox_protocol's (tested there); the sink adds the name.
        assert!(node_urls("redis://a:1,,b:2").unwrap_err().0.starts_with("outbox.redis_url "));
        let info = connection_info("redis://app:pw@a:1,b:2", None);
        assert!(info.is_err(), "a multi-host URL is not one node's URL");
    }

    #[test]
    fn the_node_of_a_list_that_does_not_parse_is_named() {
        assert_eq!(node_infos("redis://a:1,redis://u:pw@b:2/", None).unwrap().len(), 2);
        let error = node_infos("redis://u:s3cret@a:1,redis://u:s3cret@b:notaport", None).unwrap_err().0;
        assert!(error.contains("not a valid Redis URL") && error.contains("b:notaport (node 2 of 2)"), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
        let error = node_infos("redis://a:1,ftp://b:2", None).unwrap_err().0;
        assert!(error.starts_with("outbox.redis_url ") && error.contains("scheme is not"), "{error}");
        let error = node_infos("redis://a:1,redis://b:2,,redis://c:3", None).unwrap_err().0;
        assert!(error.contains("part 2 of 3") && error.contains("empty node"), "{error}");
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
