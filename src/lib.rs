//! outbox_pg: the transactional outbox inside PostgreSQL.
//!
//! An event's way, and the folders it passes through:
//! - `enqueue`: `outbox_enqueue` in the application's transaction: argument checks, the
//!   aggregate's order lock, the allowed streams, one row in the log, the wake-up at commit.
//! - `log`: the log's tables and the batch rule: which events a round reads, in which order,
//!   what is undelivered, the `aggregate_seq` counters.
//! - `relay`: the background workers: the launcher, each relay's loop, one round (claim, read,
//!   publish, finish), housekeeping.
//! - `outbox_sink` (the crate in `sink/`, without pgrx): the only code that speaks to Redis
//!   (topologies, the MULTI/EXEC exchange) and how an event becomes a stream entry.
//!
//! And around them: `guc` (every `outbox.*` setting), `shared` (what backends and relays share in
//! shared memory), `hooks` (catalog and utility hooks, the log redaction), `api` (the SQL-callable
//! Rust functions; the SQL API itself is in `src/sql/*.sql`).
#![forbid(unsafe_op_in_unsafe_fn)]

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::prelude::*;

#[cfg(not(test))]
mod allocator;
mod api;
mod enqueue;
#[cfg(feature = "fault-injection")]
mod faults;
mod guc;
mod hooks;
mod log;
mod relay;
mod shared;

// PostgreSQL 15, 16, 17 and 18 are built and tested (README, "Installing"). pgrx declares every
// version's feature, but 13 and 14 (end of life) are never built or tested: refuse them rather
// than ship an untested library.
#[cfg(any(feature = "pg13", feature = "pg14"))]
compile_error!("outbox_pg supports PostgreSQL 15, 16, 17 and 18; PostgreSQL 13 and 14 are not supported");

::pgrx::pg_module_magic!();

/// Rust's allocations fail with FATAL (exit code 1), not an abort that restarts the cluster
/// (src/allocator.rs).
#[cfg(not(test))]
#[global_allocator]
static ALLOCATOR: allocator::ExitOnFailure = allocator::ExitOnFailure;

// The install script, one file per concern, listed in the order an event goes. The data first
// (bootstrap); every other file needs only the tables, since its PL/pgSQL is checked when it runs
// and its SQL functions and views name only tables and what the same file made before; health
// after the Rust function its stats view reads; last, the Rust functions' comments and privileges.
extension_sql_file!("sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("sql/enqueue.sql", name = "enqueue", requires = ["schema"]);
extension_sql_file!("sql/trace.sql", name = "trace", requires = ["schema"]);
extension_sql_file!("sql/relay/claim.sql", name = "relay_claim", requires = ["schema"]);
extension_sql_file!("sql/relay/read.sql", name = "relay_read", requires = ["schema"]);
extension_sql_file!("sql/relay/outside.sql", name = "relay_outside", requires = ["schema"]);
extension_sql_file!("sql/relay/failure_path.sql", name = "relay_failure_path", requires = ["schema"]);
extension_sql_file!("sql/relay/finish.sql", name = "relay_finish", requires = ["schema"]);
extension_sql_file!("sql/relay/housekeeping.sql", name = "relay_housekeeping", requires = ["schema"]);
// After the shards and generations rows exist: its triggers catch a restore's dumped rows.
extension_sql_file!("sql/restore.sql", name = "restore", requires = ["schema"]);
extension_sql_file!("sql/dedup.sql", name = "dedup", requires = ["schema"]);
extension_sql_file!("sql/copies.sql", name = "copies", requires = ["schema"]);
extension_sql_file!("sql/operations.sql", name = "operations", requires = ["schema"]);
extension_sql_file!("sql/journal.sql", name = "journal", requires = ["schema"]);
extension_sql_file!("sql/replay.sql", name = "replay", requires = ["journal"]);
extension_sql_file!("sql/losses.sql", name = "losses", requires = ["replay"]);
extension_sql_file!("sql/health.sql", name = "health", requires = ["losses", api::outbox::relay_status]);
extension_sql_file!("sql/api.sql", name = "api", finalize);
// Functions only tests call, in schema tests: in the test build alone, never in a production install.
#[cfg(any(test, feature = "pg_test"))]
extension_sql_file!("sql/test_helpers.sql", name = "test_helpers");

/// Whether the library was loaded through `shared_preload_libraries` (inherited by every backend).
static PRELOADED: AtomicBool = AtomicBool::new(false);

/// True when the relay machinery (shared memory, workers, commit wake-up) is set up.
pub fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // pg_upgrade loads libraries to check them; nothing may run then.
    // SAFETY: reading a PostgreSQL global set before libraries are loaded.
    if unsafe { pg_sys::IsBinaryUpgrade } {
        return;
    }
    // An error PostgreSQL raises inside a call from Rust (a lock timeout, a cancel) comes back to
    // the client as it was raised; with a Rust backtrace captured (RUST_BACKTRACE set in the
    // server's environment) pgrx would add it to the error's DETAIL, showing the client the
    // extension's internals. Only an explicit RUST_LIB_BACKTRACE asks for them.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    // SAFETY: as above.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    guc::init(preloading);
    if !preloading {
        // Loaded on demand by a backend: the SQL functions that need the relay say so.
        return;
    }
    hooks::logredact::init();
    shared::init();
    #[cfg(feature = "fault-injection")]
    faults::init_shared_memory();
    enqueue::wake::init();
    enqueue::order::init();
    hooks::object_access::init();
    relay::launcher::register();
    PRELOADED.store(true, Ordering::Relaxed);
}

/// `#[pg_test]`s of the SQL API: they run inside a transaction that is rolled back.
#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    include!("tests/sql_api.rs");
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    /// The test instance preloads the extension so the worker machinery exists; its relay watches
    /// the test database and points at a closed port, since `#[pg_test]`s roll back and never
    /// reach Redis. Tests that cross a commit use their own clusters (see `tests/`).
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'outbox_pg'",
            "outbox.databases = 'pgrx_tests'",
            "outbox.redis_url = 'redis://127.0.0.1:1'",
        ]
    }
}
