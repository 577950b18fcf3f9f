//! The session settings every relay runs with, whatever the database or role says: the background
//! worker sets them at start (src/relay/settings.rs), outbox-relay on each connection
//! (outside/src/pg.rs).
//!
//! Its batch statements gain nothing from JIT and would pay its compile time per call. Its
//! commits need not wait for the WAL flush: a relay commit lost in a crash (claim, mark,
//! rejection, retention) only means an event is published again or a row deleted later, never
//! that an event is lost, while waiting would put an fsync on every event's path to Redis. The
//! correctness argument of the claim (`outbox._claim_shards`) needs each statement to see a fresh
//! snapshot, i.e. READ COMMITTED, and the relay writes: a database or role default of repeatable
//! read, serializable or read-only must not apply to the relay's transactions, nor a database's
//! search_path to which operators its statements run.

/// (name, value) of each pinned setting.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    ("jit", "off"),
    ("synchronous_commit", "off"),
    ("default_transaction_isolation", "read committed"),
    ("default_transaction_read_only", "off"),
    // A relay never waits long on a row lock (a session holding its shard rows, an admin's
    // forget_aggregates): it backs off and tries again, answering SIGTERM in between.
    ("lock_timeout", "2s"),
    // The relay's statements take arrays and snapshots as parameters; planned for each call's
    // values (PL/pgSQL's custom plans) the batch read cost over a millisecond a round to plan,
    // more than running it. Their generic plans are index walks whatever the values.
    ("plan_cache_mode", "force_generic_plan"),
    // The worker runs as the bootstrap superuser, outbox-relay as the schema's owner or a
    // superuser: a database default search_path (which the database's owner may set) must not
    // choose the operators and functions its statements resolve, or an owner's `=` in a schema
    // listed first would run with the relay's rights.
    ("search_path", "pg_catalog, pg_temp"),
    // A replay's range goes back to the server as text (round/src/replay.rs): a DateStyle that
    // writes a zone abbreviation (SQL, Postgres, German) may not read back as written (with
    // TimeZone Asia/Kolkata, IST reads as Israel's: 3.5 hours off, and the replay sent nothing).
    // ISO writes the offset.
    ("DateStyle", "ISO, MDY"),
];
