//! Arrays in shared memory whose length is chosen at server start: one element per database the
//! relays may serve (`outbox.max_databases`). pgrx's `PgAtomic` and `PgLwLock` hold a value of one
//! fixed type, so an array of them is sized when the library is compiled; these are sized from
//! the setting, so that a server pays for the databases it is configured for (README, "Databases
//! and Redis topologies", gives the bytes per database).
//!
//! The postmaster reserves the space (`request`, from its `shmem_request_hook`) and creates each
//! array zeroed (`attach`, from its `shmem_startup_hook`, again after a crash restart re-creates
//! shared memory); every process it forks inherits where the arrays are.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use pgrx::pg_sys;

/// A type whose all-zero bytes are a valid value, so that an array of it can start zeroed in
/// shared memory (atomics, integers, byte arrays).
///
/// # Safety
/// All-zero bytes must be a valid value of the type, and the type must be valid in memory shared
/// by processes (no pointers into one process's memory, no destructor that must run).
pub unsafe trait Zeroed {}

/// An array of `T` in shared memory, named for `pg_shmem_allocations`.
pub struct SharedArray<T> {
    name: &'static CStr,
    elements: AtomicPtr<T>,
    len: AtomicUsize,
}

impl<T: Zeroed> SharedArray<T> {
    /// An array to be created at server start; empty until then (and in a process that did not
    /// preload the library).
    ///
    /// # Safety
    /// `name` must be unique among the server's shared memory allocations.
    pub const unsafe fn new(name: &'static CStr) -> Self {
        SharedArray { name, elements: AtomicPtr::new(std::ptr::null_mut()), len: AtomicUsize::new(0) }
    }

    /// The bytes `len` elements take.
    pub const fn bytes(len: usize) -> usize {
        size_of::<T>() * len
    }

    /// Reserves room for `len` elements.
    ///
    /// # Safety
    /// Called from the `shmem_request_hook`.
    pub unsafe fn request(&self, len: usize) {
        // SAFETY: per the contract above, when PostgreSQL takes requests.
        unsafe { pg_sys::RequestAddinShmemSpace(Self::bytes(len)) };
    }

    /// Finds the array in shared memory, creating it zeroed the first time, with `len` elements
    /// (the length `request` reserved).
    ///
    /// # Safety
    /// Called from the `shmem_startup_hook`, holding `AddinShmemInitLock`.
    pub unsafe fn attach(&self, len: usize) {
        let mut found = false;
        // SAFETY: per the contract above; ShmemInitStruct returns memory of the size asked for
        // (MAXALIGNed, enough for T's alignment, checked below), which is zeroed here before anyone
        // reads it, and which all-zero bytes make valid (`Zeroed`).
        unsafe {
            let elements = pg_sys::ShmemInitStruct(self.name.as_ptr(), Self::bytes(len), &mut found).cast::<T>();
            assert!(elements.is_aligned(), "shared memory for {:?} is not aligned", self.name);
            if !found {
                std::ptr::write_bytes(elements, 0, len);
            }
            self.len.store(len, Ordering::Release);
            self.elements.store(elements, Ordering::Release);
        }
    }

    /// The array (empty before `attach`).
    pub fn get(&self) -> &'static [T] {
        let elements = self.elements.load(Ordering::Acquire);
        if elements.is_null() {
            return &[];
        }
        // SAFETY: `attach` stored a pointer to `len` zero-initialised elements in shared memory,
        // which lives as long as the process (a crash restart re-creates it only after every
        // process that used the old one has exited).
        unsafe { std::slice::from_raw_parts(elements, self.len.load(Ordering::Acquire)) }
    }
}

// SAFETY: the array is shared between processes, and `T: Zeroed` is valid in shared memory; a
// `T` accessed from several processes synchronises itself (atomics, or a lock its users take).
unsafe impl<T: Zeroed> Sync for SharedArray<T> {}

/// PostgreSQL's `AddinShmemInitLock` (storage/lwlocklist.h: lock 21 of the main array), which
/// serialises the creation of add-ins' shared memory; pgrx's `PgAtomic` takes the same.
///
/// # Safety
/// Shared memory's main LWLock array exists (it does in a `shmem_startup_hook`).
pub unsafe fn addin_shmem_init_lock() -> *mut pg_sys::LWLock {
    // SAFETY: per the contract above.
    unsafe { &raw mut (*pg_sys::MainLWLockArray.add(21)).lock }
}
