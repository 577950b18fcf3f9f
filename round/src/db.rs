//! The one thing the round needs of PostgreSQL: *run this statement in this transaction*. The
//! background worker implements it over SPI (src/relay/spi.rs), `outbox-relay` over a client
//! connection; the round's statements are one-line calls of the SQL functions in src/sql/, the
//! same text for both, so that no SQL is copied (docs/outside-relay.md).
//!
//! The values are a small closed set, the types those functions take and return: an
//! implementation converts each to and from its own representation, and a column of any other
//! type is an error naming it, so that the statement casts it (jsonb, pg_snapshot and timestamptz
//! cross as text).

use std::fmt;

use crate::snapshot::Snapshot;
use crate::window::{Budget, Position, WindowAsk, WindowRead};

/// The type of a value, and of a NULL: SPI plans a statement with each argument's type and
/// refuses an argument of none, and the statements resolve functions and operators by them
/// (`$1 * interval '1 second'`), so a NULL argument carries its type (`Value::Null`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Bool,
    Int2,
    Int4,
    Int8,
    Float8,
    /// `oid`: the catalogs' identifiers (`pg_extension.oid`, `outbox.installation.database_oid`).
    Oid,
    /// `text`, and what crosses as text.
    Text,
    BoolArray,
    Int2Array,
    Int8Array,
    TextArray,
    /// `uuid[]` as 16 bytes each: the finish's journal of a round's event ids, where `uuid_in` on
    /// 10,000 texts a round was 3% of the relay's CPU (src/relay/settle.rs).
    UuidArray,
}

/// A value a statement takes as an argument or returns in a column. Array elements may be NULL
/// (`None`): some functions take one array per field of a list whose items lack some fields.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A NULL of that type.
    Null(Kind),
    Bool(bool),
    Int2(i16),
    Int4(i32),
    Int8(i64),
    Float8(f64),
    Oid(u32),
    Text(String),
    BoolArray(Vec<Option<bool>>),
    Int2Array(Vec<Option<i16>>),
    Int8Array(Vec<Option<i64>>),
    TextArray(Vec<Option<String>>),
    UuidArray(Vec<Option<[u8; 16]>>),
}

impl Value {
    /// The value's type (a NULL's too).
    pub fn kind(&self) -> Kind {
        match self {
            Value::Null(kind) => *kind,
            Value::Bool(_) => Kind::Bool,
            Value::Int2(_) => Kind::Int2,
            Value::Int4(_) => Kind::Int4,
            Value::Int8(_) => Kind::Int8,
            Value::Float8(_) => Kind::Float8,
            Value::Oid(_) => Kind::Oid,
            Value::Text(_) => Kind::Text,
            Value::BoolArray(_) => Kind::BoolArray,
            Value::Int2Array(_) => Kind::Int2Array,
            Value::Int8Array(_) => Kind::Int8Array,
            Value::TextArray(_) => Kind::TextArray,
            Value::UuidArray(_) => Kind::UuidArray,
        }
    }
}

/// A Rust type a `Value` of one kind is made from and read back into.
pub trait FromValue: Sized {
    /// The kind a NULL of this type has.
    const KIND: Kind;
    /// The value, None for a NULL; an error (what was found instead) for a value of another kind.
    /// Integers widen (an `int4` column reads as `i64`), nothing narrows.
    fn from_value(value: &Value) -> Result<Option<Self>, String>;

    /// `from_value`, moving the value out (a text or an array is not copied); the value back when
    /// it is of another kind.
    fn from_owned(value: Value) -> Result<Option<Self>, Value>;
}

fn mismatch<T>(wanted: Kind, value: &Value) -> Result<Option<T>, String> {
    Err(format!("a {:?} value where {wanted:?} was expected", value.kind()))
}

