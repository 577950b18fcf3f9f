//! The round's database interface (outbox-round's `Database` and `Statements`) over SPI: the
//! background worker's connection. A transaction is `txn::attempt` (a raised error becomes an
//! `Err`, the transaction aborted); values become datums of their own type OIDs, and a column
//! becomes a value by its type OID. The log's windows and counters are read with the index walks
//! of src/log/ rather than statements (faster: docs/performance.md), and the installation is the
//! extension's OID, read from the catalog cache.

use std::panic::AssertUnwindSafe;

use outbox_round::db::{first, Database, DbError, Kind, Row, Statements, Value};
use outbox_round::snapshot::Snapshot;
use outbox_round::window::{Budget, Position, WindowRead};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::pg_sys::Oid;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiHeapTupleData};
use pgrx::{PgOid, Spi};

use crate::log::window::{read_shard, WindowPlans};
use crate::log::{counters, window};
use crate::relay::txn;

/// The worker's connection: SPI, and the plans it keeps.
pub struct SpiDatabase {
    kept: KeptPlans,
}

impl SpiDatabase {
    /// A connection that prepares the statements the lists of `keep` name once and keeps their
    /// plans (`SPI_keepplan`): those a round runs every time (the claim or the kept claim, the
    /// finish's `_advance`), whose parsing, analysing and planning were about a tenth of a round's
    /// time when rounds carry an event or two. A kept plan is checked and, if what it uses changed
    /// (DROP and CREATE EXTENSION), parsed again by PostgreSQL's plan cache, so it never goes
    /// stale. The others are planned at each call, as `Spi::get_one` plans them.
    pub fn new(keep: &[&'static [&'static str]]) -> SpiDatabase {
        let keep: Vec<&'static str> = keep.iter().flat_map(|list| list.iter().copied()).collect();
        let plans = keep.iter().map(|_| None).collect();
        SpiDatabase { kept: KeptPlans { keep, plans, windows: WindowPlans::default() } }
    }
}

impl Database for SpiDatabase {
    fn transaction<R>(&mut self, body: impl FnOnce(&mut dyn Statements) -> Result<R, DbError>) -> Result<R, DbError> {
        // An error raised in `body` unwinds out of it: the transaction is aborted and what the body
        // changed of its captures before is the caller's to judge, as with `txn::run`'s callers. The
        // kept plans stay valid (a plan is kept only once prepared).
        let kept = AssertUnwindSafe(&mut self.kept);
        let body = AssertUnwindSafe(body);
        txn::attempt(move || {
            let (AssertUnwindSafe(kept), AssertUnwindSafe(body)) = (kept, body);
            Spi::connect_mut(|client| body(&mut SpiStatements { client, kept }))
        })
    }
}

struct KeptPlans {
    keep: Vec<&'static str>,
    /// The plan of each statement of `keep`, with the argument types it was prepared for.
    plans: Vec<Option<(Vec<Oid>, OwnedPreparedStatement)>>,
    /// The transactions of the windows this relay publishes in parts (src/log/window.rs).
    windows: WindowPlans,
}

struct SpiStatements<'a, 'conn> {
    client: &'a mut SpiClient<'conn>,
    kept: &'a mut KeptPlans,
}

impl SpiStatements<'_, '_> {
    /// Runs `sql`, through its kept plan if it is one of those kept. As pgrx's `update`, as
    /// `Spi::get_one` and `Spi::run_with_args` did, which the round called: the transaction gets
    /// an xid first. A `select` (`writes` false) does not: as pgrx's `select`, which the kept
    /// claim's read called, read-write all the same (a kept plan is prepared as one that writes).
    fn run(&mut self, sql: &str, args: &[Value], writes: bool) -> Result<pgrx::spi::SpiTupleTable<'_>, DbError> {
        let datums: Vec<DatumWithOid<'_>> = args.iter().map(datum).collect();
        let kept = self.kept.keep.iter().position(|keep| *keep == sql);
        let table = match kept {
            Some(at) => {
                let types: Vec<Oid> = args.iter().map(|value| type_oid(value.kind())).collect();
                let slot = &mut self.kept.plans[at];
                if slot.as_ref().is_none_or(|(prepared, _)| *prepared != types) {
                    let oids: Vec<PgOid> = types.iter().map(|oid| PgOid::from(*oid)).collect();
                    let plan = self.client.prepare_mut(sql, &oids).map_err(spi_error)?.keep();
                    *slot = Some((types, plan));
                }
                let Some((_, plan)) = slot.as_ref() else { unreachable!("prepared above") };
                if writes {
                    self.client.update(plan, None, &datums)
                } else {
                    self.client.select(plan, None, &datums)
                }
            }
            None if writes => self.client.update(sql, None, &datums),
            None => self.client.select(sql, None, &datums),
        };
        table.map_err(spi_error)
    }

    /// The rows of `sql`, run as `run` runs it.
    fn rows(&mut self, sql: &str, args: &[Value], writes: bool) -> Result<Vec<Row>, DbError> {
        let mut table = self.run(sql, args, writes)?;
        let mut rows = Vec::with_capacity(table.len());
        for tuple in table.by_ref() {
            match row(&tuple) {
                Ok(row) => rows.push(row),
                Err(Unreadable::Value(error)) => return Err(spi_error(error)),
                Err(Unreadable::Type(column, oid)) => {
                    let name = table.column_name(column).unwrap_or_default();
                    return Err(DbError::new(format!(
                        "column {column} (\"{name}\") of `{sql}` has type oid {}, which the relay does not read: cast it in the statement",
                        oid.to_u32()
                    )));
                }
            }
        }
        Ok(rows)
    }
}

