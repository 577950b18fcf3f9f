//! The round's database interface (outbox-round's `Database` and `Statements`) over a client
//! connection (the `postgres` crate): what src/relay/spi.rs is to the background worker. A
//! transaction is `BEGIN` ... `COMMIT`, rolled back on an `Err` or an error of the server; each
//! statement is prepared once, with its arguments' types (a NULL's too, as SPI plans it), and kept
//! by its text and those types for the life of the connection; a column becomes a value by its
//! type.
//!
//! The connection also carries the commit wake-up (docs/sql-only.md, "Commit wake-up"): it
//! `LISTEN`s from connect, and `wait_for_notification` reads what arrived, with a deadline.

use std::collections::HashMap;
use std::error::Error;
use std::time::Duration;

use bytes::BytesMut;
use outbox_round::db::{Database, DbError, Kind, Row, Statements, Value};
use outbox_round::session::SESSION_SETTINGS;
use outbox_round::snapshot::Snapshot;
use outbox_round::window::{Budget, Position, WindowAsk, WindowRead};
use postgres::fallible_iterator::FallibleIterator;
use postgres::types::{FromSql, IsNull, ToSql, Type};
use postgres::{Client, Statement};

use crate::tls::RustlsConnect;

/// The application_name the relay's connections carry (pg_stat_activity shows it).
pub const APPLICATION_NAME: &str = "outbox-relay";

/// The wake channel of the SQL-only install (`outbox._wake_channel()`), listened on from connect,
/// before the schema can be asked: a relay that listened only later could miss a commit made
/// between its last look and its `LISTEN`. `listen` adds the one the schema names if it differs.
pub const DEFAULT_WAKE_CHANNEL: &str = "outbox_pg";

/// How a connection is made, beyond its URL.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub connect_timeout: Duration,
    /// TCP keepalives: a relay whose connection died silently holds the wake key (and makes every
    /// writer notify) until the server notices; keepalives make that seconds, not hours.
    pub keepalives_idle: Duration,
    pub keepalives_interval: Duration,
    pub keepalives_retries: u32,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connect_timeout: Duration::from_secs(10),
            keepalives_idle: Duration::from_secs(10),
            keepalives_interval: Duration::from_secs(5),
            keepalives_retries: 3,
        }
    }
}

/// A connection to the relayed database: its client, the statements it prepared, what it listens
/// on.
pub struct PgDatabase {
    client: Client,
    prepared: HashMap<(String, Vec<Kind>), Statement>,
    listening: Vec<String>,
    backend_pid: i32,
    role: String,
    database: String,
}

impl PgDatabase {
    /// Connects to `url` (a `postgresql://` URL or `key=value` string) with application_name
    /// `outbox-relay`, TCP keepalives and a connect timeout (each unless the URL sets it), and
    /// `LISTEN`s on the wake channel unless the server is a standby. `PGPASSWORD` is used when the URL has no password.
    /// TLS as libpq's `sslmode` says (src/tls.rs): `prefer` unless the URL or `PGSSLMODE` says
    /// otherwise.
    pub fn connect(url: &str, options: &ConnectOptions) -> Result<PgDatabase, DbError> {
        let (config, connector) = PgDatabase::prepare(url, options)?;
        let mut client = config.connect(connector).map_err(db_error)?;
        let who = client
            .query_one(
                // Qualified, as the next statement: the settings are not pinned yet, and a database
                // default search_path listing a schema before pg_catalog (which the database's
                // owner may set) would otherwise choose these functions and types.
                "SELECT pg_catalog.pg_backend_pid(), current_user::pg_catalog.text, \
                        pg_catalog.current_database()::pg_catalog.text, pg_catalog.pg_is_in_recovery()",
                &[],
            )
            .map_err(db_error)?;
        let (backend_pid, role, database) = (who.get(0), who.get(1), who.get(2));
        let standby: bool = who.get(3);
        // The worker's session settings (outbox_round::session), over the database's and role's.
        let (names, values): (Vec<&str>, Vec<&str>) = SESSION_SETTINGS.iter().copied().unzip();
        client
            .execute(
                "SELECT pg_catalog.set_config(s.name, s.value, false) FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) AS s(name, value)",
                &[&names, &values],
            )
            .map_err(db_error)?;
        let mut db =
            PgDatabase { client, prepared: HashMap::new(), listening: Vec::new(), backend_pid, role, database };
        // A standby refuses LISTEN (and is never published from: src/readiness.rs); once promoted,
        // the relay listens when it finds the schema ready, before its last look.
        if !standby {
            db.listen(DEFAULT_WAKE_CHANNEL)?;
        }
        Ok(db)
    }

