//! Short transactions for the worker that turn a PostgreSQL error into a value: the transaction
//! is aborted and the worker carries on (backing off) instead of exiting and being restarted.

use std::panic::UnwindSafe;

use pgrx::pg_sys;
use pgrx::pg_sys::panic::CaughtError;
use pgrx::PgTryBuilder;

/// Runs `body` in its own transaction and commits it. On any error (raised by `body` or by the
/// commit) the transaction is rolled back and the error's message returned.
pub fn run<R>(body: impl FnOnce() -> R + UnwindSafe) -> Result<R, String> {
    // SAFETY: called from the worker's main loop, outside any transaction.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let result = PgTryBuilder::new(move || {
        let value = body();
        // SAFETY: balanced with the push above; the commit may raise, which is caught below.
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(value)
    })
    .catch_others(|caught| Err(message_of(&caught)))
    .execute();
    if result.is_err() {
        // SAFETY: the error was caught and its state flushed; aborting cleans up snapshots, SPI,
        // locks and memory of the failed transaction.
        unsafe { pg_sys::AbortCurrentTransaction() };
    }
    result
}

fn message_of(caught: &CaughtError) -> String {
    match caught {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => report.message().to_string(),
        CaughtError::RustPanic { ereport, .. } => ereport.message().to_string(),
    }
}
