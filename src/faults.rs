//! Faults a relay injects on purpose, for the fault tests and the demo: compiled only with the
//! `fault-injection` cargo feature (`scripts/test.sh` and `scripts/demo.sh` build with it; the
//! packages and `cargo pgrx install` without), so that a production library has neither the
//! setting `outbox.fault_injection` nor any check of it on a relay's path. TimescaleDB compiles its
//! waitpoints out the same way.
//!
//! `outbox.fault_injection = crash_after_publish` (superuser, reload): a relay exits right after
//! Redis accepted a round and before the round is finished, as a crash would, once per arming
//! (setting it to `none` and reloading arms it again). The launcher starts a new relay, which reads
//! the same events and publishes them again: the duplicates the at-least-once promise allows.
//!
//! `crash_after_finish`: a relay dies (SIGKILL, as `kill -9`: PostgreSQL restarts every backend)
//! right after a round's finish committed and its WAL was flushed, once per arming: what a host
//! losing PostgreSQL just after a finish leaves (tests/losses.rs).
//!
//! `out_of_memory_after_publish`: at the same point, the relay asks its Rust heap for 1 GiB
//! (tests/losses.rs runs it under an address-space limit): what the library does when an
//! allocation fails (src/allocator.rs).
//!
//! `outbox.fault_injection = slow_relay_start`: every relay pauses a second after it connected to
//! its database and before it starts, so that a test can run a statement in that window (a relay
//! connected before `CREATE DATABASE ... TEMPLATE` locked the database must still step aside).

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgAtomic, PostgresGucEnum};

/// Failures a relay can be told to inject.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fault {
    #[name = c"none"]
    None,
    /// Exit right after a successful XADD, before the round is finished (once per arming).
    #[name = c"crash_after_publish"]
    CrashAfterPublish,
    /// Die (SIGKILL) right after a round's finish is committed and flushed (once per arming).
    #[name = c"crash_after_finish"]
    CrashAfterFinish,
    /// At the same point, allocate 1 GiB in the Rust heap (once per arming).
    #[name = c"out_of_memory_after_publish"]
    OutOfMemoryAfterPublish,
    /// Pause a second after connecting, before starting (every relay start).
    #[name = c"slow_relay_start"]
    SlowRelayStart,
}

/// `outbox.fault_injection` (default `none`, reload, superuser only).
static FAULT: GucSetting<Fault> = GucSetting::<Fault>::new(Fault::None);

/// Whether the armed fault has fired since it was armed (all relays of the server).
// SAFETY: the name is unique to this extension.
static FIRED: PgAtomic<AtomicBool> = unsafe { PgAtomic::new(c"outbox_pg_fault_fired") };

/// Defines the setting; from `guc::init`.
pub fn define_setting() {
    GucRegistry::define_enum_guc(
        c"outbox.fault_injection",
        c"Failure the relay injects, for tests and demos: none, crash_after_publish, crash_after_finish, out_of_memory_after_publish or slow_relay_start.",
        c"crash_after_publish makes a relay exit once, right after Redis accepted a round and before it is finished; slow_relay_start makes every relay pause a second between connecting and starting.",
        &FAULT,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
}

/// Requests the shared flag; from `_PG_init` while preloading.
pub fn init_shared_memory() {
    pg_shmem_init!(FIRED);
}

/// After a reload: `none` arms the fault again.
pub fn reloaded() {
    if FAULT.get() == Fault::None {
        FIRED.get().store(false, Ordering::SeqCst);
    }
}

/// Right after Redis accepted `published` events of a round, before the round is finished.
pub fn after_publish(published: usize) {
    let fault = FAULT.get();
    let here = matches!(fault, Fault::CrashAfterPublish | Fault::OutOfMemoryAfterPublish);
    if !here || published == 0 || FIRED.get().swap(true, Ordering::SeqCst) {
        return;
    }
    match fault {
        Fault::None | Fault::CrashAfterFinish | Fault::SlowRelayStart => {}
        Fault::CrashAfterPublish => {
            log!("outbox_pg: outbox.fault_injection = crash_after_publish: exiting after publishing {published} events, before finishing the round");
            // SAFETY: ends the process the way PostgreSQL expects; no transaction is open.
            unsafe { pg_sys::proc_exit(1) };
        }
        Fault::OutOfMemoryAfterPublish => {
            log!("outbox_pg: outbox.fault_injection = out_of_memory_after_publish: allocating 1 GiB after publishing {published} events");
            let huge: Vec<u8> = Vec::with_capacity(1 << 30);
            std::hint::black_box(&huge);
        }
    }
}

/// Right after the finish of a round that published `published` events committed.
pub fn after_finish(published: usize) {
    if FAULT.get() != Fault::CrashAfterFinish || published == 0 || FIRED.get().swap(true, Ordering::SeqCst) {
        return;
    }
    log!("outbox_pg: outbox.fault_injection = crash_after_finish: dying (SIGKILL) after finishing a round of {published} events");
    // SAFETY: flushes the WAL written so far (the finish's commit record, committed
    // asynchronously), outside any transaction; then the process kills itself, as kill -9 would.
    unsafe {
        pg_sys::XLogFlush(pg_sys::GetXLogInsertRecPtr());
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// Right after a relay connected to its database, before it registers and starts.
pub fn relay_connected() {
    if FAULT.get() != Fault::SlowRelayStart {
        return;
    }
    log!("outbox_pg: outbox.fault_injection = slow_relay_start: pausing a second before starting");
    // SAFETY: a plain sleep, outside any transaction; interrupts are processed after it.
    unsafe { pg_sys::pg_usleep(1_000_000) };
    pgrx::check_for_interrupts!();
}