    /// What `connect` connects with, from the connection string and the PG* environment: an error
    /// here (a mistyped option, an sslmode libpq does not know, a certificate file that cannot be
    /// read) is one of the settings, which no retry mends; the process refuses it at start.
    pub fn prepare(url: &str, options: &ConnectOptions) -> Result<(postgres::Config, RustlsConnect), DbError> {
        let (url, tls) = crate::tls::split(url, |name| std::env::var(name).ok()).map_err(DbError::new)?;
        let mut config: postgres::Config = url.parse().map_err(db_error)?;
        // As libpq: sslmode is for TCP; over a Unix socket the server offers no TLS at all.
        let tcp = config.get_hosts().iter().any(|host| matches!(host, postgres::config::Host::Tcp(_)))
            || !config.get_hostaddrs().is_empty();
        config.ssl_mode(if tcp { tls.postgres_mode() } else { postgres::config::SslMode::Disable });
        if config.get_application_name().is_none() {
            config.application_name(APPLICATION_NAME);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.connect_timeout);
        }
        config
            .keepalives(true)
            .keepalives_idle(options.keepalives_idle)
            .keepalives_interval(options.keepalives_interval)
            .keepalives_retries(options.keepalives_retries);
        if config.get_password().is_none() {
            if let Some(password) = std::env::var_os("PGPASSWORD") {
                config.password(password.as_encoded_bytes());
            }
        }
        if let Some(password) = config.get_password() {
            crate::log::hide(&String::from_utf8_lossy(password));
        }
        let connector = tls.connector().map_err(DbError::new)?;
        Ok((config, connector))
    }

    /// The pid of the relay's backend: its identity in `outbox.shards.claimed_by`.
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// The role the relay connected as (`current_user`).
    pub fn role(&self) -> &str {
        &self.role
    }

    /// The database connected to (`current_database()`).
    pub fn database(&self) -> &str {
        &self.database
    }

    /// Whether the connection is gone (then connect again).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Whether the server is a standby (`pg_is_in_recovery()`).
    pub fn in_recovery(&mut self) -> Result<bool, DbError> {
        self.client.query_one("SELECT pg_is_in_recovery()", &[]).map(|row| row.get(0)).map_err(db_error)
    }

    /// `LISTEN channel`, once per channel.
    pub fn listen(&mut self, channel: &str) -> Result<(), DbError> {
        if self.listening.iter().any(|known| known == channel) {
            return Ok(());
        }
        let quoted = format!("\"{}\"", channel.replace('"', "\"\""));
        self.client.batch_execute(&format!("LISTEN {quoted}")).map_err(db_error)?;
        self.listening.push(channel.to_string());
        Ok(())
    }

    /// The channels listened on.
    pub fn listening(&self) -> &[String] {
        &self.listening
    }

    /// Waits up to `timeout` for a notification on a channel listened on; the channel's name when
    /// one came, None at the deadline. Notifications that arrived earlier are returned at once.
    pub fn wait_for_notification(&mut self, timeout: Duration) -> Result<Option<String>, DbError> {
        let mut notifications = self.client.notifications();
        let next = notifications.timeout_iter(timeout).next().map_err(db_error)?;
        Ok(next.map(|notification| notification.channel().to_string()))
    }

    /// Reads every notification already received, without waiting: how many there were. PostgreSQL
    /// keeps a listener's notifications in a queue shared by the whole server until it reads
    /// them; a full queue fails every notifying commit.
    pub fn drain_notifications(&mut self) -> Result<usize, DbError> {
        let mut notifications = self.client.notifications();
        let mut iter = notifications.iter();
        let mut count = 0;
        while iter.next().map_err(db_error)?.is_some() {
            count += 1;
        }
        Ok(count)
    }

    /// Runs one statement outside any transaction of `transaction` (the wake key's session lock,
    /// which must outlive transactions), and returns its rows.
    pub fn query_outside_transaction(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        let mut statements = PgStatements { client: &mut self.client, prepared: &mut self.prepared, failed: None };
        statements.query(sql, args)
    }
}