impl Statements for SpiStatements<'_, '_> {
    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        self.rows(sql, args, true)
    }

    fn select(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        self.rows(sql, args, false)
    }

    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, DbError> {
        Ok(self.run(sql, args, true)?.len() as u64)
    }

    fn read_window(
        &mut self,
        shard: i16,
        cursor: &Snapshot,
        upto: &Snapshot,
        from: Option<Position>,
        budget: &mut Budget,
    ) -> Result<WindowRead, DbError> {
        Ok(read_shard(shard, cursor, upto, from, budget, &mut self.kept.windows))
    }

    fn forget_window(&mut self, shard: i16) {
        self.kept.windows.forget(shard);
    }

    fn last_seqs(&mut self, aggregates: &[(String, String)]) -> Result<Vec<Option<i64>>, DbError> {
        Ok(counters::last_seqs(aggregates.iter().map(|(t, i)| (t.as_str(), i.as_str()))))
    }

    fn flush_commits(&mut self, txids: &mut dyn Iterator<Item = u64>) {
        window::flush_commits(txids);
    }

    fn installation(&mut self) -> Result<Option<u32>, DbError> {
        // SAFETY: a catalog lookup inside a transaction; missing_ok, so it returns InvalidOid
        // rather than raising.
        let oid = unsafe { pg_sys::get_extension_oid(c"outbox_pg".as_ptr(), true) };
        Ok((oid != pg_sys::InvalidOid).then(|| oid.to_u32()))
    }

    fn installed_version(&mut self) -> Result<Option<String>, DbError> {
        let Some(oid) = self.installation()? else { return Ok(None) };
        first::<String>(
            &self.query("SELECT extversion::text FROM pg_catalog.pg_extension WHERE oid = $1", &[oid.into()])?,
        )
    }

    fn database_oid(&mut self) -> Result<u32, DbError> {
        // SAFETY: set for every connected backend.
        Ok(unsafe { pg_sys::MyDatabaseId }.to_u32())
    }
}

fn spi_error(error: pgrx::spi::Error) -> DbError {
    DbError::new(error.to_string())
}

fn type_oid(kind: Kind) -> Oid {
    match kind {
        Kind::Bool => pg_sys::BOOLOID,
        Kind::Int2 => pg_sys::INT2OID,
        Kind::Int4 => pg_sys::INT4OID,
        Kind::Int8 => pg_sys::INT8OID,
        Kind::Float8 => pg_sys::FLOAT8OID,
        Kind::Oid => pg_sys::OIDOID,
        Kind::Text => pg_sys::TEXTOID,
        Kind::BoolArray => pg_sys::BOOLARRAYOID,
        Kind::Int2Array => pg_sys::INT2ARRAYOID,
        Kind::Int8Array => pg_sys::INT8ARRAYOID,
        Kind::TextArray => pg_sys::TEXTARRAYOID,
        Kind::UuidArray => pg_sys::UUIDARRAYOID,
    }
}

