//! The log's physical layout as the Rust paths see it, written once: the three tables, their
//! `(shard, txid, id)` indexes, and the columns of a log table in the order src/sql/schema.sql
//! creates them. The enqueue builds a row by position in this order (`Row`), and inserts it
//! directly only while the table still has exactly these columns (src/log/append.rs); the relays
//! find each column by name (src/log/tables.rs), so a column a DBA adds shifts nothing. A pg_test
//! below compares this list with what the install script created.

use std::ffi::CStr;

use pgrx::pg_sys;

/// The log tables, by generation (`outbox.generations.generation`).
pub const TABLES: [&CStr; 3] = [c"events_0", c"events_1", c"events_2"];

/// Each table's `(shard, txid, id)` index: the relays' only access path.
pub const BATCH_INDEXES: [&CStr; 3] = [c"events_0_batch_idx", c"events_1_batch_idx", c"events_2_batch_idx"];

/// The positions (1-based) of the batch index's key columns.
pub const INDEX_SHARD: usize = 1;
pub const INDEX_TXID: usize = 2;
pub const INDEX_ID: usize = 3;

/// A column of a log table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// The inserting transaction (xid8).
    Txid,
    Shard,
    Id,
    EventId,
    AggregateType,
    AggregateId,
    EventType,
    Payload,
    Headers,
    Stream,
    CreatedAt,
}

/// How many columns a log table has.
pub const COUNT: usize = 11;

/// Every column, in the tables' order.
pub const COLUMNS: [Column; COUNT] = [
    Column::Txid,
    Column::Shard,
    Column::Id,
    Column::EventId,
    Column::AggregateType,
    Column::AggregateId,
    Column::EventType,
    Column::Payload,
    Column::Headers,
    Column::Stream,
    Column::CreatedAt,
];

impl Column {
    /// Its position in `COLUMNS` (0-based).
    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn name(self) -> &'static str {
        match self {
            Column::Txid => "txid",
            Column::Shard => "shard",
            Column::Id => "id",
            Column::EventId => "event_id",
            Column::AggregateType => "aggregate_type",
            Column::AggregateId => "aggregate_id",
            Column::EventType => "event_type",
            Column::Payload => "payload",
            Column::Headers => "headers",
            Column::Stream => "stream",
            Column::CreatedAt => "created_at",
        }
    }

    pub const fn type_oid(self) -> pg_sys::Oid {
        match self {
            Column::Txid => pg_sys::XID8OID,
            Column::Shard => pg_sys::INT2OID,
            Column::Id => pg_sys::INT8OID,
            Column::EventId => pg_sys::UUIDOID,
            Column::AggregateType | Column::AggregateId | Column::EventType | Column::Stream => pg_sys::TEXTOID,
            Column::Payload | Column::Headers => pg_sys::JSONBOID,
            Column::CreatedAt => pg_sys::TIMESTAMPTZOID,
        }
    }
}

/// The columns' types in order, as SPI_prepare takes them.
pub fn column_types() -> [pg_sys::Oid; COUNT] {
    COLUMNS.map(Column::type_oid)
}

/// The executor path's INSERT into each table (src/log/append.rs): one statement per table, so
/// that each keeps its plan. It names `COLUMNS` in order (a unit test checks it).
pub const INSERTS: [&CStr; 3] = [
    c"INSERT INTO outbox.events_0 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    c"INSERT INTO outbox.events_1 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    c"INSERT INTO outbox.events_2 (txid, shard, id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, stream, created_at)
      VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
];

/// A row of a log table being built, by column (NULL until set).
pub struct Row {
    pub values: [pg_sys::Datum; COUNT],
    pub nulls: [bool; COUNT],
}

impl Row {
    pub fn new() -> Row {
        Row { values: [pg_sys::Datum::from(0usize); COUNT], nulls: [true; COUNT] }
    }

    /// Sets `column` to `value` (None: NULL).
    pub fn set(&mut self, column: Column, value: Option<pg_sys::Datum>) {
        self.values[column.index()] = value.unwrap_or(pg_sys::Datum::from(0usize));
        self.nulls[column.index()] = value.is_none();
    }
}

#[cfg(test)]
mod unit {
    use super::{COLUMNS, INSERTS, TABLES};

    #[test]
    fn each_insert_names_every_column_in_order_into_its_table() {
        let names: Vec<&str> = COLUMNS.iter().map(|c| c.name()).collect();
        for (generation, insert) in INSERTS.iter().enumerate() {
            let insert = insert.to_str().unwrap();
            let table = TABLES[generation].to_str().unwrap();
            assert!(insert.starts_with(&format!("INSERT INTO outbox.{table} (")), "{insert}");
            let listed = &insert[insert.find('(').unwrap() + 1..insert.find(')').unwrap()];
            assert_eq!(listed.split(", ").collect::<Vec<_>>(), names);
            let placeholders: Vec<String> = (1..=names.len()).map(|n| format!("${n}")).collect();
            assert!(insert.trim_end().ends_with(&format!("VALUES ({})", placeholders.join(", "))), "{insert}");
        }
    }

    #[test]
    fn positions_follow_the_list() {
        for (position, column) in COLUMNS.iter().enumerate() {
            assert_eq!(column.index(), position);
        }
    }
}

/// In schema `tests`, where pgrx's test runner calls `#[pg_test]`s.
#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    use super::{COLUMNS, TABLES};

    /// The install script's log tables have exactly the columns, types and order written above.
    #[pg_test]
    fn the_log_tables_have_the_columns_the_rust_paths_expect() {
        let expected: Vec<String> = COLUMNS.iter().map(|c| format!("{}:{}", c.name(), c.type_oid().to_u32())).collect();
        for table in TABLES {
            let found: Vec<String> = Spi::connect(|client| {
                client
                    .select(
                        "SELECT attname::text || ':' || atttypid::oid::int8 FROM pg_attribute
                          WHERE attrelid = ('outbox.' || $1)::regclass AND attnum > 0 AND NOT attisdropped
                          ORDER BY attnum",
                        None,
                        &[table.to_str().unwrap().into()],
                    )
                    .unwrap()
                    .map(|row| row.get::<String>(1).unwrap().unwrap())
                    .collect()
            });
            assert_eq!(found, expected, "outbox.{}", table.to_string_lossy());
        }
    }
}
