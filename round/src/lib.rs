//! The relay's round, written once for the background worker (over SPI) and for `outbox-relay`
//! outside the server (over a client connection): docs/outside-relay.md.
//!
//! - `db`: the one thing a round needs of PostgreSQL: run this statement in this transaction.
//! - `hooks`: what a round tells the process it runs in (log lines, commit flags, counts).
//! - `snapshot`, `window`: a cursor's `pg_snapshot`; what a round takes from the log (an event
//!   with its place in the publish order, the round's allowance, a shard's read).
//! - `round`: one round: `read` (claim and read), `publish` (what goes to Redis, and what Redis
//!   said of each entry), `settle` (finish); `state` is what the rounds keep from one to the
//!   next, `readiness` whether they may run.
//! - `tick_settings`: what every step of a round is given (a leaf they all share).
//! - `replay`: replay rounds between live ones; `losses`: noticing and recording lost entries.
//! - `housekeeping`: the reaper, the age check, recorded snapshots, retention.
//! - `session`: the session settings every relay pins.
//! - `backoff`: capped exponential backoff; `coalesce`: the pause after a busy round; `time`: timestamps as the relays write them.

pub mod backoff;
pub mod coalesce;
pub mod db;
pub mod hooks;
pub mod housekeeping;
pub mod losses;
pub mod publish;
pub mod read;
pub mod readiness;
pub mod replay;
pub mod round;
pub mod session;
pub mod settle;
pub mod snapshot;
pub mod state;
pub mod tick_settings;
pub mod time;
pub mod window;

/// How many shards the log has: the enqueue puts each aggregate in one (src/enqueue/order.rs).
pub const SHARDS: u64 = 16;
