//! The launcher: a static worker connected to no database. It lists the databases in the shared
//! catalog `pg_database`, runs `outbox.workers` relays in each one where outbox_pg is installed
//! (restricted to `outbox.databases` when set), the way TimescaleDB's launcher runs a scheduler per
//! database, and starts a relay again whenever it exits.
//!
//! A connection to no database cannot read another database's `pg_extension`, so the launcher
//! learns where the extension is by starting one relay there (a *probe*): a relay that finds no
//! outbox_pg says so in shared memory and exits, and the launcher leaves that database alone until
//! a committed `CREATE EXTENSION` or `CREATE DATABASE` (src/hooks/object_access.rs), or a reload, asks it
//! to look again. A relay that finds the extension makes the launcher start the others. One that
//! finds an unadopted copy of another database's installation (which publishes nothing) is treated
//! the same way as one without it: no relay and no entry, until `outbox.adopt_copy()` commits and
//! asks the launcher to look again. While a statement needs a database without sessions (a copy
//! of it, a rename, a drop), the launcher starts no relay there (`shared::step_aside_pending`).
//!
//! Databases that are dropped, become templates, refuse connections or leave `outbox.databases`
//! lose their relays; `DROP EXTENSION` makes them exit by themselves. Worker slots are budgeted:
//! one launcher plus `outbox.workers` relays per relayed database, each a `max_worker_processes`
//! slot. When no slot is free, the launcher logs a WARNING and shows the shortfall in the
//! database's `outbox.stats.last_error`, and tries again every few seconds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::prelude::*;

use crate::guc;
use crate::shared::{self, ExtensionState};

/// Pause between a relay exit and its replacement, so that a relay failing at start cannot spin.
const RELAUNCH_DELAY: Duration = Duration::from_secs(1);
/// Pause before trying again to start a relay for which no worker slot was free.
const NO_SLOT_RETRY: Duration = Duration::from_secs(5);
/// How often the launcher lists the databases when nothing wakes it.
const SCAN_INTERVAL: Duration = Duration::from_secs(5);

/// One relay slot as the launcher sees it.
enum Slot {
    /// Not running; may start at `not_before`.
    Idle {
        not_before: Instant,
        failed_start: bool,
    },
    Running(DynamicBackgroundWorker),
}

impl Slot {
    fn idle() -> Slot {
        Slot::Idle { not_before: Instant::now(), failed_start: false }
    }
}

/// What the launcher knows of one database it may relay.
enum Database {
    /// Relays run (or are being started) with this shared-memory entry.
    Served(Served),
    /// A probe found no outbox_pg, or an unadopted copy of another database's (which publishes
    /// nothing, so takes no entry from a database that would); looked at again once the rescan
    /// generation moves past this (`CREATE EXTENSION`, `CREATE DATABASE`, `adopt_copy()`, a reload).
    /// `copy`: the last probe found an unadopted copy, whose relay already said so (a WARNING):
    /// the next probe's relay says it again only as a LOG line.
    WithoutExtension { generation: u32, copy: bool },
}

struct Served {
    entry: usize,
    name: String,
    slots: Vec<Slot>,
    /// The rescan generation when the probe started: a `CREATE EXTENSION` committed after it may
    /// not have been seen by it.
    probed_at_generation: u32,
    /// The database was an unadopted copy at the last probe, and its relay said so then.
    copy_reported: bool,
}

/// A database as listed in `pg_database`.
struct Listed {
    oid: pg_sys::Oid,
    name: String,
    /// Connections allowed, not a template, not half-dropped.
    relayable: bool,
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_pg_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher reads only the shared catalog pg_database.
    BackgroundWorker::connect_worker_to_spi(None, None);
    // Until attach_signal_handlers ran, PostgreSQL's worker start-up ignored SIGHUP: a reload the
    // postmaster signalled in that window is lost. Reading the configuration once now catches it.
    // SAFETY: the documented way for a worker to re-read postgresql.conf, outside any transaction.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    shared::register_launcher();
    // SAFETY: `forget_launcher` matches pg_on_exit_callback and only touches a shared atomic.
    unsafe { pg_sys::before_shmem_exit(Some(forget_launcher), pg_sys::Datum::from(0)) };

    log!(
        "outbox_pg launcher: relaying at most {} databases (outbox.max_databases; {} kB of shared memory)",
        shared::database_entries(),
        (shared::database_entries() * shared::ENTRY_BYTES).div_ceil(1024)
    );
    let mut launcher = Launcher {
        databases: HashMap::new(),
        reported_filter: None,
        reported_left_out: Vec::new(),
        reported_absent: Vec::new(),
    };
    // Entries left by a previous launcher (it was terminated; its relays may still run): adopt
    // them, so that their relays are waited for rather than doubled.
    for (entry, oid) in shared::assigned_databases() {
        let slots = (0..shared::MAX_RELAYS).map(|_| Slot::idle()).collect();
        launcher.databases.insert(
            oid,
            Database::Served(Served {
                entry,
                name: format!("oid {}", oid.to_u32()),
                slots,
                probed_at_generation: 0,
                copy_reported: false,
            }),
        );
    }

