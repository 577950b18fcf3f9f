//! A relay's settings: the Redis configuration it publishes with, the warnings about settings that
//! give up part of a guarantee, and the database's and role's own settings (pg_db_role_setting),
//! which a reload does not re-read: a relay compares them at each reload and starts again when
//! they changed.

use std::ffi::CString;
use std::time::Duration;

use outbox_sink::entry::{EntryFormat, EntrySettings};
use outbox_sink::redis::{RedisConfig, RedisMode, TlsFiles};
use pgrx::prelude::*;

use crate::guc;
use crate::relay::health::human;

/// The settings PostgreSQL applied at connection from pg_db_role_setting (`ALTER DATABASE ...
/// SET`, `ALTER ROLE ... [IN DATABASE ...] SET`), as one comparable text (inside a transaction).
pub fn own_settings() -> String {
    const QUERY: &str = "SELECT coalesce(string_agg(setconfig::text, ';' ORDER BY setdatabase, setrole), '')
                           FROM pg_db_role_setting
                          WHERE setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
                            AND setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = session_user))";
    Spi::get_one::<String>(QUERY).ok().flatten().unwrap_or_default()
}

/// `pg_db_role_setting`'s OID (catalog/pg_db_role_setting.h), the same in every release.
const DB_ROLE_SETTING_RELATION_ID: pg_sys::Oid = pg_sys::Oid::from_u32(2964);

unsafe extern "C-unwind" {
    /// catalog/pg_db_role_setting.c: applies one (database, role) pair's settings with `source`,
    /// as InitPostgres does at connection; not in pgrx's bindings. It may raise an ERROR: called
    /// through `pg_guard_ffi_boundary`.
    fn ApplySetting(
        snapshot: pg_sys::Snapshot,
        databaseid: pg_sys::Oid,
        roleid: pg_sys::Oid,
        relsetting: pg_sys::Relation,
        source: pg_sys::GucSource::Type,
    );
}

/// The relay's own settings (`own_settings`), read now and applied to this process (inside a
/// transaction). PostgreSQL applied pg_db_role_setting when the relay connected, from the catalog
/// as it was then; an `ALTER DATABASE ... SET` committed between that and this read would be in
/// what the relay compares a reload against but not in its values, and the relay would keep the
/// old value for good (seen: a relay started just before `ALTER DATABASE plain SET outbox.stream`
/// kept publishing to the old stream). Applying what was read closes that window; a change
/// committed after the read differs from it at the next reload, which restarts the relay. None
/// when a setting applied at connection has been removed since (ApplySetting cannot take one
/// back): the relay must start again.
pub fn adopt_own_settings() -> Option<String> {
    let recorded = own_settings();
    // SAFETY: inside a transaction, as InitPostgres's process_settings does it: the catalog opened
    // with AccessShareLock, one registered catalog snapshot for the four lookups, both released.
    unsafe {
        let relation = pg_sys::table_open(DB_ROLE_SETTING_RELATION_ID, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetCatalogSnapshot(DB_ROLE_SETTING_RELATION_ID));
        let (database, role) = (pg_sys::MyDatabaseId, pg_sys::GetSessionUserId());
        let none = pg_sys::InvalidOid;
        for (database, role, source) in [
            (database, role, pg_sys::GucSource::PGC_S_DATABASE_USER),
            (none, role, pg_sys::GucSource::PGC_S_USER),
            (database, none, pg_sys::GucSource::PGC_S_DATABASE),
            (none, none, pg_sys::GucSource::PGC_S_GLOBAL),
        ] {
            pg_sys::ffi::pg_guard_ffi_boundary(|| ApplySetting(snapshot, database, role, relation, source));
        }
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::table_close(relation, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
    }
    const REMOVED: &str = "SELECT EXISTS (
                             SELECT 1 FROM pg_settings
                              WHERE source IN ('database', 'user', 'database user', 'global')
                                AND lower(name) NOT IN (SELECT lower(split_part(unnest(setconfig), '=', 1))
                                                   FROM pg_db_role_setting
                                                  WHERE setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
                                                    AND setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = session_user))))";
    let removed = Spi::get_one::<bool>(REMOVED).ok().flatten().unwrap_or(false);
    (!removed).then_some(recorded)
}

/// Pins the session settings every relay runs with (outbox_round::session, which says why),
/// over whatever the database or role says.
pub fn pin_session_settings() {
    for (name, value) in outbox_round::session::SESSION_SETTINGS {
        let (name, value) = (CString::new(*name).unwrap_or_default(), CString::new(*value).unwrap_or_default());
        // SAFETY: NUL-terminated strings; all are user-settable options.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_OVERRIDE,
            )
        };
    }
}

