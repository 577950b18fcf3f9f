//! Redis Sentinel: asking the sentinels where the master is. The relay asks at every (re)connect,
//! so after a failover its next connection goes to the new master; a node that no longer is the
//! master (a failover in progress, an old master back as a replica) is refused before anything is
//! sent to it.

use std::time::Duration;

use redis::ConnectionInfo;

use super::address::{at_node, describe_addr};
use super::node::{connect, describe_error};
use super::{BrokerError, TlsFiles};

/// Asks each sentinel in turn for `master`'s address and returns the first answer. A sentinel
/// is asked without credentials first (sentinels often have none, and refuse an AUTH then), and
/// with the URL's credentials when it demands them.
pub fn master_address(
    sentinels: &[ConnectionInfo],
    master: &str,
    timeout: Duration,
    tls: &TlsFiles,
) -> Result<(String, u16), BrokerError> {
    let mut failures = Vec::new();
    for sentinel in sentinels {
        let name = describe_addr(sentinel.addr());
        match ask(sentinel, master, timeout, tls) {
            Ok(Some(address)) => return Ok(address),
            Ok(None) => failures.push(format!("sentinel {name} knows no master named \"{master}\"")),
            Err(error) => failures.push(format!("sentinel {name}: {error}")),
        }
    }
    Err(BrokerError(format!(
        "no sentinel named the master \"{master}\" (outbox.redis_sentinel_master): {}",
        failures.join("; ")
    )))
}

fn ask(
    sentinel: &ConnectionInfo,
    master: &str,
    timeout: Duration,
    tls: &TlsFiles,
) -> Result<Option<(String, u16)>, BrokerError> {
    let anonymous = {
        let settings = redis::RedisConnectionInfo::default().set_protocol(sentinel.redis_settings().protocol());
        sentinel.clone().set_redis_settings(settings)
    };
    let query = |info: ConnectionInfo| -> Result<redis::Value, BrokerError> {
        let mut connection = connect(info, timeout, tls)?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master)
            .query::<redis::Value>(&mut connection)
            .map_err(|e| BrokerError(describe_error(&e)))
    };
    let reply = match query(anonymous) {
        Err(BrokerError(error)) if error.contains("NOAUTH") || error.contains("Authentication required") => {
            let settings = sentinel.redis_settings().clone().set_db(0);
            query(sentinel.clone().set_redis_settings(settings))?
        }
        other => other?,
    };
    match reply {
        redis::Value::Nil => Ok(None),
        redis::Value::Array(parts) if parts.len() == 2 => {
            let host: String = redis::from_redis_value(parts[0].clone())
                .map_err(|e| BrokerError(format!("unexpected sentinel reply: {e}")))?;
            let port: String = redis::from_redis_value(parts[1].clone())
                .map_err(|e| BrokerError(format!("unexpected sentinel reply: {e}")))?;
            let port =
                port.parse().map_err(|_| BrokerError(format!("unexpected master port {port:?} from a sentinel")))?;
            Ok(Some((host, port)))
        }
        other => Err(BrokerError(format!("unexpected sentinel reply: {other:?}"))),
    }
}

/// Connects to the master the sentinels name, with the URL's credentials, database and TLS, and
/// checks that it is a master (`ROLE`; skipped when the relay's Redis user may not run it, in
/// which case a write to a replica is refused with READONLY, also a failure of Redis as a whole).
pub fn connect_master(
    template: &ConnectionInfo,
    host: &str,
    port: u16,
    timeout: Duration,
    tls: &TlsFiles,
) -> Result<redis::Connection, BrokerError> {
    let info = at_node(template, host, port);
    let name = describe_addr(info.addr());
    let mut connection = connect(info, timeout, tls)?;
    match redis::cmd("ROLE").query::<redis::Value>(&mut connection) {
        Ok(redis::Value::Array(role)) => {
            let first: Option<String> = role.first().and_then(|value| redis::from_redis_value(value.clone()).ok());
            if first.as_deref() != Some("master") {
                return Err(BrokerError(format!(
                    "{name}, which the sentinels named master, is a {} (a failover in progress?)",
                    first.unwrap_or_else(|| "node of unknown role".into())
                )));
            }
        }
        Ok(_) => {}
        Err(error) if error.code() == Some("NOPERM") => {}
        Err(error) => return Err(BrokerError(format!("{name}: {}", describe_error(&error)))),
    }
    Ok(connection)
}
