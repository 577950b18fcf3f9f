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
    /// lost, refused or timed out, the server is still loading its data, or the consumer group
    /// vanished (e.g. the server restarted without persistence) and can be created again.
    pub fn is_transient(&self) -> bool {
        match self {
            ConsumerError::Redis { source, .. } => {
                source.is_io_error()
                    || source.is_connection_dropped()
                    || source.is_connection_refusal()
                    || source.is_timeout()
                    || matches!(source.code(), Some("NOGROUP" | "LOADING"))
            }
            ConsumerError::InvalidConfig(_) | ConsumerError::UnexpectedReply { .. } => false,
        }
    }
}

impl fmt::Display for ConsumerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConsumerError::InvalidConfig(message) => write!(f, "invalid configuration: {message}"),
            ConsumerError::Redis { operation, source } => write!(f, "{operation} failed: {source}"),
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
