//! The log: the three tables `outbox_enqueue` appends to and the relays read, never updating or
//! deleting a row (retention truncates whole tables). docs/worker.md, "The log".
//!
//! - `columns`: the tables and their columns, written once for every Rust path.
//! - `append`: the enqueue's write: the current table, the next id, the row's insert.
//! - `snapshot`: a cursor's `pg_snapshot`: which transactions it sees.
//! - `batch`: what a round takes: an event with its place in the publish order, the allowance.
//! - `window`: the batch rule: which events of a shard a round publishes, in which order, and how
//!   a window too large for one round is published in parts.
//! - `tables`: the tables opened under one snapshot, and their index scans.
//! - `pending`: what is undelivered, exactly (outbox.stats, the age alert).
//! - `counters`: the per-aggregate `aggregate_seq` counters.
//! - `datums`: relations, columns and values read without the executor.

pub mod append;
pub use outbox_round::window as batch;
pub mod columns;
pub mod counters;
pub mod datums;
pub mod pending;
pub use outbox_round::snapshot;
pub mod tables;
pub mod window;