    loop {
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way for a worker to re-read postgresql.conf after SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            // A reload is also the operator's way to make the launcher look everywhere again.
            shared::request_rescan();
        }
        let timeout = launcher.supervise();
        if !BackgroundWorker::wait_latch(Some(timeout)) {
            break;
        }
    }

    // Stop the relays with us, so that a restarted launcher never runs a second set beside them.
    for database in launcher.databases.into_values() {
        if let Database::Served(served) = database {
            for slot in served.slots {
                if let Slot::Running(handle) = slot {
                    let _ = handle.terminate().wait_for_shutdown();
                }
            }
        }
    }
    // Exit code 1 asks the postmaster to restart the launcher, unless the server is shutting down.
    // SAFETY: ends this process the way PostgreSQL expects.
    unsafe { pg_sys::proc_exit(1) };
}

struct Launcher {
    databases: HashMap<pg_sys::Oid, Database>,
    /// The database filter last logged, so that it is logged once per change.
    reported_filter: Option<Option<Vec<String>>>,
    /// The databases left out for lack of an entry, as last logged.
    reported_left_out: Vec<String>,
    /// Databases named in the filter that do not exist, as last logged.
    reported_absent: Vec<String>,
}

impl Launcher {
    /// One pass: list the databases, stop what is no longer wanted, start what is missing.
    /// Returns how long to sleep (relay exits and rescan requests wake the launcher earlier).
    fn supervise(&mut self) -> Duration {
        let filter = guc::databases();
        if self.reported_filter.as_ref() != Some(&filter) {
            match &filter {
                None => log!("outbox_pg launcher: relaying every database where outbox_pg is installed"),
                Some(names) if guc::databases_listed() => {
                    log!("outbox_pg launcher: relaying only {} (outbox.databases)", quoted_list(names))
                }
                Some(names) => log!(
                    "outbox_pg launcher: relaying only {} because outbox.database is set; that setting is retired: use outbox.databases (empty relays every database with outbox_pg)",
                    quoted_list(names)
                ),
            }
            self.reported_filter = Some(filter.clone());
        }
        let listed = list_databases();
        let absent: Vec<String> =
            filter.iter().flatten().filter(|name| !listed.iter().any(|db| &db.name == *name)).cloned().collect();
        for name in absent.iter().filter(|name| !self.reported_absent.contains(name)) {
            log!("outbox_pg launcher: database \"{name}\" does not exist; its relays start when it is created");
        }
        self.reported_absent = absent;
        let generation = shared::rescan_generation();
        // In a fixed order, so that when there are more databases than entries the same ones are
        // relayed after every restart: the order of outbox.databases when it is set, else the
        // databases' OIDs (creation order). A database relayed keeps its entry meanwhile.
        let mut wanted: Vec<&Listed> = listed
            .iter()
            .filter(|db| db.relayable && filter.as_ref().is_none_or(|names| names.contains(&db.name)))
            .collect();
        match &filter {
            Some(names) => wanted.sort_by_key(|db| names.iter().position(|name| *name == db.name)),
            None => wanted.sort_by_key(|db| db.oid.to_u32()),
        }

        // Databases no longer wanted (dropped, filtered out, made templates): stop their relays.
        let gone: Vec<pg_sys::Oid> =
            self.databases.keys().filter(|oid| !wanted.iter().any(|db| db.oid == **oid)).copied().collect();
        for oid in gone {
            if let Some(Database::Served(mut served)) = self.databases.remove(&oid) {
                let still_running = stop_all(&mut served);
                if still_running {
                    // Keep the entry until its relays are gone (a leftover of a previous launcher).
                    self.databases.insert(oid, Database::Served(served));
                } else {
                    shared::release_entry(served.entry);
                }
            }
        }

        let mut timeout = SCAN_INTERVAL;
        let mut left_out = Vec::new();
        for db in wanted {
            let oid = db.oid;
            let state = self
                .databases
                .entry(oid)
                .or_insert(Database::WithoutExtension { generation: generation.wrapping_sub(1), copy: false });
            if let Database::WithoutExtension { generation: seen, copy } = state {
                if *seen == generation {
                    continue;
                }
                // Look (again): start a probe.
                let Some(entry) = shared::entry_of(oid).or_else(|| shared::claim_entry(oid)) else {
                    left_out.push(db.name.clone());
                    continue;
                };
                let slots = (0..shared::MAX_RELAYS).map(|_| Slot::idle()).collect();
                let copy_reported = *copy;
                *state = Database::Served(Served {
                    entry,
                    name: db.name.clone(),
                    slots,
                    probed_at_generation: generation,
                    copy_reported,
                });
            }
            let Database::Served(served) = state else { continue };
            served.name.clone_from(&db.name);
            match served.supervise(oid) {
                Ok(wait) => timeout = timeout.min(wait),
                Err(probed_at) => {
                    // No outbox_pg there: free the entry until a rescan.
                    let copy = matches!(shared::extension_state(served.entry), ExtensionState::Copy);
                    shared::release_entry(served.entry);
                    *state = Database::WithoutExtension { generation: probed_at, copy };
                    timeout = Duration::ZERO;
                }
            }
        }
        // Left out for good only while every entry serves a database that has outbox_pg (an entry
        // held by a probe is free again soon): then outbox_enqueue refuses in those databases.
        let full = !left_out.is_empty() && shared::every_entry_serves();
        shared::set_full(full);
        // Decided once no probe holds an entry: a database with outbox_pg then has an entry or is
        // left out for good, and outbox_enqueue, which waits for this, answers accordingly.
        shared::set_decided(shared::no_entry_probing());
        if !full {
            left_out.clear();
            if !self.reported_left_out.is_empty() {
                timeout = timeout.min(RELAUNCH_DELAY);
            }
        }
        for name in left_out.iter().filter(|name| !self.reported_left_out.contains(name)) {
            warning!(
                "outbox_pg launcher: database \"{name}\" gets no relay: outbox_pg already relays {} databases, outbox.max_databases; outbox_enqueue refuses there",
                shared::database_entries()
            );
        }
        if !left_out.is_empty() {
            // Probes of databases without outbox_pg may free an entry: look again soon.
            timeout = timeout.min(NO_SLOT_RETRY);
        }
        self.reported_left_out = left_out;
        timeout
    }
}

