//! The background workers: a launcher (no database) that supervises `outbox.workers` relays
//! (connected to `outbox.database`) which claim, publish and settle events. See docs/worker.md.

pub mod backoff;
pub mod launcher;
pub mod relay;
pub mod tick;
pub mod txn;