impl Database for PgDatabase {
    fn transaction<R>(&mut self, body: impl FnOnce(&mut dyn Statements) -> Result<R, DbError>) -> Result<R, DbError> {
        self.client.batch_execute("BEGIN").map_err(db_error)?;
        let mut statements = PgStatements { client: &mut self.client, prepared: &mut self.prepared, failed: None };
        let outcome = body(&mut statements);
        // A statement that failed aborted the transaction even if the body went on: COMMIT would
        // then roll back and report success, so it is not sent.
        let failed = statements.failed.take();
        match (outcome, failed) {
            (Ok(value), None) => match self.client.batch_execute("COMMIT") {
                Ok(()) => Ok(value),
                Err(error) => {
                    let error = db_error(error);
                    // A failed COMMIT (a deferred constraint, a serialization failure) leaves no
                    // transaction open; a lost connection leaves nothing to roll back.
                    let _ = self.client.batch_execute("ROLLBACK");
                    Err(error)
                }
            },
            (Ok(_), Some(error)) | (Err(error), _) => {
                let _ = self.client.batch_execute("ROLLBACK");
                Err(error)
            }
        }
    }
}

struct PgStatements<'a> {
    client: &'a mut Client,
    prepared: &'a mut HashMap<(String, Vec<Kind>), Statement>,
    /// The first statement that failed in this transaction.
    failed: Option<DbError>,
}

impl PgStatements<'_> {
    fn statement(&mut self, sql: &str, args: &[Value]) -> Result<Statement, DbError> {
        let kinds: Vec<Kind> = args.iter().map(Value::kind).collect();
        let key = (sql.to_string(), kinds);
        if let Some(statement) = self.prepared.get(&key) {
            return Ok(statement.clone());
        }
        let types: Vec<Type> = key.1.iter().map(|kind| type_of(*kind)).collect();
        let statement = self.client.prepare_typed(sql, &types).map_err(db_error)?;
        self.prepared.insert(key, statement.clone());
        Ok(statement)
    }

    fn rows(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        let statement = self.statement(sql, args)?;
        let params: Vec<Param<'_>> = args.iter().map(Param).collect();
        let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|param| param as &(dyn ToSql + Sync)).collect();
        let rows = self.client.query(&statement, &refs).map_err(db_error)?;
        rows.iter().map(|row| read_row(row, sql)).collect()
    }

    fn remember<T>(&mut self, result: Result<T, DbError>) -> Result<T, DbError> {
        if let Err(error) = &result {
            if self.failed.is_none() && error.sqlstate.is_some() {
                self.failed = Some(error.clone());
            }
        }
        result
    }
}

impl Statements for PgStatements<'_> {
    fn query(&mut self, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
        let result = self.rows(sql, args);
        self.remember(result)
    }

    fn execute(&mut self, sql: &str, args: &[Value]) -> Result<u64, DbError> {
        let result = (|| {
            let statement = self.statement(sql, args)?;
            let params: Vec<Param<'_>> = args.iter().map(Param).collect();
            let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|param| param as &(dyn ToSql + Sync)).collect();
            self.client.execute(&statement, &refs).map_err(db_error)
        })();
        self.remember(result)
    }

    fn read_window(
        &mut self,
        shard: i16,
        cursor: &Snapshot,
        upto: &Snapshot,
        from: Option<Position>,
        budget: &mut Budget,
    ) -> Result<WindowRead, DbError> {
        crate::reads::read_window(self, shard, cursor, upto, from, budget)
    }

    fn read_windows(&mut self, asks: &[WindowAsk], budget: &mut Budget) -> Result<Vec<WindowRead>, DbError> {
        crate::reads::read_windows(self, asks, budget)
    }

    fn last_seqs(&mut self, aggregates: &[(String, String)]) -> Result<Vec<Option<i64>>, DbError> {
        crate::reads::last_seqs(self, aggregates)
    }

    fn installation(&mut self) -> Result<Option<u32>, DbError> {
        crate::reads::installation(self)
    }

    fn installed_version(&mut self) -> Result<Option<String>, DbError> {
        crate::readiness::installed_version(self)
    }
}

