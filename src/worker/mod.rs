//! The background workers: a launcher (no database) that supervises one relay (connected to
//! `outbox.database`) which claims, publishes and settles events. See docs/worker.md.

pub mod backoff;
pub mod launcher;
pub mod relay;
pub mod tick;
pub mod txn;
