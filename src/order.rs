//! Per-aggregate order at enqueue: which shard an aggregate belongs to, and the order lock.
//!
//! The relay publishes each aggregate's events in `id` order. For that to be commit order, two
//! transactions enqueuing for the same aggregate must not draw their ids in one order and commit in
//! the other. `outbox_enqueue` therefore takes the aggregate's *order lock* before drawing the id
//! and holds it to the end of the transaction: the second enqueuer waits until the first has
//! committed (locks are released after the commit is visible), so its id is higher and its commit
//! later. The lock writes nothing. It is a lock of type `LOCKTAG_USERLOCK`, which PostgreSQL keeps
//! for extensions and no SQL function takes, keyed by a 64-bit hash of the aggregate.
//!
//! A transaction takes at most `MAX_ORDER_LOCKS` of them: every lock takes an entry of the shared
//! lock table (`max_locks_per_transaction` × connections, 6,400 by default), and a bulk load of tens
//! of thousands of aggregates in one transaction would exhaust it. Beyond the cap, a transaction's
//! further aggregates are ordered by `id` against concurrent transactions of the same aggregates
//! (docs/worker.md, "Order per aggregate").

use std::cell::Cell;

use pgrx::pg_sys;

/// Shards of the log: the unit of work relays claim (`outbox.shards` has one row per shard).
pub const SHARDS: u64 = 16;

/// Order locks one transaction takes at most.
pub const MAX_ORDER_LOCKS: u32 = 256;

thread_local! {
    /// Order locks taken by the current transaction; reset at every transaction end.
    static TAKEN: Cell<u32> = const { Cell::new(0) };
}

/// FNV-1a, 64 bits, over the aggregate type, a separator and the aggregate id. Fixed forever: a
/// stored event's shard must mean the same to every build, or one aggregate's events would be split
/// across shards and their order lost.
pub fn aggregate_hash(aggregate_type: &str, aggregate_id: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for byte in aggregate_type.bytes().chain(std::iter::once(0xff)).chain(aggregate_id.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    hash
}

/// The shard of an aggregate.
pub fn shard_of(aggregate_type: &str, aggregate_id: &str) -> i16 {
    (aggregate_hash(aggregate_type, aggregate_id) % SHARDS) as i16
}

/// Takes the aggregate's order lock until the end of the current transaction (waiting for a
/// concurrent enqueuer of the same aggregate to finish), unless the transaction already took
/// `MAX_ORDER_LOCKS`. Taking one it already holds costs a local lookup.
pub fn lock_aggregate(aggregate_type: &str, aggregate_id: &str) {
    if TAKEN.with(Cell::get) >= MAX_ORDER_LOCKS {
        return;
    }
    let tag = order_lock_tag(aggregate_hash(aggregate_type, aggregate_id));
    // SAFETY: inside a transaction; a transaction-level lock, waited for like a row lock (the
    // waiter is a client backend, which answers cancellation and termination while it waits).
    let result = unsafe { pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, false) };
    if result == pg_sys::LockAcquireResult::LOCKACQUIRE_OK {
        TAKEN.with(|taken| taken.set(taken.get() + 1));
    }
}

/// Whether a transaction is enqueuing for this aggregate right now (holds its order lock):
/// `outbox.forget_aggregates` leaves such an aggregate's counter alone. The lock is only tried,
/// and released at once, so checking many aggregates takes no lock table entries.
pub fn enqueue_in_progress(aggregate_type: &str, aggregate_id: &str) -> bool {
    let tag = order_lock_tag(aggregate_hash(aggregate_type, aggregate_id));
    let mode = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;
    // SAFETY: inside a transaction; a conditional acquire never waits, and a lock this call took
    // is released right away (one the caller already held is left as it was).
    unsafe {
        match pg_sys::LockAcquire(&tag, mode, false, true) {
            pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL => true,
            pg_sys::LockAcquireResult::LOCKACQUIRE_OK => {
                pg_sys::LockRelease(&tag, mode, false);
                false
            }
            _ => false,
        }
    }
}

fn order_lock_tag(hash: u64) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: set for every connected backend.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: (hash >> 32) as u32,
        locktag_field3: hash as u32,
        // 2 tells these apart from any other userlock of this extension.
        locktag_field4: 2,
        locktag_type: pg_sys::LockTagType::LOCKTAG_USERLOCK as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Forgets the count at the end of a transaction (its locks are released then).
pub fn transaction_ended() {
    TAKEN.with(|taken| taken.set(0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fixed_and_separates_type_from_id() {
        // Pinned values: a change would move stored events to other shards.
        assert_eq!(aggregate_hash("payment", "42"), aggregate_hash("payment", "42"));
        assert_ne!(aggregate_hash("ab", "c"), aggregate_hash("a", "bc"));
        assert_eq!(aggregate_hash("", ""), {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            h ^= 0xff;
            h.wrapping_mul(0x0000_0100_0000_01b3)
        });
    }

    #[test]
    fn shards_spread_aggregates() {
        let mut counts = [0u32; SHARDS as usize];
        for id in 0..16_000 {
            counts[shard_of("payment", &id.to_string()) as usize] += 1;
        }
        assert!(counts.iter().all(|&n| (800..1200).contains(&n)), "{counts:?}");
    }
}