macro_rules! plain {
    ($type:ty, $kind:ident $(, $wider:ident)*) => {
        impl FromValue for $type {
            const KIND: Kind = Kind::$kind;
            fn from_value(value: &Value) -> Result<Option<Self>, String> {
                match value {
                    Value::Null(_) => Ok(None),
                    Value::$kind(v) => Ok(Some(v.clone())),
                    $(Value::$wider(v) => Ok(Some(<$type>::from(*v))),)*
                    other => mismatch(Kind::$kind, other),
                }
            }

            fn from_owned(value: Value) -> Result<Option<Self>, Value> {
                match value {
                    Value::Null(_) => Ok(None),
                    Value::$kind(v) => Ok(Some(v)),
                    $(Value::$wider(v) => Ok(Some(<$type>::from(v))),)*
                    other => Err(other),
                }
            }
        }

        impl From<$type> for Value {
            fn from(value: $type) -> Value {
                Value::$kind(value.into())
            }
        }

        impl From<Option<$type>> for Value {
            fn from(value: Option<$type>) -> Value {
                value.map_or(Value::Null(Kind::$kind), Value::from)
            }
        }
    };
}

plain!(bool, Bool);
plain!(i16, Int2);
plain!(i32, Int4, Int2);
plain!(i64, Int8, Int4, Int2);
plain!(f64, Float8);
plain!(u32, Oid);
plain!(String, Text);
plain!(Vec<Option<bool>>, BoolArray);
plain!(Vec<Option<i16>>, Int2Array);
plain!(Vec<Option<i64>>, Int8Array);
plain!(Vec<Option<String>>, TextArray);
plain!(Vec<Option<[u8; 16]>>, UuidArray);

impl From<&str> for Value {
    fn from(value: &str) -> Value {
        Value::Text(value.to_string())
    }
}

/// Arrays without NULL elements, as most call sites build them, and such an array or NULL (an
/// optional filter).
macro_rules! array {
    ($elem:ty, $kind:ident) => {
        impl From<Vec<$elem>> for Value {
            fn from(value: Vec<$elem>) -> Value {
                Value::$kind(value.into_iter().map(Some).collect())
            }
        }

        impl From<Option<Vec<$elem>>> for Value {
            fn from(value: Option<Vec<$elem>>) -> Value {
                value.map_or(Value::Null(Kind::$kind), Value::from)
            }
        }
    };
}

array!(bool, BoolArray);
array!(i16, Int2Array);
array!(i64, Int8Array);
array!(String, TextArray);
array!([u8; 16], UuidArray);

/// One row a statement returned, its values owned (nothing borrows the connection).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Row {
    values: Vec<Value>,
}

impl Row {
    pub fn new(values: Vec<Value>) -> Row {
        Row { values }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Column `column` (from 0) as a `T`, None for a NULL; an error naming the column when there is
    /// none or it holds another type.
    pub fn get<T: FromValue>(&self, column: usize) -> Result<Option<T>, DbError> {
        let value = self
            .values
            .get(column)
            .ok_or_else(|| DbError::new(format!("column {column} of a row of {} columns was read", self.len())))?;
        T::from_value(value).map_err(|found| DbError::new(format!("column {column}: {found}")))
    }

    /// `get`, moving the value out of the row (a NULL is left in its place): a text or an array
    /// read once is not copied, as the events' payloads read from a statement.
    pub fn take<T: FromValue>(&mut self, column: usize) -> Result<Option<T>, DbError> {
        let columns = self.len();
        let value = self
            .values
            .get_mut(column)
            .ok_or_else(|| DbError::new(format!("column {column} of a row of {columns} columns was read")))?;
        let kind = value.kind();
        T::from_owned(std::mem::replace(value, Value::Null(kind))).map_err(|found| {
            let error = mismatch::<T>(T::KIND, &found).err().unwrap_or_default();
            *value = found;
            DbError::new(format!("column {column}: {error}"))
        })
    }
}

/// The first column of the first row, for the statements that return one value (`SELECT
/// outbox._f(...)`); an error when there is no row.
pub fn first<T: FromValue>(rows: &[Row]) -> Result<Option<T>, DbError> {
    rows.first().ok_or_else(|| DbError::new("the statement returned no row"))?.get(0)
}

/// A statement or a transaction that failed: the server's message, and its SQLSTATE when the
/// server raised it (None for an error of the interface itself: a value of an unsupported type, a
/// body that gave up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbError {
    pub message: String,
    pub sqlstate: Option<String>,
}

