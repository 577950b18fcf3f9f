//! The one error type of the library: what can stop a consumer step from completing.
//!
//! Problems with a single entry (malformed fields, a failing handler) are not errors here: they
//! are counted in [`crate::Stats`] and the entry is retried or dead-lettered, so one bad event
//! never stops the consumer.

use std::fmt;

/// Why a consumer operation failed.
#[derive(Debug)]
pub enum ConsumerError {
    /// The configuration cannot work; the message names the setting and the bad value.
    InvalidConfig(String),
    /// A Redis command failed (connection lost, server error, ...).
    Redis {
        /// The command or step that failed, e.g. `XREADGROUP`.
        operation: &'static str,
        /// The error reported by the Redis client.
        source: redis::RedisError,
    },
    /// Redis answered with a reply whose shape this library does not understand.
    UnexpectedReply {
        /// The command whose reply was not understood.
        operation: &'static str,
        /// What was wrong with it.
        detail: String,
    },
}

impl ConsumerError {
    pub(crate) fn redis(operation: &'static str) -> impl FnOnce(redis::RedisError) -> ConsumerError {
        move |source| ConsumerError::Redis { operation, source }
    }

    /// True when the error is likely transient and reconnecting may cure it: the connection was
    /// lost, refused or timed out, the server is still loading its data, the consumer group
    /// vanished (e.g. the server restarted without persistence) and can be created again, or a
    /// Redis Cluster is changing its topology (failover, resharding: CLUSTERDOWN, TRYAGAIN,
    /// MASTERDOWN, READONLY from a demoted master, a slot map that cannot be read yet).
    ///
    /// A MOVED or ASK redirection that reaches the caller is not transient: the cluster client
    /// follows them itself, so one that surfaces means a standalone connection to a cluster node.
    ///
    /// A TLS handshake that fails on the certificates (unknown issuer, wrong name, a client
    /// certificate the server refuses) is not transient: retrying cannot fix the configuration.
    pub fn is_transient(&self) -> bool {
        match self {
            ConsumerError::Redis { source, .. } => is_transient_redis(source),
            ConsumerError::InvalidConfig(_) | ConsumerError::UnexpectedReply { .. } => false,
        }
    }
}

fn is_transient_redis(source: &redis::RedisError) -> bool {
    if tls_failure(source).is_some() {
        return false;
    }
    source.is_io_error()
        || source.is_connection_dropped()
        || source.is_connection_refusal()
        || source.is_timeout()
        || source.kind() == redis::ErrorKind::ClusterConnectionNotFound
        || matches!(source.code(), Some("NOGROUP" | "LOADING" | "CLUSTERDOWN" | "TRYAGAIN" | "MASTERDOWN" | "READONLY"))
        || (source.kind() == redis::ErrorKind::Client && is_cluster_topology_message(&source.to_string()))
}

/// The cluster client reports a slot map it could not (yet) read or that lacks a slot as client
/// errors, with these texts only; during a failover both are temporary.
fn is_cluster_topology_message(text: &str) -> bool {
    text.contains("Slot refresh error") || text.contains("Missing slot coverage")
}

/// The TLS error behind a Redis error, if the failure is one of TLS itself (handshake, certificate,
/// alert from the server) rather than of the network.
fn tls_failure(source: &redis::RedisError) -> Option<&rustls::Error> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(source);
    while let Some(error) = cause {
        // The redis crate keeps its inner errors as `Arc<dyn Error>`, whose own `source` skips the
        // wrapped error: unwrap the Arc to see it.
        let error: &(dyn std::error::Error + 'static) =
            match error.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>() {
                Some(inner) => inner.as_ref(),
                None => error,
            };
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(tls) = error
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls);
        }
        cause = error.source();
    }
    None
}

/// What an operator should check for common TLS failures; empty when there is nothing to add.
fn tls_hint(error: &rustls::Error) -> &'static str {
    use rustls::{AlertDescription, CertificateError, Error};
    match error {
        Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
            " (the server's certificate is not signed by a CA of tls_ca_file, or of the system's trust \
             store when tls_ca_file is not set)"
        }
        Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => " (the server's certificate does not name the host or address of redis_url)",
        Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            " (the server's certificate has expired)"
        }
        Error::AlertReceived(AlertDescription::CertificateRequired) => {
            " (the server requires a client certificate: set tls_cert_file and tls_key_file)"
        }
        Error::AlertReceived(
            AlertDescription::BadCertificate | AlertDescription::UnknownCA | AlertDescription::DecryptError,
        ) => " (the server refused the client certificate: is it signed by a CA the server trusts?)",
        _ => "",
    }
}

impl fmt::Display for ConsumerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConsumerError::InvalidConfig(message) => write!(f, "invalid configuration: {message}"),
            ConsumerError::Redis { operation, source } => match tls_failure(source) {
                Some(tls) => write!(f, "{operation} failed: TLS error: {source}{}", tls_hint(tls)),
                None if matches!(source.code(), Some("MOVED" | "ASK")) => write!(
                    f,
                    "{operation} failed: {source} (a Redis Cluster redirection: the server is a cluster node, \
                     use cluster mode)"
                ),
                None => write!(f, "{operation} failed: {source}"),
            },
            ConsumerError::UnexpectedReply { operation, detail } => {
                write!(f, "unexpected reply to {operation}: {detail}")
            }
        }
    }
}

impl std::error::Error for ConsumerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsumerError::Redis { source, .. } => Some(source),
            ConsumerError::InvalidConfig(_) | ConsumerError::UnexpectedReply { .. } => None,
        }
    }
}