impl Served {
    /// Starts and stops this database's relays. `Err` (with the generation its probe started at)
    /// when they found no outbox_pg and all exited.
    fn supervise(&mut self, oid: pg_sys::Oid) -> Result<Duration, u32> {
        let extension = shared::extension_state(self.entry);
        let wanted = match extension {
            ExtensionState::Present => guc::workers(),
            // One relay finds out whether the extension is there.
            ExtensionState::Unknown => 1,
            // An unadopted copy publishes nothing: it holds no relay and no entry.
            ExtensionState::Missing | ExtensionState::Copy => 0,
        };
        let mut timeout = SCAN_INTERVAL;
        let mut running = 0;
        for (index, slot) in self.slots.iter_mut().enumerate() {
            // Notice exits (the postmaster wakes us through bgw_notify_pid).
            if let Slot::Running(handle) = slot {
                match handle.pid() {
                    Ok(_) | Err(BackgroundWorkerStatus::NotYetStarted) => {}
                    // SAFETY: ends this process the way PostgreSQL expects.
                    Err(BackgroundWorkerStatus::PostmasterDied) => unsafe { pg_sys::proc_exit(1) },
                    Err(_) => *slot = Slot::Idle { not_before: Instant::now() + RELAUNCH_DELAY, failed_start: false },
                }
            }
            match slot {
                Slot::Running(_) if index >= wanted => {
                    // outbox.workers was lowered, or the extension is gone.
                    if let Slot::Running(handle) = std::mem::replace(slot, Slot::idle()) {
                        let _ = handle.terminate().wait_for_shutdown();
                    }
                }
                Slot::Running(_) => running += 1,
                Slot::Idle { not_before, failed_start } if index < wanted => {
                    let now = Instant::now();
                    if now < *not_before {
                        timeout = timeout.min(*not_before - now);
                        continue;
                    }
                    // A statement that needs the database without sessions (a copy, a rename)
                    // runs: its transaction's end wakes the launcher.
                    if shared::step_aside_pending(self.entry) {
                        timeout = timeout.min(RELAUNCH_DELAY);
                        continue;
                    }
                    // A relay left over from a previous launcher (which was terminated) still runs.
                    if shared::relay_pid_at(self.entry, index).is_some_and(process_alive) {
                        running += 1;
                        timeout = timeout.min(RELAUNCH_DELAY);
                        continue;
                    }
                    match start_relay(oid, &self.name, index, self.copy_reported) {
                        Some(handle) => {
                            if *failed_start {
                                log!("outbox_pg launcher: started relay {index} of database \"{}\"", self.name);
                            }
                            *slot = Slot::Running(handle);
                            running += 1;
                        }
                        None => {
                            let problem = no_slot_message(&self.name, index);
                            if !*failed_start {
                                warning!("outbox_pg launcher: {problem}");
                            }
                            shared::set_error_at(self.entry, &problem);
                            *slot = Slot::Idle { not_before: now + NO_SLOT_RETRY, failed_start: true };
                            timeout = timeout.min(NO_SLOT_RETRY);
                        }
                    }
                }
                Slot::Idle { .. } => {}
            }
        }
        if matches!(extension, ExtensionState::Missing | ExtensionState::Copy) && running == 0 {
            let leftovers =
                (0..shared::MAX_RELAYS).any(|slot| shared::relay_pid_at(self.entry, slot).is_some_and(process_alive));
            if !leftovers {
                return Err(self.probed_at_generation);
            }
            timeout = timeout.min(RELAUNCH_DELAY);
        }
        Ok(timeout)
    }
}

