//! A jsonb value's text form, written straight from its binary layout: byte for byte what
//! `jsonb::text` (`JsonbToCString`) gives, without PostgreSQL's iterator. Every payload and
//! header of every event is rendered once on its way to Redis, and `JsonbToCString` was a tenth
//! of the relay's CPU in a drain's profile (docs/performance.md): it walks the value through
//! `JsonbIteratorNext` (a palloc'd frame per container, a `JsonbValue` filled per child) into a
//! growing `StringInfo`, and the text was then copied again into the event.
//!
//! The layout (`utils/jsonb.h`, the same in PostgreSQL 15 to 18): a container is a header word
//! (the child count, and whether it is an object, an array or a raw scalar: a one-element array
//! printed without brackets), then a `JEntry` per child (an object's keys first, then its values)
//! and the children's data. A `JEntry` holds the child's type and either its length or, every
//! `JB_OFFSET_STRIDE`th child, the offset of its end; numerics and nested containers start at the
//! next 4-byte boundary. Numbers are printed by `numeric_out`, as `jsonb::text` does; strings are
//! escaped as `escape_json` does. The pg_test `jsonb_text_is_what_jsonb_text_gives` compares the
//! two on every kind of value, nesting, size and escape.

use pgrx::prelude::*;

const JENTRY_OFFLENMASK: u32 = 0x0FFF_FFFF;
const JENTRY_TYPEMASK: u32 = 0x7000_0000;
const JENTRY_HAS_OFF: u32 = 0x8000_0000;
const JENTRY_ISSTRING: u32 = 0x0000_0000;
const JENTRY_ISNUMERIC: u32 = 0x1000_0000;
const JENTRY_ISBOOL_FALSE: u32 = 0x2000_0000;
const JENTRY_ISBOOL_TRUE: u32 = 0x3000_0000;
const JENTRY_ISNULL: u32 = 0x4000_0000;
const JENTRY_ISCONTAINER: u32 = 0x5000_0000;

const JB_CMASK: u32 = 0x0FFF_FFFF;
const JB_FSCALAR: u32 = 0x1000_0000;
const JB_FOBJECT: u32 = 0x2000_0000;

/// A jsonb datum's text form, as `jsonb::text` gives it.
///
/// # Safety
/// `datum` is a non-NULL jsonb datum, inside a transaction (numbers go through `numeric_out`).
pub unsafe fn text(datum: pg_sys::Datum) -> String {
    // SAFETY: detoasted, the value is one contiguous varlena whose data is the root container;
    // it is freed below only if detoasting made a copy.
    unsafe {
        let detoasted = pg_sys::pg_detoast_datum(datum.cast_mut_ptr());
        let size = pgrx::varlena::varsize_any_exhdr(detoasted);
        let root = pgrx::varlena::vardata_any(detoasted) as *const u8;
        // The text is about as long as the binary form (more with escapes and nesting).
        let mut out = Text::with_capacity(size + size / 8 + 16);
        container(root, &mut out);
        if detoasted.cast() != datum.cast_mut_ptr::<pg_sys::varlena>() {
            pg_sys::pfree(detoasted.cast());
        }
        out.into_string()
    }
}

/// The text being written. An allocation that fails raises an ERROR (the relay's round backs
/// off) instead of aborting the process, which would restart every backend of the cluster.
struct Text(Vec<u8>);

impl Text {
    fn with_capacity(capacity: usize) -> Text {
        let mut text = Text(Vec::new());
        text.reserve(capacity);
        text
    }

    fn reserve(&mut self, additional: usize) {
        if self.0.try_reserve(additional).is_err() {
            error!("outbox_pg: out of memory: could not allocate {additional} more bytes for a payload's text");
        }
    }

    fn put(&mut self, bytes: &[u8]) {
        if self.0.capacity() - self.0.len() < bytes.len() {
            self.reserve(bytes.len());
        }
        self.0.extend_from_slice(bytes);
    }

    fn into_string(self) -> String {
        // jsonb's strings are valid UTF-8 in a UTF8 database (the only kind outbox_pg installs
        // into), and everything else written is ASCII.
        match String::from_utf8(self.0) {
            Ok(text) => text,
            Err(invalid) => String::from_utf8_lossy(invalid.as_bytes()).into_owned(),
        }
    }
}

/// Reads the 4-byte word at `at` (4-byte aligned inside a detoasted jsonb).
unsafe fn word(at: *const u8) -> u32 {
    // SAFETY: the caller points inside the value; read_unaligned needs no alignment anyway.
    unsafe { at.cast::<u32>().read_unaligned() }
}

