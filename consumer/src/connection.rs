//! Reaching Redis: reading `redis_url` for the configured mode (one server, or a Redis Cluster's
//! seed nodes), the password file, TLS certificates, and the one connection type the consumer
//! uses whatever the topology.
//!
//! Files (password, certificates, key) are read at every (re)connect, so rotated files take effect
//! at the next connection. No error text produced here contains a password.

use std::path::Path;
use std::time::Duration;

use outbox_protocol::secret_files::{self, TlsSettings};
use redis::cluster::{ClusterClientBuilder, ClusterConnection};
use redis::{Cmd, ConnectionAddr, ConnectionInfo, ConnectionLike, RedisResult, Value};

use crate::config::{invalid_url, node_infos, ConsumerConfig, RedisMode};
use crate::error::ConsumerError;

/// How long establishing one connection (TCP, TLS, AUTH) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// In cluster mode a dead node stays in the slot map until the cluster has failed over, and every
/// slot-map refresh tries to connect to it: keep that attempt short.
const CLUSTER_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Redirections (MOVED/ASK) and retries the cluster client handles by itself before a command
/// fails. Few, and with short waits, so that a longer outage reaches [`crate::Consumer::run`],
/// whose backoff watches the stop flag and whose reconnect rebuilds the slot map from scratch.
const CLUSTER_RETRIES: u32 = 3;
const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 50;
const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 500;
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Added to the block timeout for the socket read timeout, so a blocking XREADGROUP is never
/// cut short by the client while a dead server is still noticed.
const READ_TIMEOUT_MARGIN: Duration = Duration::from_secs(10);

/// A connection to a standalone server or to a cluster. Commands go through
/// [`ConnectionLike`], so the consumer's code is the same for both; the cluster connection
/// routes each command to the master of its key's slot and follows redirections.
pub(crate) enum Connection {
    Standalone(redis::Connection),
    /// Boxed: it is several times the size of a single connection.
    Cluster(Box<ClusterConnection>),
}

