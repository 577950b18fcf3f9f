//! An idempotent Redis Streams consumer for the events that the `outbox_pg` PostgreSQL extension
//! relays (one stream entry per event, see [`Event`]).
//!
//! Delivery from the outbox is at-least-once: the same event (same `event_id`) can appear in a
//! stream more than once, and a consumer can crash before acknowledging. This crate turns that
//! into "the handler runs once per event" for handlers whose effects live outside a database:
//!
//! * entries are read through a consumer group (XREADGROUP), so several consumers share a stream;
//! * each event is deduplicated by `event_id` with a Redis key taken before the handler runs
//!   (see [`Consumer`] and the README for the protocol and its failure windows);
//! * an entry is acknowledged only after its handler succeeded; failed or abandoned entries are
//!   reclaimed with XAUTOCLAIM after an idle timeout and retried;
//! * entries that keep failing, and malformed ones, go to a dead-letter stream instead of being
//!   retried forever;
//! * [`AggregateSeqs`] checks each aggregate's `aggregate_seq` for gaps, reorderings and repeats;
//! * one server or a Redis Cluster ([`RedisMode`]), over TLS (`rediss://`, mutual TLS) and as an
//!   ACL user whose password may come from a file (see [`ConsumerConfig`] and the README's
//!   "Topologies").
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//! use outbox_consumer::{Consumer, ConsumerConfig, Event};
//!
//! # fn main() -> Result<(), outbox_consumer::ConsumerError> {
//! let config = ConsumerConfig::new("redis://127.0.0.1:6379/", "outbox:order", "billing");
//! let mut consumer = Consumer::connect(config)?;
//! let stop = AtomicBool::new(false);
//! consumer.run(
//!     |event: &Event| -> Result<(), String> {
//!         println!("{} #{} {}", event.aggregate_id, event.aggregate_seq, event.event_type);
//!         Ok(())
//!     },
//!     &stop,
//! )?;
//! println!("{:?}", consumer.stats());
//! # Ok(())
//! # }
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod connection;
mod consumer;
mod error;
mod event;
mod reply;
mod sequence;

pub use config::{
    default_consumer_name, ConsumerConfig, RedisMode, DEFAULT_BATCH_SIZE, DEFAULT_BLOCK_TIMEOUT,
    DEFAULT_CLAIM_IDLE_TIMEOUT, DEFAULT_CLAIM_INTERVAL, DEFAULT_DEDUP_TTL, DEFAULT_MAX_DELIVERIES,
    DEFAULT_RECONNECT_ATTEMPTS,
};
pub use consumer::{Consumer, Stats};
pub use error::ConsumerError;
pub use event::{Event, EventParseError};
pub use sequence::{AggregateSeqs, SeqOrder};

/// Compiles the README's Rust example as a doctest, so the documented API cannot drift.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