impl DbError {
    pub fn new(message: impl Into<String>) -> DbError {
        DbError { message: message.into(), sqlstate: None }
    }
}

/// The message alone: the relay logs it as it logged the server's message before this interface.
impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DbError {}

/// The message alone: the worker's steps report a failure as its message (and log it so).
impl From<DbError> for String {
    fn from(error: DbError) -> String {
        error.message
    }
}

impl From<String> for DbError {
    fn from(message: String) -> DbError {
        DbError::new(message)
    }
}

/// A connection the round runs its statements on: SPI in the background worker, a client
/// connection in outbox-relay. Not object-safe (`transaction` is generic over what the body
/// returns): the round is generic over it, so the worker's calls stay direct.
pub trait Database {
    /// Runs `body` in one transaction: committed when it returns Ok, rolled back when it returns
    /// Err or the server raises an error (in a statement or at commit), whose message is
    /// returned. A round's transactions are short and never wait on the network but the
    /// database's (docs/worker.md).
    fn transaction<R>(&mut self, body: impl FnOnce(&mut dyn Statements) -> Result<R, DbError>) -> Result<R, DbError>;
}

/// The statements of the transaction under way. Object-safe, so that the round's code that runs
/// inside a transaction takes `&mut dyn Statements` and is compiled once.
pub trait Statements {
    /// Runs a statement and returns its rows. An implementation may keep the plans of the
    /// statements it is told run often; the results are the same.
    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError>;

    /// `query` for a statement that writes nothing: an implementation need not make the
    /// transaction one that writes for it. The worker's SPI runs it as pgrx's `select`, which
    /// assigns no transaction id, so that a round on a kept claim, which writes nothing, commits
    /// without one (no xid drawn, no commit record) as it did before this interface; a client
    /// connection runs it as any other.
    fn select(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        self.query(sql, args)
    }

    /// Runs a statement whose rows are not needed; returns how many it processed (returned or
    /// changed).
    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, DbError>;

    /// What this round takes of `shard`'s window between `cursor` and `upto`, from `from` on (a
    /// window published in parts), as much as `budget` allows (it is charged). The worker reads
    /// the log's indexes directly (src/log/window.rs, about 160,000 events/s against 99,000 for a
    /// statement); a client connection runs `outbox._read_window`, which gives the same events in
    /// the same order (tests/read_window.rs).
    fn read_window(
        &mut self,
        shard: i16,
        cursor: &Snapshot,
        upto: &Snapshot,
        from: Option<Position>,
        budget: &mut Budget,
    ) -> Result<WindowRead, DbError>;

    /// `read_window` for each of `asks` in turn, each with what the ones before it left of `budget`.
    /// A client connection reads them all in one statement (`outbox._read_windows`): a round
    /// trip per shard was most of a small round's time outside the server.
    fn read_windows(&mut self, asks: &[WindowAsk], budget: &mut Budget) -> Result<Vec<WindowRead>, DbError> {
        asks.iter().map(|ask| self.read_window(ask.shard, &ask.cursor, &ask.upto, ask.from, budget)).collect()
    }

    /// Forgets what `read_window` kept of `shard`'s window (it is done, or not this relay's).
    fn forget_window(&mut self, _shard: i16) {}

    /// The last `aggregate_seq` of each aggregate (type, id), None where it has no counter yet.
    fn last_seqs(&mut self, aggregates: &[(String, String)]) -> Result<Vec<Option<i64>>, DbError>;

    /// Makes sure the commits of these transactions are on disk before their events are published
    /// (src/log/window.rs, `flush_commits`); a client connection cannot, and does nothing
    /// (docs/outside-relay.md, "What the outside relay does not have").
    fn flush_commits(&mut self, _txids: &mut dyn Iterator<Item = u64>) {}

    /// The installation of outbox_pg in this database, as an identity a finish checks is
    /// unchanged (DROP and CREATE give a new one); None when there is none. Read every round.
    fn installation(&mut self) -> Result<Option<u32>, DbError>;

