//! Reading outbox's tables without the executor, for the paths that skip it (the enqueue's direct
//! insert, the relays' reads of the log and the counters): relations and columns by name, and
//! values straight from their datums, in the text form the stream entries carry.

use std::ffi::CStr;

use pgrx::prelude::*;

/// A relation of schema `outbox` by name, for `reader` (named in the error when it is missing).
///
/// # Safety
/// Inside a transaction.
pub unsafe fn outbox_relation(name: &CStr, reader: &str) -> pg_sys::Oid {
    // SAFETY: a syscache lookup; missing_ok, so it returns InvalidOid rather than raising.
    let schema = unsafe { pg_sys::get_namespace_oid(c"outbox".as_ptr(), true) };
    // SAFETY: inside a transaction, as the caller guarantees.
    unsafe { relation_in(schema, name, reader) }
}

/// A relation of `schema` (the `outbox` schema's OID, or InvalidOid when it is missing) by name,
/// for `reader` (named in the error when it is missing).
///
/// # Safety
/// Inside a transaction.
pub unsafe fn relation_in(schema: pg_sys::Oid, name: &CStr, reader: &str) -> pg_sys::Oid {
    let oid = if schema == pg_sys::InvalidOid {
        pg_sys::InvalidOid
    } else {
        // SAFETY: a syscache lookup.
        unsafe { pg_sys::get_relname_relid(name.as_ptr(), schema) }
    };
    if oid == pg_sys::InvalidOid {
        error!("{reader}: relation outbox.{} does not exist; is outbox_pg installed?", name.to_string_lossy());
    }
    oid
}

/// A tuple descriptor's attributes, in column order.
///
/// # Safety
/// `descriptor` is a valid tuple descriptor that outlives `'a`.
pub unsafe fn attributes<'a>(descriptor: *const pg_sys::TupleDescData) -> &'a [pg_sys::FormData_pg_attribute] {
    // SAFETY: a valid descriptor holds `natts` attributes.
    unsafe {
        let natts = (*descriptor).natts as usize;
        // PostgreSQL 18 moved them behind the `compact_attrs` array (its TupleDescAttr); up to 17
        // they are the `attrs` array itself.
        #[cfg(feature = "pg18")]
        let first = (*descriptor).compact_attrs.as_ptr().add(natts).cast::<pg_sys::FormData_pg_attribute>();
        #[cfg(any(feature = "pg15", feature = "pg16", feature = "pg17"))]
        let first = (*descriptor).attrs.as_ptr();
        std::slice::from_raw_parts(first, natts)
    }
}

/// The attribute number (1-based) of an open relation's column, found by name: a column a DBA
/// added shifts nothing.
///
/// # Safety
/// `relation` is open.
pub unsafe fn column(relation: pg_sys::Relation, name: &str) -> usize {
    // SAFETY: an open relation; its descriptor lives as long as it is open.
    unsafe {
        attributes((*relation).rd_att)
            .iter()
            .position(|a| !a.attisdropped && CStr::from_ptr(a.attname.data.as_ptr()).to_bytes() == name.as_bytes())
            .map(|n| n + 1)
            .unwrap_or_else(|| {
                let table = CStr::from_ptr((*(*relation).rd_rel).relname.data.as_ptr()).to_string_lossy();
                error!("outbox_pg: table outbox.{table} has no column {name}")
            })
    }
}

/// A text datum's value (UTF-8: the extension lives only in UTF8 databases, src/sql/schema.sql).
///
/// # Safety
/// `datum` is a non-NULL text (or varchar) datum.
pub unsafe fn text(datum: pg_sys::Datum) -> String {
    // SAFETY: detoasted (a copy only if it was toasted) and copied out.
    unsafe {
        let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        let len = pgrx::varlena::varsize_any_exhdr(text);
        let bytes = std::slice::from_raw_parts(pgrx::varlena::vardata_any(text) as *const u8, len);
        owned_text(bytes)
    }
}

/// `bytes` as an owned UTF-8 string (invalid sequences replaced), copied into memory reserved
/// first: an allocation that fails raises an ERROR (the relay's round backs off) instead of
/// aborting the process, which would restart every backend of the cluster.
pub fn owned_text(bytes: &[u8]) -> String {
    let mut owned = String::new();
    if owned.try_reserve_exact(bytes.len()).is_err() {
        error!("outbox_pg: out of memory: could not allocate {} bytes for an event's text", bytes.len());
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => owned.push_str(text),
        Err(_) => owned.push_str(&String::from_utf8_lossy(bytes)),
    }
    owned
}

/// Calls `with` on a jsonb's text form (what is sent to Redis), freed afterwards.
///
/// # Safety
/// `datum` is a non-NULL jsonb datum.
pub unsafe fn with_jsonb_text<T>(datum: pg_sys::Datum, with: impl FnOnce(&CStr) -> T) -> T {
    // SAFETY: detoasting gives the whole value, whose root container JsonbToCString renders into
    // a palloc'd, NUL-terminated string, freed once `with` is done.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        let size = pgrx::varlena::varsize_any(jsonb as *const pg_sys::varlena) as i32;
        let text = pg_sys::JsonbToCString(std::ptr::null_mut(), &raw mut (*jsonb).root, size);
        let result = with(CStr::from_ptr(text));
        pg_sys::pfree(text.cast());
        result
    }
}

/// A jsonb's text form, as `jsonb::text` gives it.
///
/// # Safety
/// `datum` is a non-NULL jsonb datum.
pub unsafe fn jsonb_text(datum: pg_sys::Datum) -> String {
    // SAFETY: as in with_jsonb_text.
    unsafe { with_jsonb_text(datum, |text| owned_text(text.to_bytes())) }
}

/// A uuid's text form, as `uuid::text` gives it (lower-case, hyphenated).
///
/// # Safety
/// `datum` is a non-NULL uuid datum (a pointer to its 16 bytes).
pub unsafe fn uuid_text(datum: pg_sys::Datum) -> String {
    // SAFETY: a uuid datum points at 16 bytes.
    let bytes = unsafe { *(datum.cast_mut_ptr::<[u8; 16]>()) };
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    uuid::Uuid::from_bytes(bytes).hyphenated().encode_lower(&mut text).to_owned()
}

pub use outbox_round::time::timestamptz_text;