impl Connection {
    /// Sends `commands` as one non-transactional pipeline and returns their replies in order.
    /// The plain `redis::pipe()` is refused by a cluster connection (its commands could span
    /// nodes), so cluster mode uses the cluster pipeline, which groups commands per node; the
    /// consumer only pipelines commands on the stream's key, so that is one node.
    pub(crate) fn pipeline(&mut self, commands: Vec<Cmd>) -> RedisResult<Vec<Value>> {
        match self {
            Connection::Standalone(conn) => {
                let mut pipe = redis::pipe();
                for command in commands {
                    pipe.add_command(command);
                }
                pipe.query(conn)
            }
            Connection::Cluster(conn) => {
                let mut pipe = redis::cluster::cluster_pipe();
                for command in commands {
                    pipe.add_command(command);
                }
                pipe.query(conn)
            }
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            Connection::Standalone(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(&mut self, cmd: &[u8], offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        match self {
            Connection::Standalone(conn) => conn.req_packed_commands(cmd, offset, count),
            Connection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        // Delegated rather than left to the trait's default (which packs the command first), so
        // that each connection type runs its own implementation.
        match self {
            Connection::Standalone(conn) => conn.req_command(cmd),
            Connection::Cluster(conn) => conn.req_command(cmd),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Standalone(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
        }
    }

    fn supports_pipelining(&self) -> bool {
        match self {
            Connection::Standalone(conn) => conn.supports_pipelining(),
            Connection::Cluster(conn) => conn.supports_pipelining(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Connection::Standalone(conn) => conn.check_connection(),
            Connection::Cluster(conn) => conn.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Connection::Standalone(conn) => conn.is_open(),
            Connection::Cluster(conn) => conn.is_open(),
        }
    }
}

/// Reads the files named by `config` and opens a connection for its mode, with the consumer's
/// timeouts. `InvalidConfig` for unusable files or certificates, `Redis` for failures to connect.
pub(crate) fn open(config: &ConsumerConfig) -> Result<Connection, ConsumerError> {
    let mut nodes = node_infos(config).map_err(ConsumerError::InvalidConfig)?;
    if let Some(path) = &config.password_file {
        let password = read_password_file(path)?;
        nodes = nodes
            .into_iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_password(&password);
                info.set_redis_settings(settings)
            })
            .collect();
    }
    let tls = nodes.iter().any(|info| matches!(info.addr(), ConnectionAddr::TcpTls { .. }));
    if tls {
        // rustls needs a process-wide crypto provider (the same one as the extension's); if one
        // is installed already (by us or by the application), that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let certificates = if tls { tls_certificates(config)? } else { None };
    let read_timeout = config.block_timeout + READ_TIMEOUT_MARGIN;

    match config.redis_mode {
        RedisMode::Standalone => {
            let info =
                nodes.into_iter().next().ok_or_else(|| ConsumerError::InvalidConfig(invalid_url("names no server")))?;
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates),
                None => redis::Client::open(info),
            }
            .map_err(client_config_error)?;
            let conn = client.get_connection_with_timeout(CONNECT_TIMEOUT).map_err(ConsumerError::redis("connect"))?;
            conn.set_read_timeout(Some(read_timeout)).map_err(ConsumerError::redis("connect"))?;
            conn.set_write_timeout(Some(WRITE_TIMEOUT)).map_err(ConsumerError::redis("connect"))?;
            Ok(Connection::Standalone(conn))
        }
        RedisMode::Cluster => {
            check_cluster_seed(&nodes, certificates.as_ref())?;
            let mut builder = ClusterClientBuilder::new(nodes)
                .connection_timeout(CLUSTER_CONNECT_TIMEOUT)
                .response_timeout(read_timeout)
                .retries(CLUSTER_RETRIES)
                .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
                .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS);
            if let Some(certificates) = certificates {
                builder = builder.certs(certificates);
            }
            let client = builder.build().map_err(client_config_error)?;
            let conn = client.get_connection().map_err(ConsumerError::redis("connect"))?;
            conn.set_write_timeout(Some(WRITE_TIMEOUT)).map_err(ConsumerError::redis("connect"))?;
            Ok(Connection::Cluster(Box::new(conn)))
        }
    }
}

/// Asks the first seed node that accepts a connection (same credentials and TLS settings as the
/// cluster client) for PING and CLUSTER SLOTS, the two commands the cluster client itself needs on
/// every node. The cluster client reports their failures poorly: a refused PING as a network
/// error of every node, a refused or empty CLUSTER SLOTS as "no connections found" later on.
/// Here they become clear errors that are not mistaken for transient ones: a permission missing
/// from the ACL user, a server that is not a cluster node, a wrong password, a TLS certificate
/// problem. Seeds that cannot be reached are skipped; if none can, the cluster client reports
/// them all.
fn check_cluster_seed(
    nodes: &[ConnectionInfo],
    certificates: Option<&redis::TlsCertificates>,
) -> Result<(), ConsumerError> {
    for info in nodes {
        let client = match certificates {
            Some(certificates) => redis::Client::build_with_tls(info.clone(), certificates.clone()),
            None => redis::Client::open(info.clone()),
        }
        .map_err(client_config_error)?;
        let mut conn = match client.get_connection_with_timeout(CLUSTER_CONNECT_TIMEOUT) {
            Ok(conn) => conn,
            Err(source) => {
                let error = ConsumerError::Redis { operation: "connect", source };
                if error.is_transient() {
                    continue;
                }
                return Err(error);
            }
        };
        let _ = conn.set_read_timeout(Some(CLUSTER_CONNECT_TIMEOUT));
        redis::cmd("PING").exec(&mut conn).map_err(ConsumerError::redis("PING"))?;
        return match redis::cmd("CLUSTER").arg("SLOTS").query::<Value>(&mut conn) {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("cluster support disabled") => Err(ConsumerError::InvalidConfig(format!(
                "redis_mode is cluster, but the server at {} is not a cluster node (cluster support disabled): use \
                 standalone mode",
                describe_addr(info.addr())
            ))),
            Err(source) => Err(ConsumerError::Redis { operation: "CLUSTER SLOTS", source }),
        };
    }
    Ok(())
}

fn describe_addr(addr: &ConnectionAddr) -> String {
    match addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => format!("{host}:{port}"),
        ConnectionAddr::Unix(path) => path.display().to_string(),
        _ => "(unknown address)".to_string(),
    }
}

/// Errors of building a client (before any connection) are configuration problems: bad PEM,
/// nodes that disagree on credentials or TLS, ...
fn client_config_error(error: redis::RedisError) -> ConsumerError {
    ConsumerError::InvalidConfig(format!("cannot set up the Redis client: {error}"))
}

/// Reads the certificates named by the `tls_*` settings, or `None` when none is set (then the
/// system's trust store verifies the server). The server's certificate and name are verified
/// either way: nothing here can turn that off.
fn tls_certificates(config: &ConsumerConfig) -> Result<Option<redis::TlsCertificates>, ConsumerError> {
    let names = TlsSettings { ca_file: "tls_ca_file", cert_file: "tls_cert_file", key_file: "tls_key_file" };
    let material = secret_files::read_tls(
        &names,
        config.tls_ca_file.as_deref(),
        config.tls_cert_file.as_deref(),
        config.tls_key_file.as_deref(),
    )
    .map_err(ConsumerError::InvalidConfig)?;
    if material.ca.is_none() && material.client.is_none() {
        return Ok(None);
    }
    Ok(Some(redis::TlsCertificates {
        root_cert: material.ca,
        client_tls: material.client.map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key }),
    }))
}

/// Reads the password from an owner-only file; trailing newlines (an editor's, or `echo`'s) are
/// not part of it.
fn read_password_file(path: &Path) -> Result<String, ConsumerError> {
    secret_files::read_password("password_file", path).map_err(ConsumerError::InvalidConfig)
}