/// The datum of an argument, with its type's OID (the element type's array OID for arrays, not
/// looked up: pgrx's `Vec<T>` looks it up in the syscache at each call).
fn datum(value: &Value) -> DatumWithOid<'static> {
    let oid = type_oid(value.kind());
    // SAFETY: each datum is made from the Rust type that `type_oid` maps the value's kind to.
    unsafe {
        match value {
            Value::Null(_) => DatumWithOid::null_oid(oid),
            Value::Bool(v) => DatumWithOid::new(*v, oid),
            Value::Int2(v) => DatumWithOid::new(*v, oid),
            Value::Int4(v) => DatumWithOid::new(*v, oid),
            Value::Int8(v) => DatumWithOid::new(*v, oid),
            Value::Float8(v) => DatumWithOid::new(*v, oid),
            Value::Oid(v) => DatumWithOid::new(Oid::from(*v), oid),
            Value::Text(v) => DatumWithOid::new(v.as_str(), oid),
            Value::BoolArray(v) => DatumWithOid::new(v.as_slice(), oid),
            Value::Int2Array(v) => DatumWithOid::new(v.as_slice(), oid),
            Value::Int8Array(v) => DatumWithOid::new(v.as_slice(), oid),
            Value::TextArray(v) => DatumWithOid::new(v.iter().map(Option::as_deref).collect::<Vec<_>>(), oid),
            Value::UuidArray(v) => DatumWithOid::new(
                v.iter().map(|id| id.map(pgrx::Uuid::from_bytes)).collect::<Vec<Option<pgrx::Uuid>>>(),
                oid,
            ),
        }
    }
}

/// Why a row could not be read.
enum Unreadable {
    /// Column (from 1) of a type that has no `Kind`.
    Type(usize, Oid),
    Value(pgrx::spi::Error),
}

/// A row's values by their columns' type OIDs.
fn row(tuple: &SpiHeapTupleData<'_>) -> Result<Row, Unreadable> {
    let mut values = Vec::with_capacity(tuple.columns());
    for column in 1..=tuple.columns() {
        let entry = tuple.get_datum_by_ordinal(column).map_err(Unreadable::Value)?;
        let oid = entry.oid();
        let kind = kind_of(oid).ok_or(Unreadable::Type(column, oid))?;
        let value = match kind {
            Kind::Bool => entry.value::<bool>().map(|v| v.map(Value::Bool)),
            Kind::Int2 => entry.value::<i16>().map(|v| v.map(Value::Int2)),
            Kind::Int4 => entry.value::<i32>().map(|v| v.map(Value::Int4)),
            Kind::Int8 => entry.value::<i64>().map(|v| v.map(Value::Int8)),
            Kind::Float8 => entry.value::<f64>().map(|v| v.map(Value::Float8)),
            Kind::Oid => entry.value::<Oid>().map(|v| v.map(|oid| Value::Oid(oid.to_u32()))),
            Kind::Text => entry.value::<String>().map(|v| v.map(Value::Text)),
            Kind::BoolArray => entry.value::<Vec<Option<bool>>>().map(|v| v.map(Value::BoolArray)),
            Kind::Int2Array => entry.value::<Vec<Option<i16>>>().map(|v| v.map(Value::Int2Array)),
            Kind::Int8Array => entry.value::<Vec<Option<i64>>>().map(|v| v.map(Value::Int8Array)),
            Kind::TextArray => entry.value::<Vec<Option<String>>>().map(|v| v.map(Value::TextArray)),
            Kind::UuidArray => entry.value::<Vec<Option<pgrx::Uuid>>>().map(|v| {
                v.map(|ids| Value::UuidArray(ids.into_iter().map(|id| id.map(|id| *id.as_bytes())).collect()))
            }),
        };
        values.push(value.map_err(Unreadable::Value)?.unwrap_or(Value::Null(kind)));
    }
    Ok(Row::new(values))
}

/// The kind of a column's type; None for a type the relay does not read.
fn kind_of(oid: Oid) -> Option<Kind> {
    Some(match oid {
        pg_sys::BOOLOID => Kind::Bool,
        pg_sys::INT2OID => Kind::Int2,
        pg_sys::INT4OID => Kind::Int4,
        pg_sys::INT8OID => Kind::Int8,
        pg_sys::FLOAT8OID => Kind::Float8,
        pg_sys::OIDOID => Kind::Oid,
        pg_sys::TEXTOID => Kind::Text,
        pg_sys::BOOLARRAYOID => Kind::BoolArray,
        pg_sys::INT2ARRAYOID => Kind::Int2Array,
        pg_sys::INT8ARRAYOID => Kind::Int8Array,
        pg_sys::TEXTARRAYOID => Kind::TextArray,
        pg_sys::UUIDARRAYOID => Kind::UuidArray,
        _ => return None,
    })
}
