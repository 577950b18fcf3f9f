//! outbox_pg: the transactional outbox inside PostgreSQL.
//!
//! `outbox_enqueue()` writes an event in the caller's transaction; a background worker publishes
//! committed events to Redis Streams. Module map:
//! - `guc`: every `outbox.*` setting.
//! - `enqueue`: `outbox_enqueue`, the function on the application's path.
//! - `api`: the other SQL-callable Rust functions (the SQL API itself is in `src/sql/*.sql`).
//! - `shmem`, `wake`: what backends share with the relay, and waking it at commit.
//! - `batch`: the batch rule: a shard's window of the log, read from its index (relays, and
//!   `outbox._read_shard`).
//! - `counters`: the per-aggregate `aggregate_seq` counters, read from their primary key.
//! - `datums`: relations, columns and values read without the executor.
//! - `order`: the shard of an aggregate, and the order lock that makes id order commit order.
//! - `claims`: what each relay has in flight (shared memory), for the stats.
//! - `streams`: `outbox.allowed_streams`, the Redis keys events may be written to.
//! - `object_access`: created extensions and databases wake the launcher; relays step aside when
//!   their database is dropped.
//! - `logredact`: Redis credentials masked in every server log line.
//! - `worker`: the launcher and relay background workers.
//! - `sink`: the only code that speaks to Redis; `entry`: a row as a stream entry.
#![forbid(unsafe_op_in_unsafe_fn)]

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::prelude::*;

mod api;
mod batch;
mod claims;
mod counters;
mod datums;
mod enqueue;
mod entry;
mod guc;
mod logredact;
mod object_access;
mod order;
mod shmem;
mod sink;
mod streams;
mod wake;
mod worker;

pub use entry::{render_stream_template, OutboxEvent};

// PostgreSQL 15 is supported; 16 and 17 are tried by the GitHub workflow. pgrx declares every
// version's feature, but 13 and 14 are not built or tested: refuse them rather than ship an
// untested library (README, "Installing").
#[cfg(any(feature = "pg13", feature = "pg14"))]
compile_error!("outbox_pg supports PostgreSQL 15 (16 and 17 experimental); PostgreSQL 13 and 14 are not supported");

::pgrx::pg_module_magic!();

extension_sql_file!("sql/schema.sql", name = "schema", bootstrap);
// The install script: the schema first; then the public API and the relay's statements (PL/pgSQL,
// which may name the Rust helpers before they exist); operations last, since the stats view and the
// privileges of the Rust helpers need those helpers created.
extension_sql_file!("sql/api.sql", name = "api", requires = ["schema"]);
extension_sql_file!("sql/relay.sql", name = "relay", requires = ["schema"]);
// After the shards and generations rows exist: its triggers catch a restore's dumped rows.
extension_sql_file!("sql/restore.sql", name = "restore", requires = ["schema"]);
extension_sql_file!("sql/operations.sql", name = "operations", finalize);

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
    // SAFETY: as above.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    guc::init(preloading);
    if !preloading {
        // Loaded on demand by a backend: the SQL functions that need the relay say so.
        return;
    }
    logredact::init();
    shmem::init();
    claims::init();
    wake::init();
    object_access::init();
    worker::launcher::register();
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
