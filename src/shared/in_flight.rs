//! What each relay has in flight, in shared memory, for `outbox.stats` and `outbox.relays()`.
//!
//! The relays' work is claimed in the database (shards, `outbox._claim_shards`), but how many
//! events a relay is publishing right now, and since when, is only worth a few atomics: every round
//! would otherwise write it. A round older than `outbox.lease` means a hung relay (its shards'
//! lease expires too, and other relays take them over); the housekeeping logs each such round once.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;

use pgrx::prelude::*;

use crate::shared::databases::{this_entry, MAX_RELAYS};
use crate::shared::sized::{SharedArray, Zeroed};

/// The rounds in flight of one database entry's relays, by slot.
pub struct InFlightEntry {
    /// When the relay in each slot started publishing its current round (PostgreSQL timestamp,
    /// µs); 0 while it has nothing in flight.
    since: [AtomicI64; MAX_RELAYS],
    /// Events in that round.
    events: [AtomicU32; MAX_RELAYS],
    /// The `since` of the last overdue round the housekeeping logged, so it logs each once.
    reported: [AtomicI64; MAX_RELAYS],
}

// SAFETY: only atomics, which all-zero bytes make valid, shared by processes.
unsafe impl Zeroed for InFlightEntry {}

/// One per database entry, sized at server start with the entries (src/shared/mod.rs).
// SAFETY: the name is unique to this extension.
pub(super) static ROUNDS: SharedArray<InFlightEntry> = unsafe { SharedArray::new(c"outbox_pg_in_flight") };

fn now_us() -> i64 {
    // SAFETY: reads the clock; no preconditions.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

fn is_overdue(since: i64, now: i64, lease: Duration) -> bool {
    now - since >= lease.as_micros() as i64
}

/// This database's relays' rounds, if the launcher serves this database.
fn here() -> Option<&'static InFlightEntry> {
    this_entry().and_then(|entry| ROUNDS.get().get(entry))
}

/// Forgets every round of `entry` (the launcher assigns it to a database).
pub fn reset(entry: usize) {
    let Some(rounds) = ROUNDS.get().get(entry) else { return };
    for slot in 0..MAX_RELAYS {
        rounds.since[slot].store(0, Ordering::SeqCst);
        rounds.reported[slot].store(0, Ordering::SeqCst);
    }
}

/// The relay in `slot` starts publishing `events` events.
pub fn begin(slot: usize, events: usize) {
    let Some(rounds) = here() else { return };
    rounds.events[slot].store(events.min(u32::MAX as usize) as u32, Ordering::SeqCst);
    rounds.since[slot].store(now_us(), Ordering::SeqCst);
}

/// The relay in `slot` has nothing in flight any more (its round finished, failed, or it stopped).
pub fn clear(slot: usize) {
    if let Some(rounds) = here() {
        rounds.since[slot].store(0, Ordering::SeqCst);
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
    let Some(rounds) = here() else { return Vec::new() };
    let now = now_us();
    (0..MAX_RELAYS)
        .filter_map(|slot| {
            let since = rounds.since[slot].load(Ordering::SeqCst);
            (since != 0).then(|| {
                (slot, rounds.events[slot].load(Ordering::SeqCst) as usize, since, is_overdue(since, now, lease))
            })
        })
        .collect()
}

/// Rounds older than `lease` not reported yet, as (slot, events, age), so that the housekeeping
/// logs each once.
pub fn newly_expired(lease: Duration) -> Vec<(usize, usize, Duration)> {
    let Some(rounds) = here() else { return Vec::new() };
    let now = now_us();
    let mut overdue = Vec::new();
    for slot in 0..MAX_RELAYS {
        let since = rounds.since[slot].load(Ordering::SeqCst);
        if since != 0 && is_overdue(since, now, lease) && rounds.reported[slot].swap(since, Ordering::SeqCst) != since {
            overdue.push((
                slot,
                rounds.events[slot].load(Ordering::SeqCst) as usize,
                Duration::from_micros((now - since) as u64),
            ));
        }
    }
    overdue
}
