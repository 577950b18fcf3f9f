//! The background workers that publish the log: the launcher (one set of relays per database with
//! outbox_pg) and the relays, each a loop of rounds. docs/worker.md.
//!
//! - `launcher`: starts, restarts and stops the relays of every database.
//! - `worker`: one relay's main loop: signals, waits, backoff; `settings` what it runs with,
//!   `health` what it reports (logged on changes of state).
//! - `round`: one round: `read` (claim and read), `publish` (what goes to Redis, and what Redis
//!   said of each entry), `settle` (finish); `state` is what the rounds keep from one to the
//!   next, `readiness` whether they may run.
//! - `tick_settings`: what every step of a round is given (a leaf they all share).
//! - `replay`: replay rounds between live ones; `losses`: noticing and recording lost entries.
//! - `housekeeping`: the reaper, the age check, recorded snapshots, retention.
//! - `backoff`, `txn`: capped exponential backoff; a database step as a short transaction.
//! - `spi`: the round's database interface (outbox-round's `Database`) over SPI.

pub mod backoff;
pub mod health;
pub mod housekeeping;
pub mod launcher;
pub mod losses;
pub mod publish;
pub mod read;
pub mod readiness;
pub mod replay;
pub mod round;
pub mod settings;
pub mod settle;
pub mod spi;
pub mod state;
pub mod tick_settings;
pub mod txn;
pub mod worker;
