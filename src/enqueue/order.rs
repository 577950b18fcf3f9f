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
//! A transaction holds at most `MAX_ORDER_LOCKS` of them: every lock takes an entry of the shared
//! lock table (`max_locks_per_transaction` × connections, 6,400 by default), and a bulk load of tens
//! of thousands of aggregates in one transaction would exhaust it. The cap counts the locks the
//! transaction *holds*: a subtransaction that rolls back (`ROLLBACK TO SAVEPOINT`, an exception
//! block) releases the order locks it took, and they no longer count. Beyond the cap a
//! transaction takes no further order lock but the *past-the-cap* lock (shared, one per
//! transaction), and its further aggregates are ordered against concurrent transactions of the same
//! aggregates by the relay's window rule only (docs/worker.md, "Order per aggregate", says exactly
//! what that keeps); `outbox.forget_aggregates` forgets nothing while such a transaction runs.

use std::cell::RefCell;

use pgrx::pg_sys;

/// Shards of the log: the unit of work relays claim (`outbox.shards` has one row per shard).
pub use outbox_round::SHARDS;

/// Order locks one transaction takes at most.
pub const MAX_ORDER_LOCKS: u32 = 256;

thread_local! {
    /// The order locks the current transaction holds, counted per subtransaction that took them:
    /// (subtransaction id, locks it took), innermost last. Subtransaction ids grow, so on the end
    /// of subtransaction `n` every entry from `n` on belongs to it or to a subtransaction of it that
    /// already ended. Cleared at every transaction end.
    static HELD: RefCell<Vec<(pg_sys::SubTransactionId, u32)>> = const { RefCell::new(Vec::new()) };
}

/// How many order locks the current transaction holds.
pub fn locks_held() -> u32 {
    HELD.with(|held| held.borrow().iter().map(|(_, n)| n).sum())
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
/// concurrent enqueuer of the same aggregate to finish), unless the transaction already holds
/// `MAX_ORDER_LOCKS`; then it takes the past-the-cap lock instead. Taking one it already holds
/// costs a local lookup.
pub fn lock_aggregate(aggregate_type: &str, aggregate_id: &str) {
    let mode = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;
    let tag = order_lock_tag(aggregate_hash(aggregate_type, aggregate_id), AGGREGATE_LOCK);
    if locks_held() >= MAX_ORDER_LOCKS && !lock_held_by_me(&tag, mode) {
        // SAFETY: as below; shared with every other transaction past the cap.
        unsafe {
            pg_sys::LockAcquire(&past_cap_tag(), pg_sys::ShareLock as pg_sys::LOCKMODE, false, false);
        }
        return;
    }
    // SAFETY: inside a transaction; a transaction-level lock, waited for like a row lock (the
    // waiter is a client backend, which answers cancellation and termination while it waits).
    let result = unsafe { pg_sys::LockAcquire(&tag, mode, false, false) };
    if result == pg_sys::LockAcquireResult::LOCKACQUIRE_OK {
        // SAFETY: inside a transaction.
        let subtransaction = unsafe { pg_sys::GetCurrentSubTransactionId() };
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            match held.last_mut() {
                Some((sub, n)) if *sub == subtransaction => *n += 1,
                _ => held.push((subtransaction, 1)),
            }
        });
    }
}

/// Whether this transaction holds `tag` in `mode` (a lookup in the backend's own lock table).
fn lock_held_by_me(tag: &pg_sys::LOCKTAG, mode: pg_sys::LOCKMODE) -> bool {
    // SAFETY: inside a transaction; reads the backend-local lock table only.
    unsafe {
        // PostgreSQL 17 added `orstronger` (false: exactly this mode).
        #[cfg(any(feature = "pg17", feature = "pg18"))]
        return pg_sys::LockHeldByMe(tag, mode, false);
        #[cfg(not(any(feature = "pg17", feature = "pg18")))]
        return pg_sys::LockHeldByMe(tag, mode);
    }
}

/// Takes the past-the-cap lock exclusively, without waiting, until the end of the transaction:
/// false while a transaction past `MAX_ORDER_LOCKS` runs (its later aggregates have no order lock
/// that `outbox.forget_aggregates` could try). Held, it makes such a transaction wait at its cap.
pub fn exclude_transactions_past_the_cap() -> bool {
    // SAFETY: inside a transaction; a conditional acquire never waits.
    let result =
        unsafe { pg_sys::LockAcquire(&past_cap_tag(), pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, true) };
    result != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// Whether a transaction is enqueuing for this aggregate right now (holds its order lock):
/// `outbox.forget_aggregates` leaves such an aggregate's counter alone. The lock is only tried,
/// and released at once, so checking many aggregates takes no lock table entries.
pub fn enqueue_in_progress(aggregate_type: &str, aggregate_id: &str) -> bool {
    let tag = order_lock_tag(aggregate_hash(aggregate_type, aggregate_id), AGGREGATE_LOCK);
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

/// The fourth field of this extension's userlocks: an aggregate's order lock, and the one lock
/// transactions past the cap share.
const AGGREGATE_LOCK: u16 = 2;
const PAST_CAP_LOCK: u16 = 3;

fn order_lock_tag(hash: u64, kind: u16) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: set for every connected backend.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: (hash >> 32) as u32,
        locktag_field3: hash as u32,
        locktag_field4: kind,
        locktag_type: pg_sys::LockTagType::LOCKTAG_USERLOCK as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

fn past_cap_tag() -> pg_sys::LOCKTAG {
    order_lock_tag(0, PAST_CAP_LOCK)
}

/// Forgets the count at the end of a transaction (its locks are released then).
pub fn transaction_ended() {
    HELD.with(|held| held.borrow_mut().clear());
}

/// Registers the subtransaction callback that keeps the count true; called from `_PG_init` while
/// preloading, so every backend inherits it (`outbox_enqueue` refuses without preloading).
pub fn init() {
    // SAFETY: `on_subxact_event` matches PostgreSQL's SubXactCallback and never raises.
    unsafe { pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut()) };
}

/// A subtransaction that rolls back has released the order locks it took; one that commits hands
/// them to its parent. No allocation beyond what the list already has, no error.
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    subtransaction: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    let _ = HELD.try_with(|held| {
        let Ok(mut held) = held.try_borrow_mut() else { return };
        match event {
            pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => held.retain(|(sub, _)| *sub < subtransaction),
            pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => {
                let moved: u32 = held.iter().filter(|(sub, _)| *sub >= subtransaction).map(|(_, n)| n).sum();
                if moved == 0 {
                    return;
                }
                held.retain(|(sub, _)| *sub < subtransaction);
                match held.last_mut() {
                    Some((sub, n)) if *sub == parent => *n += moved,
                    // Capacity is left by the entries just removed: no allocation.
                    _ => held.push((parent, moved)),
                }
            }
            _ => {}
        }
    });
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