/// Writes the container at `at`.
unsafe fn container(at: *const u8, out: &mut Text) {
    // SAFETY: `at` is a container of a detoasted jsonb: a header word, its JEntries, their data.
    unsafe {
        let header = word(at);
        let count = (header & JB_CMASK) as usize;
        let entries = at.add(4);
        let children = if header & JB_FOBJECT != 0 { count * 2 } else { count };
        let data = entries.add(children * 4);
        let mut children = Children { entries, index: 0, offset: 0 };
        if header & JB_FSCALAR != 0 {
            let (entry, start, len) = children.next();
            value(entry, data, start, len, out);
        } else if header & JB_FOBJECT != 0 {
            // Keys are the first `count` children, values the next `count`: a value's place is
            // found by walking its own run of entries alongside the keys'.
            let mut values = Children { entries, index: 0, offset: 0 };
            for _ in 0..count {
                values.next();
            }
            out.put(b"{");
            for i in 0..count {
                if i > 0 {
                    out.put(b", ");
                }
                let (_, start, len) = children.next();
                string(std::slice::from_raw_parts(data.add(start), len), out);
                out.put(b": ");
                let (entry, start, len) = values.next();
                value(entry, data, start, len, out);
            }
            out.put(b"}");
        } else {
            out.put(b"[");
            for i in 0..count {
                if i > 0 {
                    out.put(b", ");
                }
                let (entry, start, len) = children.next();
                value(entry, data, start, len, out);
            }
            out.put(b"]");
        }
    }
}

/// A container's children in order, each with where its data starts and how long it is.
struct Children {
    entries: *const u8,
    index: usize,
    /// Where the next child's data starts, from `data`.
    offset: usize,
}

impl Children {
    /// The next child: its JEntry, and its data's start (from `data`) and length.
    unsafe fn next(&mut self) -> (u32, usize, usize) {
        // SAFETY: called at most once per child of the container.
        let entry = unsafe { word(self.entries.add(self.index * 4)) };
        let field = (entry & JENTRY_OFFLENMASK) as usize;
        let start = self.offset;
        // Every JB_OFFSET_STRIDE'th entry holds the end offset, the others the length.
        let end = if entry & JENTRY_HAS_OFF != 0 { field } else { start + field };
        self.index += 1;
        self.offset = end;
        (entry, start, end - start)
    }
}

/// Writes the child whose JEntry is `entry` and whose data is `len` bytes at `data + start`.
unsafe fn value(entry: u32, data: *const u8, start: usize, len: usize, out: &mut Text) {
    // SAFETY: `start` and `len` come from the container's own JEntries.
    unsafe {
        match entry & JENTRY_TYPEMASK {
            JENTRY_ISSTRING => string(std::slice::from_raw_parts(data.add(start), len), out),
            JENTRY_ISNUMERIC => {
                // Numerics are stored from the next 4-byte boundary, as a whole varlena.
                let numeric = data.add(int_align(start));
                let text =
                    pgrx::direct_function_call_as_datum(pg_sys::numeric_out, &[Some(pg_sys::Datum::from(numeric))])
                        .unwrap_or_else(|| error!("outbox_pg: numeric_out returned NULL"))
                        .cast_mut_ptr::<std::ffi::c_char>();
                out.put(std::ffi::CStr::from_ptr(text).to_bytes());
                pg_sys::pfree(text.cast());
            }
            JENTRY_ISBOOL_FALSE => out.put(b"false"),
            JENTRY_ISBOOL_TRUE => out.put(b"true"),
            JENTRY_ISNULL => out.put(b"null"),
            JENTRY_ISCONTAINER => container(data.add(int_align(start)), out),
            other => error!("outbox_pg: a jsonb value holds an entry of unknown type {other:#x}"),
        }
    }
}

/// `INTALIGN`: the next multiple of 4.
fn int_align(offset: usize) -> usize {
    (offset + 3) & !3
}

/// Writes `bytes` as a JSON string, escaped as PostgreSQL's `escape_json` does.
fn string(bytes: &[u8], out: &mut Text) {
    out.reserve(bytes.len() + 2);
    out.put(b"\"");
    let mut plain = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let escaped: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0C => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1F => {
                out.put(&bytes[plain..i]);
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.put(&[b'\\', b'u', b'0', b'0', HEX[(byte >> 4) as usize], HEX[(byte & 0xF) as usize]]);
                plain = i + 1;
                continue;
            }
            _ => continue,
        };
        out.put(&bytes[plain..i]);
        out.put(escaped);
        plain = i + 1;
    }
    out.put(&bytes[plain..]);
    out.put(b"\"");
}