/// Who the relay runs as: the bootstrap superuser it connected as, whatever the database says.
/// `ALTER DATABASE ... SET role` (or `session_authorization`) is open to the database's owner, and
/// the connection applies it to the relay too: it then ran as that owner, was refused its own
/// tables, and published nothing until a superuser removed the setting. Pinned like the other
/// session settings, over the database's value; inside a transaction (both look the role up).
pub fn pin_identity() {
    // SAFETY: inside a transaction, as the settings' check hooks need; GetUserNameFromId raises
    // for a missing role, and the authenticated user exists. Static NUL-terminated names.
    unsafe {
        let connected_as = pg_sys::GetUserNameFromId(pg_sys::GetAuthenticatedUserId(), false);
        for (name, value) in
            [(c"session_authorization".as_ptr(), connected_as.cast_const()), (c"role".as_ptr(), c"none".as_ptr())]
        {
            pg_sys::SetConfigOption(name, value, pg_sys::GucContext::PGC_SUSET, pg_sys::GucSource::PGC_S_OVERRIDE);
        }
    }
}

/// Settings that work but give up part of a guarantee, logged at start and after each reload, by
/// relay 0 only. A lease must outlive a round: while a relay waits on Redis, its shards' lease has
/// to stay valid, or other relays take them over and publish the same events a second time. A round
/// can wait on Redis for up to `outbox.redis_timeout` (the connect, then the exchange), so a lease
/// shorter than twice that produces duplicates under a slow Redis. And behind Sentinel or Cluster,
/// only `outbox.redis_wait_replicas` makes a failover lose nothing.
pub fn warn_about_settings() {
    let (lease, timeout) = (guc::lease(), guc::redis_timeout());
    if let Some(reason) = lease_problem(lease, timeout) {
        warning!("outbox_pg: {reason}");
    }
    if guc::redis_mode() != guc::RedisMode::Standalone && guc::redis_wait_replicas() == 0 {
        warning!(
            "outbox_pg: outbox.redis_mode is {} and outbox.redis_wait_replicas is 0: Redis replicates asynchronously, so a \
             failover can lose the entries the old master acknowledged last; set outbox.redis_wait_replicas = 1",
            if guc::redis_mode() == guc::RedisMode::Cluster { "cluster" } else { "sentinel" }
        );
    }
}

/// Why `lease` is too short for `redis_timeout`, if it is.
pub fn lease_problem(lease: Duration, redis_timeout: Duration) -> Option<String> {
    (lease < redis_timeout * 2).then(|| {
        format!(
            "outbox.lease ({}) is shorter than twice outbox.redis_timeout ({}): a relay waiting on a slow Redis \
             loses its claim and others publish the same events again; set outbox.lease to at least {}",
            human(lease),
            human(redis_timeout),
            human(redis_timeout * 2)
        )
    })
}

pub fn redis_config() -> RedisConfig {
    RedisConfig {
        url: guc::redis_url(),
        mode: match guc::redis_mode() {
            guc::RedisMode::Standalone => RedisMode::Standalone,
            guc::RedisMode::Sentinel => RedisMode::Sentinel,
            guc::RedisMode::Cluster => RedisMode::Cluster,
        },
        sentinel_master: guc::redis_sentinel_master(),
        password_file: guc::redis_password_file(),
        timeout: guc::redis_timeout(),
        wait_replicas: guc::redis_wait_replicas(),
        replay_losses_first: guc::replay_on_loss(),
        tls: TlsFiles {
            ca_file: guc::redis_tls_ca_file(),
            cert_file: guc::redis_tls_cert_file(),
            key_file: guc::redis_tls_key_file(),
        },
    }
}

/// How the relays of `database` write their entries, as the settings say now.
pub fn entry_settings(database: &str) -> EntrySettings {
    EntrySettings {
        stream_template: guc::stream_template(),
        maxlen: guc::stream_maxlen(),
        trim_acked: guc::stream_trim() == guc::StreamTrim::Acked,
        format: match guc::entry_format() {
            guc::EntryFormat::Native => EntryFormat::Native,
            guc::EntryFormat::CloudEvents => {
                EntryFormat::CloudEvents { source_template: guc::cloudevents_source(), database: database.to_string() }
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_lease_shorter_than_two_redis_timeouts_is_reported() {
        let second = Duration::from_secs(1);
        assert!(super::lease_problem(second * 30, second * 5).is_none());
        assert!(super::lease_problem(second * 10, second * 5).is_none());
        let problem = super::lease_problem(second * 9, second * 5).unwrap();
        assert!(problem.contains("outbox.lease (9.0s)") && problem.contains("at least 10.0s"), "{problem}");
    }
}
