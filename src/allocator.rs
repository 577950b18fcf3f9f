//! The library's Rust heap: the system allocator, but an allocation it cannot satisfy ends the
//! process with `FATAL` (`proc_exit(1)`, what PostgreSQL's own `ereport(FATAL)` does) instead of
//! Rust's default, `abort()`.
//!
//! The difference is the whole cluster. The postmaster takes a child that died of a signal (an
//! abort is `SIGABRT`) for one that may have corrupted shared memory: it stops every backend and
//! reinitialises (`HandleChildCrash`), and a relay that runs out again after the restart makes
//! that a loop. A child that exits with code 1 after `proc_exit` ran its callbacks (transaction
//! aborted, locks and its `PGPROC` released) is an ordinary end: a relay is started again after
//! its restart time, a backend's session ends with the error, and nothing else is touched
//! (`CleanupBackgroundWorker`, `CleanupBackend` in postmaster.c).
//!
//! What is safe here: the allocator must neither unwind nor return to its caller, so it calls
//! `errstart`/`errfinish` at `FATAL` (they format into `ErrorContext`, whose memory PostgreSQL
//! keeps for exactly this, and never return). Off the process's main thread, or when an
//! allocation fails again while exiting, it aborts as Rust would.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

use std::ffi::{c_char, c_int};

use pgrx::pg_sys;

// PostgreSQL's ereport() functions, which pgrx's bindings leave out (its own ereport allocates and
// unwinds, neither of which an allocator may do).
unsafe extern "C" {
    fn errstart(elevel: c_int, domain: *const c_char) -> bool;
    fn errcode(sqlerrcode: c_int) -> c_int;
    fn errmsg_internal(fmt: *const c_char, ...) -> c_int;
    fn errfinish(filename: *const c_char, lineno: c_int, funcname: *const c_char);
}

/// The system allocator, with the exit above on failure.
pub struct ExitOnFailure;

/// Set once an allocation failed: a second failure (in the exit itself) aborts.
static EXITING: AtomicBool = AtomicBool::new(false);

// SAFETY: every method forwards to `System` with the same arguments and returns what it returned
// when not null; on null, `failed` never returns.
unsafe impl GlobalAlloc for ExitOnFailure {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let ptr = unsafe { System.alloc(layout) };
        if ptr.is_null() {
            failed(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if ptr.is_null() {
            failed(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if new.is_null() {
            failed(new_size);
        }
        new
    }
}

/// Ends the process: `FATAL` (exit code 1) on PostgreSQL's thread, `abort()` otherwise.
// The abort after proc_exit is unreachable where pgrx declares proc_exit `-> !` (15-17) and needed
// where it does not (18's bindings).
#[cold]
#[allow(unreachable_code)]
fn failed(size: usize) -> ! {
    // SAFETY: getpid and gettid only read the process's and thread's ids.
    let main_thread = unsafe { libc::getpid() == libc::gettid() };
    if !main_thread || EXITING.swap(true, Ordering::SeqCst) {
        std::process::abort();
    }
    // Formatted without the heap: the message is built on the stack.
    let mut message = [0u8; 160];
    let text = b"outbox_pg: out of memory: an allocation of ";
    let (digits, digits_len) = decimal(size);
    let mut len = 0;
    for part in [&text[..], &digits[..digits_len], b" bytes failed in the library's Rust heap\0"] {
        message[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    }
    // SAFETY: errstart/errcode/errmsg_internal/errfinish are PostgreSQL's ereport(FATAL), on its
    // main thread; the format is "%s" and the argument a NUL-terminated buffer that outlives the
    // call. At FATAL errfinish calls proc_exit(1) and never returns.
    unsafe {
        if errstart(pg_sys::FATAL as c_int, std::ptr::null()) {
            errcode(pgrx::PgSqlErrorCode::ERRCODE_OUT_OF_MEMORY as c_int);
            errmsg_internal(c"%s".as_ptr(), message.as_ptr() as *const c_char);
            errfinish(c"src/allocator.rs".as_ptr(), line!() as c_int, c"failed".as_ptr());
        }
        pg_sys::proc_exit(1);
    }
    std::process::abort()
}

/// `n` in decimal, in a buffer, and its length.
fn decimal(mut n: usize) -> ([u8; 20], usize) {
    let mut digits = [0u8; 20];
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    digits[..len].reverse();
    (digits, len)
}
