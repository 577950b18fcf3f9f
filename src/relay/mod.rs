//! The background workers that publish the log: the launcher (one set of relays per database with
//! outbox_pg) and the relays, each a loop of rounds. docs/worker.md.
//!
//! - `launcher`: starts, restarts and stops the relays of every database.
//! - `worker`: one relay's main loop: signals, waits, backoff; `settings` what it runs with,
//!   `health` what it reports (logged on changes of state).
//! - `spi`: the round's database interface (outbox-round's `Database`) over SPI, with the log's
//!   index walks; `txn`: a database step as a short transaction.
//!
//! The round itself (claim and read, publish, finish, replays, losses, housekeeping) is the crate
//! outbox-round (round/), shared with `outbox-relay` outside the server; its modules are
//! re-exported here under their old names.

pub use outbox_round::{backoff, housekeeping, losses, read, readiness, replay, round, settle, state, tick_settings};

pub mod health;
pub mod launcher;
pub mod settings;
pub mod spi;
pub mod txn;
pub mod worker;
