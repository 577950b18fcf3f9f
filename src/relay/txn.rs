//! Short transactions for the worker that turn a PostgreSQL error into a value: the transaction
//! is aborted and the worker carries on (backing off) instead of exiting and being restarted.

use std::panic::UnwindSafe;

use outbox_round::db::DbError;
use pgrx::pg_sys;
use pgrx::pg_sys::panic::{CaughtError, ErrorReportWithLevel};
use pgrx::PgTryBuilder;

/// Runs `body` in its own transaction and commits it when it returns `Ok`. When it returns `Err`,
/// or raises an error (itself or at commit), the transaction is rolled back and the error's
/// message returned, so a failed step never leaves half its work committed.
pub fn run<R, E: std::fmt::Display>(body: impl FnOnce() -> Result<R, E> + UnwindSafe) -> Result<R, String> {
    attempt(move || body().map_err(|error| DbError::new(error.to_string()))).map_err(|error| error.message)
}

/// `run`, keeping the SQLSTATE of an error the server raised (src/relay/spi.rs).
pub fn attempt<R>(body: impl FnOnce() -> Result<R, DbError> + UnwindSafe) -> Result<R, DbError> {
    // SAFETY: called from the worker's main loop, outside any transaction.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let result = PgTryBuilder::new(move || {
        let value = body()?;
        // SAFETY: balanced with the push above; the commit may raise, which is caught below.
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(value)
    })
    .catch_others(|caught| Err(error_of(&caught)))
    .execute();
    if result.is_err() {
        // SAFETY: any raised error was caught and its state flushed; aborting cleans up snapshots,
        // SPI, locks and memory of the failed transaction.
        unsafe { pg_sys::AbortCurrentTransaction() };
    }
    result
}

fn error_of(caught: &CaughtError) -> DbError {
    let report = match caught {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => report,
        CaughtError::RustPanic { ereport, .. } => ereport,
    };
    DbError { message: report.message().to_string(), sqlstate: Some(sqlstate(report)) }
}

/// The five characters of the error's SQLSTATE (PostgreSQL packs them six bits each, first lowest:
/// utils/elog.h, MAKE_SQLSTATE).
fn sqlstate(report: &ErrorReportWithLevel) -> String {
    let code = report.sql_error_code() as isize;
    (0..5).map(|i| char::from(((code >> (6 * i)) & 0x3F) as u8 + b'0')).collect()
}
