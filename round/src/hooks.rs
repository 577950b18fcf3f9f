//! What a round tells the process it runs in, and asks of it, beyond its statements: log lines,
//! the commit flags that say which shards were committed into, what is in flight and published
//! (for `outbox.relays()`), and the fault-injection points of the test build. The background
//! worker sets them to its shared memory and to PostgreSQL's log (src/relay/worker.rs); a process
//! that sets nothing (outbox-relay) gets the defaults: lines on standard error, and every held
//! shard read in every round, since no commit flags reach it (its wake-up is `LISTEN`).
//!
//! Process-wide, set once: one process runs one kind of relay, and passing them down every call
//! would thread a parameter through every step of the round for no choice.

use std::sync::OnceLock;

/// The hooks a relay process sets (`install`); each field has a default (`Hooks::default`).
#[derive(Clone, Copy)]
pub struct Hooks {
    /// A line at LOG level.
    pub log: fn(&str),
    /// A line at WARNING level.
    pub warning: fn(&str),
    /// Takes the commit flags of the shards in `mine` (a bit per shard): those committed into
    /// since they were last taken. Default: all of them.
    pub take_committed_shards: fn(mine: u32) -> u32,
    /// Sets commit flags again (a read thrown away, shards given up or not reached).
    pub mark_shards_committed: fn(shards: u32),
    /// Wakes the other relays of the database (shards were given up for them).
    pub wake_relays: fn(),
    /// Relay `slot` has `events` in flight (read, not yet finished), until `in_flight_clear`.
    pub in_flight_begin: fn(slot: usize, events: usize),
    pub in_flight_clear: fn(slot: usize),
    /// `events` more were published and finished.
    pub add_published: fn(events: i64),
    /// A replay that repairs a loss was asked for: every relay of the database waits for it.
    pub raise_repairs: fn(),
    /// Fault-injection points (the extension's test build): after a round was published, and
    /// after it was finished, with how many events it published.
    pub after_publish: fn(published: usize),
    pub after_finish: fn(published: usize),
}

fn to_stderr(level: &str, line: &str) {
    eprintln!("{level}:  {line}");
}

impl Default for Hooks {
    fn default() -> Hooks {
        Hooks {
            log: |line| to_stderr("LOG", line),
            warning: |line| to_stderr("WARNING", line),
            take_committed_shards: |mine| mine,
            mark_shards_committed: |_| {},
            wake_relays: || {},
            in_flight_begin: |_, _| {},
            in_flight_clear: |_| {},
            add_published: |_| {},
            raise_repairs: || {},
            after_publish: |_| {},
            after_finish: |_| {},
        }
    }
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Sets the process's hooks; the first call wins (a relay sets them once, before its first round).
pub fn install(hooks: Hooks) {
    let _ = HOOKS.set(hooks);
}

/// The process's hooks (the defaults until `install`).
pub fn hooks() -> &'static Hooks {
    HOOKS.get_or_init(Hooks::default)
}

/// A LOG line.
pub fn log(line: &str) {
    (hooks().log)(line)
}

/// A WARNING line.
pub fn warning(line: &str) {
    (hooks().warning)(line)
}
