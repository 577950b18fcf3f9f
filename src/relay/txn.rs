//! Short transactions for the worker that turn a PostgreSQL error into a value: the transaction
//! is aborted and the worker carries on (backing off) instead of exiting and being restarted.

use std::panic::UnwindSafe;

use pgrx::pg_sys;
use pgrx::pg_sys::panic::CaughtError;
use pgrx::PgTryBuilder;

/// Runs `body` in its own transaction and commits it when it returns `Ok`. When it returns `Err`,
/// or raises an error (itself or at commit), the transaction is rolled back and the error's
/// message returned, so a failed step never leaves half its work committed.
pub fn run<R, E: std::fmt::Display>(body: impl FnOnce() -> Result<R, E> + UnwindSafe) -> Result<R, String> {
    // SAFETY: called from the worker's main loop, outside any transaction.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let result = PgTryBuilder::new(move || {
        let value = body().map_err(|error| error.to_string())?;
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
        // SAFETY: any raised error was caught and its state flushed; aborting cleans up snapshots,
        // SPI, locks and memory of the failed transaction.
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
