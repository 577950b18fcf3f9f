//! Whether this relay may run its rounds in the database it is connected to, and if not, the one
//! line that says what is missing: the server is a standby (never published from), the schema
//! `outbox` is missing, it is at another version than this relay's, or the relay's role lacks a
//! privilege the round needs. The relay checks before each round and waits while anything is
//! missing; nothing committed is lost meanwhile (docs/outside-relay.md, "Decisions").
//!
//! Not checked here: whether the installation is a copy made by `CREATE DATABASE ... TEMPLATE`
//! (the round's own readiness, src/relay/readiness.rs, moving into outbox-round).

use outbox_round::db::{first, Database, DbError, Statements};

/// The schema version this relay's statements are written for: its crate's version, kept equal to
/// the extension's (a test compares them with the root Cargo.toml).
pub const RELAY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The internal functions the round calls (src/sql/relay/, src/sql/*.sql), which only the
/// installing role may execute unless granted: the relay's role must be able to.
pub const ROUND_FUNCTIONS: &[&str] = &[
    "_claim_shards",
    "_held_shards",
    "_advance",
    "_hold",
    "_held_due",
    "_held_aggregates",
    "_settle_held",
    "_reap_shards",
    "_record_snapshot",
    "_retention",
    "_log_pending",
    "_stored_marks",
    "_store_marks",
    "_prune_marks",
    "_forget_marks",
    "_report_losses",
    "_unrepaired_losses",
    "_claim_replay",
    "_replay_walk",
    "_replay_select",
    "_replay_events",
    "_replay_progress",
    "_replays_running",
    "_repairs_running",
    "_database_created_by",
    "_read_window",
    "_read_windows",
    "_whole_transactions",
    "_event_size",
    "_last_seqs",
    "_join_relays",
];

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// The round may run. `wake`: the SQL-only install's commit wake-up is there
    /// (`outbox._wake_key()`, `outbox._wake_channel()`, whose name this is); without it (the
    /// extension's install) the poll interval is the only wake-up.
    Ready {
        wake: Option<String>,
        version: Option<String>,
    },
    Standby,
    MissingSchema,
    /// The installed version, where it is not the relay's.
    OtherVersion(String),
    /// What the role lacks: `USAGE on schema outbox`, or functions it may not execute (or that
    /// are missing).
    MissingPrivilege(Vec<String>),
    /// Another relay of the database writes entries differently (`outbox._join_relays`): its
    /// message, naming both.
    Conflict(String),
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Ready { .. })
    }

    /// The one line the relay logs while waiting (None when ready).
    pub fn message(&self, database: &str, role: &str) -> Option<String> {
        Some(match self {
            Readiness::Ready { .. } => return None,
            Readiness::Standby => format!(
                "database \"{database}\": the server is a standby (pg_is_in_recovery()); a standby is never published from, waiting for it to be promoted or for a primary (list several hosts with target_session_attrs=read-write)"
            ),
            Readiness::MissingSchema => format!(
                "database \"{database}\": the schema outbox is missing; install it: bash scripts/sql-only.sh | psql -d {database} -f - (as the database owner), waiting"
            ),
            Readiness::OtherVersion(found) => format!(
                "database \"{database}\": the schema outbox is at version {found}, this relay is {RELAY_VERSION}; upgrade the schema (ALTER EXTENSION outbox_pg UPDATE, or the SQL-only upgrade) or run outbox-relay {found}, waiting"
            ),
            Readiness::Conflict(message) => format!("database \"{database}\": {message}; waiting"),
            Readiness::MissingPrivilege(missing) => format!(
                "database \"{database}\": role \"{role}\" lacks {}; connect as the role that installed outbox_pg, or GRANT them, waiting",
                missing.join(", ")
            ),
        })
    }
}

/// Checks readiness in one short transaction.
pub fn check(db: &mut impl Database) -> Result<Readiness, DbError> {
    db.transaction(|statements| check_in(statements))
}

/// `check`, in the caller's transaction.
pub fn check_in(db: &mut dyn Statements) -> Result<Readiness, DbError> {
    if first::<bool>(&db.select("SELECT pg_catalog.pg_is_in_recovery()", &[])?)?.unwrap_or(false) {
        return Ok(Readiness::Standby);
    }
    if first::<bool>(&db.select("SELECT pg_catalog.to_regnamespace('outbox') IS NULL", &[])?)?.unwrap_or(true) {
        return Ok(Readiness::MissingSchema);
    }
    // Before anything that names the schema's objects: without USAGE, naming one is an error.
    if !first::<bool>(&db.select("SELECT pg_catalog.has_schema_privilege('outbox', 'USAGE')", &[])?)?.unwrap_or(false) {
        return Ok(Readiness::MissingPrivilege(vec!["USAGE on schema outbox".into()]));
    }
    // A schema that records no version was made by the SQL-only install of 0.3 (before
    // outbox._version()): not this relay's.
    let version = installed_version(db)?;
    match &version {
        Some(found) if found == RELAY_VERSION => {}
        Some(found) => return Ok(Readiness::OtherVersion(found.clone())),
        None => return Ok(Readiness::OtherVersion("0.3.x (it records none)".into())),
    }
    let missing = missing_privileges(db)?;
    if !missing.is_empty() {
        return Ok(Readiness::MissingPrivilege(missing));
    }
    let has_wake = first::<bool>(&db.select(
        "SELECT pg_catalog.to_regprocedure('outbox._wake_key()') IS NOT NULL
            AND pg_catalog.to_regprocedure('outbox._wake_channel()') IS NOT NULL",
        &[],
    )?)?
    .unwrap_or(false);
    let wake = if has_wake { first::<String>(&db.select("SELECT outbox._wake_channel()", &[])?)? } else { None };
    Ok(Readiness::Ready { wake, version })
}

/// The installed schema's version: the extension's (`CREATE EXTENSION`, pg_tle's too), else what
/// `outbox._version()` says (the SQL-only install); None when neither records one (the SQL-only
/// install of 0.3.x records none).
pub fn installed_version(db: &mut dyn Statements) -> Result<Option<String>, DbError> {
    let rows = db.select("SELECT extversion::text FROM pg_catalog.pg_extension WHERE extname = 'outbox_pg'", &[])?;
    if let Some(row) = rows.first() {
        return row.get::<String>(0);
    }
    let recorded =
        first::<bool>(&db.select("SELECT pg_catalog.to_regprocedure('outbox._version()') IS NOT NULL", &[])?)?;
    if recorded == Some(true) {
        return first::<String>(&db.select("SELECT outbox._version()::text", &[])?);
    }
    Ok(None)
}

/// What the current role lacks of what the round needs: USAGE on the schema, EXECUTE on each
/// function of `ROUND_FUNCTIONS` (named with its arguments), or a function that is not there.
pub fn missing_privileges(db: &mut dyn Statements) -> Result<Vec<String>, DbError> {
    if !first::<bool>(&db.select("SELECT pg_catalog.has_schema_privilege('outbox', 'USAGE')", &[])?)?.unwrap_or(false) {
        return Ok(vec!["USAGE on schema outbox".into()]);
    }
    let names: Vec<String> = ROUND_FUNCTIONS.iter().map(|name| name.to_string()).collect();
    let rows = db.select(
        "SELECT 'EXECUTE on ' || p.oid::regprocedure::text
           FROM pg_catalog.pg_proc p
          WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = ANY ($1)
            AND NOT pg_catalog.has_function_privilege(p.oid, 'EXECUTE')
         UNION ALL
         SELECT 'function outbox.' || n || ' (missing)'
           FROM unnest($1) AS n
          WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_proc p
                             WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = n)
         ORDER BY 1",
        &[names.into()],
    )?;
    rows.iter().map(|row| row.get::<String>(0).map(Option::unwrap_or_default)).collect()
}

/// Joins the database's relays (`outbox._join_relays`) as backend `pid`, writing to `template` in
/// `format`: None when joined, else the conflict (SQLSTATE 55000) that makes this relay wait.
pub fn join(db: &mut impl Database, pid: i32, template: &str, format: &str) -> Result<Option<Readiness>, DbError> {
    let host = host_name();
    let joined = db.transaction(|db| {
        db.execute(
            "SELECT outbox._join_relays($1, $2, $3, $4, $5)",
            &[pid.into(), host.as_str().into(), RELAY_VERSION.into(), template.into(), format.into()],
        )
    });
    match joined {
        Ok(_) => Ok(None),
        Err(error) if error.sqlstate.as_deref() == Some("55000") => Ok(Some(Readiness::Conflict(error.message))),
        Err(error) => Err(error),
    }
}

/// This machine's name, for outbox.outside_relays.
fn host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname(2) writes at most the buffer's length into it.
    let rc = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relay_expects_the_root_packages_version() {
        let root = include_str!("../../Cargo.toml");
        let version = root
            .lines()
            .find_map(|line| line.strip_prefix("version = \""))
            .and_then(|rest| rest.strip_suffix('"'))
            .expect("the root Cargo.toml has a version");
        assert_eq!(RELAY_VERSION, version, "outside/Cargo.toml's version must follow the root package's");
    }

    #[test]
    fn each_state_has_one_line_naming_what_is_missing() {
        assert_eq!(Readiness::Ready { wake: None, version: None }.message("app", "r"), None);
        let standby = Readiness::Standby.message("app", "r").unwrap();
        assert!(standby.contains("the server is a standby"), "{standby}");
        let missing = Readiness::MissingSchema.message("app", "r").unwrap();
        assert!(missing.contains("the schema outbox is missing") && missing.contains("scripts/sql-only.sh"));
        let other = Readiness::OtherVersion("0.2.0".into()).message("app", "r").unwrap();
        assert!(other.contains("version 0.2.0") && other.contains(RELAY_VERSION), "{other}");
        let lacking =
            Readiness::MissingPrivilege(vec!["EXECUTE on outbox._claim_shards(integer,integer,integer)".into()])
                .message("app", "relay")
                .unwrap();
        assert!(lacking.contains("role \"relay\" lacks EXECUTE on outbox._claim_shards"), "{lacking}");
        for line in [standby, missing, other, lacking] {
            assert!(!line.contains('\n'));
        }
    }
}
