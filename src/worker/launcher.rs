//! The launcher: a static worker connected to no database. It waits until `outbox.database`
//! exists, starts the relay there as a dynamic worker, and starts it again whenever it exits
//! (its database was dropped, it was terminated, it failed). This is what lets the relay survive
//! `DROP DATABASE ... WITH (FORCE)` and a database created after the server started, without a
//! crash loop of FATAL "database does not exist" lines.

use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::prelude::*;

use crate::{guc, shmem};

/// Pause between a relay exit and its replacement, so that a relay failing at start cannot spin.
const RELAUNCH_DELAY: Duration = Duration::from_secs(1);
/// How often the launcher re-checks a missing database.
const DATABASE_RECHECK: Duration = Duration::from_secs(1);
/// Longest sleep while the relay runs: its exit also wakes the launcher (bgw_notify_pid).
const SUPERVISE_INTERVAL: Duration = Duration::from_secs(10);

/// One relay slot as the launcher sees it.
enum Slot {
    /// Not running; may start at `not_before`.
    Idle {
        not_before: Instant,
    },
    Running(DynamicBackgroundWorker),
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_pg_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher reads only the shared catalog pg_database.
    BackgroundWorker::connect_worker_to_spi(None, None);

    let database = guc::database();
    let mut slots: Vec<Slot> = (0..shmem::MAX_RELAYS).map(|_| Slot::Idle { not_before: Instant::now() }).collect();
    let mut reported_missing = false;

    loop {
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way for a worker to re-read postgresql.conf after SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let wanted = guc::workers();
        let mut timeout = SUPERVISE_INTERVAL;
        let mut database_oid_checked = None;

        for (index, slot) in slots.iter_mut().enumerate() {
            // Notice exits (the postmaster wakes us through bgw_notify_pid).
            if let Slot::Running(handle) = slot {
                match handle.pid() {
                    Ok(_) | Err(BackgroundWorkerStatus::NotYetStarted) => {}
                    Err(BackgroundWorkerStatus::PostmasterDied) => return,
                    Err(_) => *slot = Slot::Idle { not_before: Instant::now() + RELAUNCH_DELAY },
                }
            }
            match slot {
                Slot::Running(_) if index >= wanted => {
                    // outbox.workers was lowered.
                    if let Slot::Running(handle) = std::mem::replace(slot, Slot::Idle { not_before: Instant::now() }) {
                        let _ = handle.terminate().wait_for_shutdown();
                    }
                }
                Slot::Idle { not_before } if index < wanted => {
                    let now = Instant::now();
                    if now < *not_before {
                        timeout = timeout.min(*not_before - now);
                        continue;
                    }
                    // A relay left over from a previous launcher (which was terminated) still runs.
                    if shmem::relay_pid_in(index).is_some_and(process_alive) {
                        timeout = timeout.min(DATABASE_RECHECK);
                        continue;
                    }
                    let oid = *database_oid_checked.get_or_insert_with(|| database_oid(&database));
                    let Some(oid) = oid else {
                        if !reported_missing {
                            log!(
                                "outbox_pg: database \"{database}\" (outbox.database) does not exist; the relay starts when it is created"
                            );
                            reported_missing = true;
                        }
                        timeout = timeout.min(DATABASE_RECHECK);
                        continue;
                    };
                    if reported_missing {
                        log!("outbox_pg: database \"{database}\" exists now; starting the relay");
                        reported_missing = false;
                    }
                    match start_relay(oid, index) {
                        Some(handle) => *slot = Slot::Running(handle),
                        None => {
                            warning!(
                                "outbox_pg: could not start relay worker {index} (is max_worker_processes large enough?); retrying in {}s",
                                (RELAUNCH_DELAY * 5).as_secs()
                            );
                            *slot = Slot::Idle { not_before: Instant::now() + RELAUNCH_DELAY * 5 };
                            timeout = timeout.min(RELAUNCH_DELAY * 5);
                        }
                    }
                }
                _ => {}
            }
        }

        if !BackgroundWorker::wait_latch(Some(timeout)) {
            break;
        }
    }

    // Stop the relays with us, so that a restarted launcher never runs a second set beside them.
    for slot in slots {
        if let Slot::Running(handle) = slot {
            let _ = handle.terminate().wait_for_shutdown();
        }
    }
    // Exit code 1 asks the postmaster to restart the launcher, unless the server is shutting down.
    // SAFETY: ends this process the way PostgreSQL expects.
    unsafe { pg_sys::proc_exit(1) };
}

/// Looks the database up in the shared catalog pg_database. A heap scan, not `get_database_oid`:
/// without a database selected, opening pg_database's index fails on a freshly initdb'd cluster.
fn database_oid(name: &str) -> Option<pg_sys::Oid> {
    let name = std::ffi::CString::new(name).ok()?;
    let oid = BackgroundWorker::transaction(move || {
        // SAFETY: inside a transaction; the relation is opened and closed here, the scan key points
        // at `name` which outlives the scan, and the tuple is read only while the scan is open.
        unsafe {
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            let relation = pg_sys::table_open(pg_sys::DatabaseRelationId, lock);
            let mut key = pg_sys::ScanKeyData::default();
            pg_sys::ScanKeyInit(
                &mut key,
                pg_sys::Anum_pg_database_datname as pg_sys::AttrNumber,
                pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                pg_sys::Oid::from(pg_sys::F_NAMEEQ),
                pg_sys::Datum::from(name.as_ptr()),
            );
            let scan = pg_sys::systable_beginscan(
                relation,
                pg_sys::Oid::from(pg_sys::DatabaseNameIndexId),
                false,
                std::ptr::null_mut(),
                1,
                &mut key,
            );
            let tuple = pg_sys::systable_getnext(scan);
            let oid = if tuple.is_null() {
                pg_sys::InvalidOid
            } else {
                (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple)).oid
            };
            pg_sys::systable_endscan(scan);
            pg_sys::table_close(relation, lock);
            oid
        }
    });
    Some(oid).filter(|oid| *oid != pg_sys::InvalidOid)
}

fn start_relay(database_oid: pg_sys::Oid, slot: usize) -> Option<DynamicBackgroundWorker> {
    // SAFETY: MyProcPid is set for every backend.
    let launcher_pid = unsafe { pg_sys::MyProcPid };
    BackgroundWorkerBuilder::new(&format!("outbox_pg relay {slot}"))
        .set_type("outbox_pg relay")
        .set_library("outbox_pg")
        .set_function("outbox_pg_relay_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        // The launcher restarts it; the postmaster must not.
        .set_restart_time(None)
        .set_argument(Some(pg_sys::Datum::from(u32::from(database_oid))))
        .set_extra(&slot.to_string())
        .set_notify_pid(launcher_pid)
        .load_dynamic()
        .ok()
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Registers the launcher; called from `_PG_init` while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("outbox_pg launcher")
        .set_type("outbox_pg launcher")
        .set_library("outbox_pg")
        .set_function("outbox_pg_launcher_main")
        .enable_spi_access()
        // Never on a standby: the relay starts once recovery has finished (i.e. after promotion).
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(1)))
        .load();
}
