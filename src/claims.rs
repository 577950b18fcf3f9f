//! What each relay has in flight, in shared memory, for `outbox.stats` and `outbox.relays()`.
//!
//! The relays' work is claimed in the database (shards, `outbox._claim_shards`), but how many
//! events a relay is publishing right now, and since when, is only worth a few atomics: every round
//! would otherwise write it. A round older than `outbox.lease` means a hung relay (its shards'
//! lease expires too, and other relays take them over); the housekeeping logs each such round once.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic};

use crate::shmem::{self, MAX_DATABASES, MAX_RELAYS};

/// Relay slots of all databases: entry × `MAX_RELAYS` + slot.
const SLOTS: usize = MAX_DATABASES * MAX_RELAYS;

pub struct InFlight {
    /// When the relay in each slot started publishing its current round (PostgreSQL timestamp,
    /// µs); 0 while it has nothing in flight.
    since: [AtomicI64; SLOTS],
    /// Events in that round.
    events: [AtomicU32; SLOTS],
    /// The `since` of the last overdue round the housekeeping logged, so it logs each once.
    reported: [AtomicI64; SLOTS],
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight {
            since: std::array::from_fn(|_| AtomicI64::new(0)),
            events: std::array::from_fn(|_| AtomicU32::new(0)),
            reported: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

// SAFETY: only atomics inside, valid in shared memory across processes.
unsafe impl PGRXSharedMemory for InFlight {}

// SAFETY: the name is unique to this extension.
static IN_FLIGHT: PgAtomic<InFlight> = unsafe { PgAtomic::new(c"outbox_pg_in_flight") };

/// Requests the shared memory; must be called from `_PG_init` while preloading.
pub fn init() {
    pg_shmem_init!(IN_FLIGHT);
}

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

fn is_overdue(since: i64, now: i64, lease: Duration) -> bool {
    now - since >= lease.as_micros() as i64
}

/// Where this database's relay `slot` keeps its round, if the launcher serves this database.
fn index(slot: usize) -> Option<usize> {
    shmem::this_entry().map(|entry| entry * MAX_RELAYS + slot)
}

/// Forgets every round of `entry` (the launcher assigns it to a database).
pub fn reset(entry: usize) {
    let shared = IN_FLIGHT.get();
    for slot in entry * MAX_RELAYS..(entry + 1) * MAX_RELAYS {
        shared.since[slot].store(0, Ordering::SeqCst);
        shared.reported[slot].store(0, Ordering::SeqCst);
    }
}

/// The relay in `slot` starts publishing `events` events.
pub fn begin(slot: usize, events: usize) {
    let Some(slot) = index(slot) else { return };
    let shared = IN_FLIGHT.get();
    shared.events[slot].store(events.min(u32::MAX as usize) as u32, Ordering::SeqCst);
    shared.since[slot].store(now_us(), Ordering::SeqCst);
}

/// The relay in `slot` has nothing in flight any more (its round finished, failed, or it stopped).
pub fn clear(slot: usize) {
    if let Some(slot) = index(slot) {
        IN_FLIGHT.get().since[slot].store(0, Ordering::SeqCst);
    }
}

/// Events in flight in all relays, rounds older than `lease` left out (a hung relay's events are
/// taken over by others and counted as pending).
pub fn in_flight_count(lease: Duration) -> i64 {
    held(lease).iter().filter(|(.., overdue)| !overdue).map(|(_, events, ..)| *events as i64).sum()
}

/// Each of this database's slots' round in flight: (slot, events, since (PostgreSQL timestamp,
/// µs), older than `lease`).
pub fn held(lease: Duration) -> Vec<(usize, usize, i64, bool)> {
    let shared = IN_FLIGHT.get();
    let now = now_us();
    (0..MAX_RELAYS)
        .filter_map(|slot| {
            let at = index(slot)?;
            let since = shared.since[at].load(Ordering::SeqCst);
            (since != 0).then(|| {
                (slot, shared.events[at].load(Ordering::SeqCst) as usize, since, is_overdue(since, now, lease))
            })
        })
        .collect()
}

/// Rounds older than `lease` not reported yet, as (slot, events, age), so that the housekeeping
/// logs each once.
pub fn newly_expired(lease: Duration) -> Vec<(usize, usize, Duration)> {
    let shared = IN_FLIGHT.get();
    let now = now_us();
    let mut overdue = Vec::new();
    for slot in 0..MAX_RELAYS {
        let Some(at) = index(slot) else { break };
        let since = shared.since[at].load(Ordering::SeqCst);
        if since != 0 && is_overdue(since, now, lease) && shared.reported[at].swap(since, Ordering::SeqCst) != since {
            overdue.push((
                slot,
                shared.events[at].load(Ordering::SeqCst) as usize,
                Duration::from_micros((now - since) as u64),
            ));
        }
    }
    overdue
}