/// A server's error as the round sees it: its message (with its detail, if any) and SQLSTATE; any
/// other error (a lost connection, a conversion) as its text.
pub fn db_error(error: postgres::Error) -> DbError {
    match error.as_db_error() {
        Some(db) => DbError {
            message: match db.detail() {
                Some(detail) => format!("{}: {detail}", db.message()),
                None => db.message().to_string(),
            },
            sqlstate: Some(db.code().code().to_string()),
        },
        None => DbError::new(match error.source() {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        }),
    }
}

fn type_of(kind: Kind) -> Type {
    match kind {
        Kind::Bool => Type::BOOL,
        Kind::Int2 => Type::INT2,
        Kind::Int4 => Type::INT4,
        Kind::Int8 => Type::INT8,
        Kind::Float8 => Type::FLOAT8,
        Kind::Oid => Type::OID,
        Kind::Text => Type::TEXT,
        Kind::BoolArray => Type::BOOL_ARRAY,
        Kind::Int2Array => Type::INT2_ARRAY,
        Kind::Int8Array => Type::INT8_ARRAY,
        Kind::TextArray => Type::TEXT_ARRAY,
        Kind::UuidArray => Type::UUID_ARRAY,
    }
}

/// The kind a column of `ty` reads as; None for a type the relay does not read. Text-like types
/// read as text, a uuid as its text (formatted here, not by the server's uuid_out), a timestamptz
/// as its microseconds since 2000-01-01 UTC, i64::MIN and i64::MAX for the infinities (its binary
/// form, for outbox_round::time::timestamptz_text): a window's read formatted both in SQL, and
/// that was a fifth of its cost.
fn kind_of(ty: &Type) -> Option<Kind> {
    Some(match *ty {
        Type::UUID => Kind::Text,
        Type::TIMESTAMPTZ => Kind::Int8,
        Type::BOOL => Kind::Bool,
        Type::INT2 => Kind::Int2,
        Type::INT4 => Kind::Int4,
        Type::INT8 => Kind::Int8,
        Type::FLOAT8 => Kind::Float8,
        Type::OID => Kind::Oid,
        Type::TEXT | Type::VARCHAR | Type::NAME | Type::BPCHAR | Type::UNKNOWN => Kind::Text,
        Type::BOOL_ARRAY => Kind::BoolArray,
        Type::INT2_ARRAY => Kind::Int2Array,
        Type::INT8_ARRAY => Kind::Int8Array,
        Type::TEXT_ARRAY | Type::VARCHAR_ARRAY | Type::NAME_ARRAY => Kind::TextArray,
        Type::UUID_ARRAY => Kind::UuidArray,
        _ => return None,
    })
}