/// In schema `tests`, where pgrx's test runner calls `#[pg_test]`s.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// `text` of a jsonb value, for the test below (test build only).
    #[pg_extern]
    fn jsonb_text_of(value: pgrx::AnyElement) -> String {
        if value.oid() != pg_sys::JSONBOID {
            error!("jsonb_text_of: a jsonb value is expected, not type {}", value.oid().to_u32());
        }
        // SAFETY: a non-NULL jsonb datum (a NULL argument does not reach a strict function).
        unsafe { super::text(value.datum()) }
    }

    /// Values of every kind, nesting and escape, and sizes past `JB_OFFSET_STRIDE` (where entries
    /// switch from lengths to offsets), each written by `text` and by `jsonb::text`.
    #[pg_test]
    fn jsonb_text_is_what_jsonb_text_gives() {
        let values = r#"
            WITH scalars(v) AS (VALUES
                ('null'::jsonb), ('true'), ('false'), ('0'), ('-0'), ('1.50'), ('-12.000'), ('1e3'),
                ('1E-7'), ('123456789012345678901234567890.123456789'), ('0.000000000000000000001'),
                ('""'), ('"plain"'), ('"quote \" backslash \\ slash \/"'),
                ('"\b\f\n\r\t \u0001 \u001f \u007f"'), ('"é € 😀 \u00e9 \ud83d\ude00"'),
                ('[]'), ('{}'), ('[[]]'), ('{"": {}}'), ('[null, [true, [false, [1, [""]]]]]')
            ), sized(v) AS (
                SELECT jsonb_agg(n) FROM generate_series(1, 100) n
                UNION ALL SELECT jsonb_object_agg('k' || n, n * 1.5) FROM generate_series(1, 100) n
                UNION ALL SELECT jsonb_object_agg(repeat('x', n), repeat('y', 200 - n)) FROM generate_series(1, 70) n
                UNION ALL SELECT jsonb_agg(jsonb_build_object('a', n, 'b', array[n, n + 1], 'c', 'text ' || n, 'd', n % 2 = 0))
                    FROM generate_series(1, 40) n
                UNION ALL SELECT jsonb_build_object('long', repeat('é"\', 100000), 'n', 1.0)
                UNION ALL SELECT jsonb_build_object('amount', 1999, 'currency', 'EUR', 'customer', 'c-17',
                                                    'items', jsonb_build_array(1, 2.5, 'x', null, true))
            ), all_values(v) AS (
                SELECT v FROM scalars
                UNION ALL SELECT v FROM sized
                UNION ALL SELECT jsonb_build_array(v, v) FROM scalars
                UNION ALL SELECT jsonb_build_object('k', v, 'a', v, 'zzz', v) FROM scalars
                UNION ALL SELECT jsonb_agg(v) FROM scalars
                UNION ALL SELECT jsonb_object_agg(v::text, v) FROM scalars
                -- Strings of random characters (control characters, quotes and backslashes among
                -- them), random numbers of random scales, random widths and depths; a value that
                -- differs is printed.
                UNION ALL SELECT jsonb_build_object(
                        'text', (SELECT string_agg(chr(1 + (random() * 1200)::int), '') FROM generate_series(0, n % 60)),
                        'amount', round((random() * 10 ^ (n % 12) - 5)::numeric, n % 7),
                        'list', (SELECT jsonb_agg(CASE WHEN i % 3 = 0 THEN to_jsonb(i * -0.5) WHEN i % 3 = 1
                                                  THEN to_jsonb(md5(i::text)) ELSE jsonb_build_array(i, jsonb_build_object('i', i)) END)
                                   FROM generate_series(1, n % 45) i),
                        repeat('k', n % 40), n % 2 = 0)
                    FROM generate_series(1, 300) n
            )
            SELECT count(*), count(*) FILTER (WHERE tests.jsonb_text_of(v) IS DISTINCT FROM v::text),
                   min(v::text) FILTER (WHERE tests.jsonb_text_of(v) IS DISTINCT FROM v::text)
              FROM all_values"#;
        let (compared, differing, first) = Spi::get_three::<i64, i64, String>(values).unwrap();
        assert_eq!((differing, first), (Some(0), None), "jsonb_text_of differs from jsonb::text");
        assert_eq!(compared, Some(371), "values compared");
    }
}