    /// The installation's version (read at most once a second: `readiness`).
    fn installed_version(&mut self) -> Result<Option<String>, DbError>;

    /// The OID of the database the connection is to.
    fn database_oid(&mut self) -> Result<u32, DbError> {
        let rows = self.query("SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()", &[])?;
        Ok(first::<u32>(&rows)?.unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_none_is_a_null_of_its_type() {
        assert_eq!(Value::from(None::<i32>), Value::Null(Kind::Int4));
        assert_eq!(Value::from(None::<String>), Value::Null(Kind::Text));
        assert_eq!(Value::from(Some(7i16)), Value::Int2(7));
        assert_eq!(Value::Null(Kind::Int8Array).kind(), Kind::Int8Array);
    }

    #[test]
    fn arrays_without_nulls_become_arrays_of_some() {
        assert_eq!(Value::from(vec![1i64, 2]), Value::Int8Array(vec![Some(1), Some(2)]));
        assert_eq!(Value::from(vec!["a".to_string()]), Value::TextArray(vec![Some("a".to_string())]));
        assert_eq!(Value::from(vec![Some(1i64), None]), Value::Int8Array(vec![Some(1), None]));
        assert_eq!(Value::from(vec![[0u8; 16]]).kind(), Kind::UuidArray);
        assert_eq!(Value::from(Some(vec![3i16])), Value::Int2Array(vec![Some(3)]));
        assert_eq!(Value::from(None::<Vec<String>>), Value::Null(Kind::TextArray));
    }

    #[test]
    fn a_row_reads_its_columns_by_type() {
        let row = Row::new(vec![Value::Int8(5), Value::Text("s".into()), Value::Null(Kind::Bool)]);
        assert_eq!(row.get::<i64>(0), Ok(Some(5)));
        assert_eq!(row.get::<String>(1), Ok(Some("s".to_string())));
        assert_eq!(row.get::<bool>(2), Ok(None));
    }

    #[test]
    fn a_taken_value_leaves_a_null_and_a_mismatch_leaves_the_value() {
        let mut row = Row::new(vec![Value::Text("payload".into()), Value::Int4(4)]);
        assert_eq!(row.take::<String>(0), Ok(Some("payload".to_string())));
        assert_eq!(row.get::<String>(0), Ok(None));
        assert_eq!(row.take::<i64>(1), Ok(Some(4)));
        let mut row = Row::new(vec![Value::Int8(5)]);
        assert_eq!(row.take::<i32>(0).unwrap_err().message, "column 0: a Int8 value where Int4 was expected");
        assert_eq!(row.get::<i64>(0), Ok(Some(5)));
        assert!(row.take::<i64>(1).unwrap_err().message.contains("column 1 of a row of 1 columns"));
    }

    #[test]
    fn integers_widen_and_never_narrow() {
        let row = Row::new(vec![Value::Int2(3), Value::Int4(4), Value::Int8(5)]);
        assert_eq!(row.get::<i64>(0), Ok(Some(3)));
        assert_eq!(row.get::<i64>(1), Ok(Some(4)));
        assert_eq!(row.get::<i32>(0), Ok(Some(3)));
        let narrowed = row.get::<i32>(2).unwrap_err();
        assert_eq!(narrowed.message, "column 2: a Int8 value where Int4 was expected");
        assert_eq!(narrowed.sqlstate, None);
    }

    #[test]
    fn a_missing_column_or_row_is_an_error() {
        let row = Row::new(vec![Value::Bool(true)]);
        assert!(row.get::<bool>(1).unwrap_err().message.contains("column 1 of a row of 1 columns"));
        assert_eq!(first::<bool>(&[row]), Ok(Some(true)));
        assert_eq!(first::<bool>(&[]).unwrap_err().message, "the statement returned no row");
    }

    #[test]
    fn an_error_shows_its_message_alone() {
        let error = DbError { message: "deadlock detected".into(), sqlstate: Some("40P01".into()) };
        assert_eq!(error.to_string(), "deadlock detected");
    }
}