fn read_row(row: &postgres::Row, sql: &str) -> Result<Row, DbError> {
    let mut values = Vec::with_capacity(row.len());
    for (at, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let Some(kind) = kind_of(ty) else {
            return Err(DbError::new(format!(
                "column {at} (\"{}\") of `{sql}` has type {} (oid {}), which the relay does not read: cast it in the statement",
                column.name(),
                ty.name(),
                ty.oid()
            )));
        };
        let value = match kind {
            Kind::Bool => row.try_get::<_, Option<bool>>(at).map(|v| v.map(Value::Bool)),
            Kind::Int2 => row.try_get::<_, Option<i16>>(at).map(|v| v.map(Value::Int2)),
            Kind::Int4 => row.try_get::<_, Option<i32>>(at).map(|v| v.map(Value::Int4)),
            Kind::Int8 if *ty == Type::TIMESTAMPTZ => {
                row.try_get::<_, Option<RawTimestamptz>>(at).map(|v| v.map(|RawTimestamptz(us)| Value::Int8(us)))
            }
            Kind::Int8 => row.try_get::<_, Option<i64>>(at).map(|v| v.map(Value::Int8)),
            Kind::Float8 => row.try_get::<_, Option<f64>>(at).map(|v| v.map(Value::Float8)),
            Kind::Oid => row.try_get::<_, Option<u32>>(at).map(|v| v.map(Value::Oid)),
            Kind::Text if *ty == Type::UUID => row
                .try_get::<_, Option<RawUuid>>(at)
                .map(|v| v.map(|RawUuid(bytes)| Value::Text(uuid::Uuid::from_bytes(bytes).hyphenated().to_string()))),
            Kind::Text => row.try_get::<_, Option<String>>(at).map(|v| v.map(Value::Text)),
            Kind::BoolArray => row.try_get::<_, Option<Vec<Option<bool>>>>(at).map(|v| v.map(Value::BoolArray)),
            Kind::Int2Array => row.try_get::<_, Option<Vec<Option<i16>>>>(at).map(|v| v.map(Value::Int2Array)),
            Kind::Int8Array => row.try_get::<_, Option<Vec<Option<i64>>>>(at).map(|v| v.map(Value::Int8Array)),
            Kind::TextArray => row.try_get::<_, Option<Vec<Option<String>>>>(at).map(|v| v.map(Value::TextArray)),
            Kind::UuidArray => row.try_get::<_, Option<Vec<Option<RawUuid>>>>(at).map(|v| {
                v.map(|ids| Value::UuidArray(ids.into_iter().map(|id| id.map(|RawUuid(bytes)| bytes)).collect()))
            }),
        };
        let value = value.map_err(|e| DbError::new(format!("column {at} (\"{}\") of `{sql}`: {e}", column.name())))?;
        values.push(value.unwrap_or(Value::Null(kind)));
    }
    Ok(Row::new(values))
}

/// A uuid as its 16 bytes, in the binary format (which is those bytes): no text parsing.
#[derive(Debug, Clone, Copy)]
struct RawUuid([u8; 16]);

impl ToSql for RawUuid {
    fn to_sql(&self, _: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        out.extend_from_slice(&self.0);
        Ok(IsNull::No)
    }

    postgres::types::accepts!(UUID);
    postgres::types::to_sql_checked!();
}

impl<'a> FromSql<'a> for RawUuid {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<RawUuid, Box<dyn Error + Sync + Send>> {
        Ok(RawUuid(raw.try_into().map_err(|_| format!("a uuid of {} bytes", raw.len()))?))
    }

    postgres::types::accepts!(UUID);
}

/// A timestamptz in its binary form: microseconds since 2000-01-01 UTC, the infinities i64::MIN and
/// i64::MAX.
#[derive(Debug, Clone, Copy)]
struct RawTimestamptz(i64);

impl<'a> FromSql<'a> for RawTimestamptz {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<RawTimestamptz, Box<dyn Error + Sync + Send>> {
        let bytes: [u8; 8] = raw.try_into().map_err(|_| format!("a timestamptz of {} bytes", raw.len()))?;
        Ok(RawTimestamptz(i64::from_be_bytes(bytes)))
    }

    postgres::types::accepts!(TIMESTAMPTZ);
}

/// An argument, converted at the call (the statement was prepared with its kind's type).
#[derive(Debug)]
struct Param<'a>(&'a Value);

impl ToSql for Param<'_> {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        match self.0 {
            Value::Null(_) => Ok(IsNull::Yes),
            Value::Bool(v) => v.to_sql(ty, out),
            Value::Int2(v) => v.to_sql(ty, out),
            Value::Int4(v) => v.to_sql(ty, out),
            Value::Int8(v) => v.to_sql(ty, out),
            Value::Float8(v) => v.to_sql(ty, out),
            Value::Oid(v) => v.to_sql(ty, out),
            Value::Text(v) => v.to_sql(ty, out),
            Value::BoolArray(v) => v.to_sql(ty, out),
            Value::Int2Array(v) => v.to_sql(ty, out),
            Value::Int8Array(v) => v.to_sql(ty, out),
            Value::TextArray(v) => v.to_sql(ty, out),
            Value::UuidArray(v) => v.iter().map(|id| id.map(RawUuid)).collect::<Vec<_>>().to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    fn to_sql_checked(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        if *ty != type_of(self.0.kind()) {
            return Err(format!("a {:?} argument where the statement takes {}", self.0.kind(), ty.name()).into());
        }
        self.to_sql(ty, out)
    }
}