/// Terminates every relay of a database; true if relays of a previous launcher still run there.
fn stop_all(served: &mut Served) -> bool {
    for slot in served.slots.iter_mut() {
        if let Slot::Running(handle) = std::mem::replace(slot, Slot::idle()) {
            let _ = handle.terminate().wait_for_shutdown();
        }
    }
    (0..shared::MAX_RELAYS).any(|slot| shared::relay_pid_at(served.entry, slot).is_some_and(process_alive))
}

fn no_slot_message(database: &str, index: usize) -> String {
    // SAFETY: a PostgreSQL global, set at server start.
    let max = unsafe { pg_sys::max_worker_processes };
    format!(
        "could not start relay {index} of database \"{database}\": no free background worker slot (max_worker_processes = {max}); \
         outbox_pg needs 1 for its launcher plus outbox.workers ({}) per relayed database, beside other extensions' and parallel query's workers; retrying every {}s",
        guc::workers(),
        NO_SLOT_RETRY.as_secs()
    )
}

fn quoted_list(names: &[String]) -> String {
    names.iter().map(|name| format!("\"{name}\"")).collect::<Vec<_>>().join(", ")
}

/// Every database in the shared catalog pg_database. A heap scan, not the syscache: without a
/// database selected, opening pg_database's index fails on a freshly initdb'd cluster.
fn list_databases() -> Vec<Listed> {
    BackgroundWorker::transaction(|| {
        let mut listed = Vec::new();
        // SAFETY: inside a transaction; the relation is opened and closed here, and each tuple is
        // read only while the scan is open.
        unsafe {
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            let relation = pg_sys::table_open(pg_sys::DatabaseRelationId, lock);
            let scan = pg_sys::systable_beginscan(
                relation,
                pg_sys::Oid::from(pg_sys::DatabaseNameIndexId),
                false,
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            );
            loop {
                let tuple = pg_sys::systable_getnext(scan);
                if tuple.is_null() {
                    break;
                }
                let row = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
                let name = std::ffi::CStr::from_ptr(row.datname.data.as_ptr()).to_string_lossy().into_owned();
                // datconnlimit -2: a DROP DATABASE was interrupted half-way (PostgreSQL 15.4+).
                let relayable = row.datallowconn && !row.datistemplate && row.datconnlimit != -2;
                listed.push(Listed { oid: row.oid, name, relayable });
            }
            pg_sys::systable_endscan(scan);
            pg_sys::table_close(relation, lock);
        }
        listed
    })
}

/// Starts relay `slot` of a database; `copy_reported`: it was an unadopted copy at the last probe,
/// and was told so (the relay then says it again in a LOG line, not a WARNING: every rescan probes
/// each copy, and the WARNING filled logs with one line per copy per `CREATE DATABASE`).
fn start_relay(
    database_oid: pg_sys::Oid,
    database: &str,
    slot: usize,
    copy_reported: bool,
) -> Option<DynamicBackgroundWorker> {
    // SAFETY: MyProcPid is set for every backend.
    let launcher_pid = unsafe { pg_sys::MyProcPid };
    // bgw_name holds 96 bytes; pg_stat_activity shows it as backend_type's detail.
    let mut name = format!("outbox_pg relay {slot} for {database}");
    if name.len() > 90 {
        let mut cut = 90;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    BackgroundWorkerBuilder::new(&name)
        .set_type("outbox_pg relay")
        .set_library("outbox_pg")
        .set_function("outbox_pg_relay_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        // The launcher restarts it; the postmaster must not.
        .set_restart_time(None)
        .set_argument(Some(pg_sys::Datum::from(u32::from(database_oid))))
        .set_extra(&format!("{slot}{}", if copy_reported { " copy-reported" } else { "" }))
        .set_notify_pid(launcher_pid)
        .load_dynamic()
        .ok()
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_launcher(_code: i32, _arg: pg_sys::Datum) {
    shared::unregister_launcher();
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
