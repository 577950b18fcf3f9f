//! Whether a relay may run its statements in a database: the extension is there, at this
//! library's version, and the installation is the database's own (not a copy made by `CREATE
//! DATABASE ... TEMPLATE`: docs/worker.md, "A copy is not the original").

use std::time::{Duration, Instant};

use crate::db::{first, DbError, Statements};
use crate::hooks;
use crate::state::RoundState;

/// Whether the relay may run its statements in this database.
#[derive(Debug, Clone, PartialEq)]
pub enum Readiness {
    Missing,
    /// Installed at another version: its functions may not be the ones this library calls.
    Outdated(String),
    /// A copy (`CREATE DATABASE ... TEMPLATE`) of the installation of the database with this OID,
    /// with its events and counters: publishing them would duplicate the original's events and
    /// number new ones with the original's `aggregate_seq`s.
    Copied(u32),
    /// Ready, in the installation of this identity (`Statements::installation`).
    Ready(u32),
}

/// The version of the schema the round's statements are written for: this crate's version, kept
/// equal to the extension's (the root package's; a unit test compares them).
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Checks that outbox_pg is installed, at the version of this library. After a new library is
/// installed and the server restarted, the database keeps the old extension version until `ALTER
/// EXTENSION outbox_pg UPDATE`; until then the relay calls nothing (events wait, none is lost).
pub fn readiness(db: &mut dyn Statements, state: &mut RoundState) -> Result<Readiness, DbError> {
    let Some(identity) = db.installation()? else {
        return Ok(Readiness::Missing);
    };
    if let Some((checked, at)) = state.version_checked {
        if checked == identity && at.elapsed() < Duration::from_secs(1) {
            return Ok(Readiness::Ready(identity));
        }
    }
    let version = db.installed_version()?.unwrap_or_default();
    if version != LIBRARY_VERSION {
        state.version_checked = None;
        return Ok(Readiness::Outdated(version));
    }
    if let Some(original) = copied_from(db)? {
        state.version_checked = None;
        return Ok(Readiness::Copied(original));
    }
    state.version_checked = Some((identity, Instant::now()));
    Ok(Readiness::Ready(identity))
}

/// The database this installation was copied from, if it is a copy that carries events or
/// counters (`outbox.installation` names another database: `CREATE DATABASE ... TEMPLATE`). A copy
/// that carries nothing of the original's (a template with outbox_pg installed, as `CREATE
/// DATABASE` copies it) is adopted at once, whatever it has enqueued since: it cannot collide
/// with anything.
fn copied_from(db: &mut dyn Statements) -> Result<Option<u32>, DbError> {
    let here = db.database_oid()?;
    let recorded = first::<u32>(&db.query("SELECT database_oid FROM outbox.installation", &[])?)?;
    let Some(recorded) = recorded.filter(|recorded| *recorded != here) else {
        return Ok(None);
    };
    // Copied events are older than the database (src/sql/operations.sql, _database_created_by);
    // those enqueued here since are its own. The failure path and the counters are written by
    // relays only, so anything there was copied.
    let pristine = first::<bool>(&db.query(
        "SELECT NOT EXISTS (SELECT 1 FROM outbox.events e
                             WHERE e.txid < coalesce(outbox._database_created_by(), pg_current_xact_id()))
                AND NOT EXISTS (SELECT 1 FROM outbox.held) AND NOT EXISTS (SELECT 1 FROM outbox.aggregates)",
        &[],
    )?)?
    .unwrap_or(false);
    if !pristine {
        return Ok(Some(recorded));
    }
    db.execute("UPDATE outbox.installation SET database_oid = $1, installed_at = clock_timestamp()", &[here.into()])?;
    hooks::log(&format!(
        "outbox_pg: this database's outbox_pg was copied from database oid {recorded} and holds no event and no counter; relaying it as its own"
    ));
    Ok(None)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_round_expects_the_extensions_version() {
        let root = include_str!("../../Cargo.toml");
        let version = root
            .lines()
            .find_map(|line| line.strip_prefix("version = \""))
            .and_then(|rest| rest.strip_suffix('"'))
            .expect("the root Cargo.toml has a version");
        assert_eq!(super::LIBRARY_VERSION, version, "round/Cargo.toml's version must follow the root package's");
    }
}
