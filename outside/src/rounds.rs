//! One round of the relay: the single place where outbox-relay runs outbox-round's round (claim,
//! read, publish to Redis, finish, housekeeping, replay, losses), over its client connection.
//!
//! **Wired to outbox-round's round by the next commit.** Until then `round` runs the readiness
//! check alone (src/readiness.rs) and reports no work, so that the process shell around it
//! (connect, reconnect, the wake-up, signals) runs and is tested as it will be. The signature is
//! the one the real round keeps: the connection, the relay's state (settings, Redis, what a round
//! keeps for the next), and what it found.

use outbox_round::db::DbError;
use outbox_sink::entry::EntrySettings;
use outbox_sink::redis::RedisSink;

use crate::config::Config;
use crate::password::PasswordFile;
use crate::pg::PgDatabase;
use crate::readiness::{self, Readiness};

/// What a relay keeps between rounds: its settings, its Redis, how entries are written. The state
/// outbox-round keeps between rounds (`RoundState`) joins it.
pub struct Relay {
    pub config: Config,
    pub sink: RedisSink,
    pub entries: EntrySettings,
    /// `OUTBOX_REDIS_PASSWORD`, where the sink reads it.
    _password: Option<PasswordFile>,
}

impl Relay {
    /// The relay for `config`, relaying database `database` (its name, for CloudEvents' source).
    /// Connects to nothing yet.
    pub fn new(config: Config, database: &str) -> std::io::Result<Relay> {
        let password = config.redis_password.as_ref().map(|secret| PasswordFile::new(&secret.0)).transpose()?;
        let mut sink = RedisSink::new();
        sink.configure(config.redis_config(password.as_ref().map(PasswordFile::path)));
        let entries = config.entry_settings(database);
        Ok(Relay { config, sink, entries, _password: password })
    }
}

/// What a round found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The database cannot be relayed now (src/readiness.rs): nothing was read or published.
    NotReady(Readiness),
    /// The round ran. `more`: work is waiting (run the next round at once); `wake`: the channel of
    /// the SQL-only install's commit wake-up, None where there is none (the extension's install).
    Ran { more: bool, wake: Option<String> },
}

/// Runs one round on `db`. An `Err` is a failure of the database (a statement, a lost
/// connection: `db.is_closed()` tells); failures of Redis are handled inside, as the worker's are.
pub fn round(db: &mut PgDatabase, relay: &mut Relay) -> Result<Outcome, DbError> {
    let _ = relay;
    match readiness::check(db)? {
        Readiness::Ready { wake, .. } => Ok(Outcome::Ran { more: false, wake }),
        other => Ok(Outcome::NotReady(other)),
    }
}
