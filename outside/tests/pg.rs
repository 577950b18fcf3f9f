//! PgDatabase, outbox-round's database interface over a client connection, against a real
//! PostgreSQL: every kind of value round-trips through `SELECT $1` (NULLs of each kind too), text-
//! like columns read as text, a column of another type is an error naming it, a server's error
//! carries its SQLSTATE, a transaction rolls back on Err and on a failed statement, and a
//! notification on the wake channel arrives within a deadline.

mod common;

use std::time::Duration;

use common::*;
use outbox_relay::pg::{ConnectOptions, PgDatabase, APPLICATION_NAME, DEFAULT_WAKE_CHANNEL};
use outbox_round::db::{Database, DbError, Kind, Row, Value};

fn database(pg: &Cluster) -> PgDatabase {
    PgDatabase::connect(&url(pg, "postgres", "postgres"), &ConnectOptions::default()).unwrap()
}

fn select_one(db: &mut PgDatabase, sql: &str, args: &[Value]) -> Result<Vec<Row>, DbError> {
    db.transaction(|statements| statements.query(sql, args))
}

fn values() -> Vec<Value> {
    let id = |n: u8| [n; 16];
    vec![
        Value::Bool(true),
        Value::Int2(-7),
        Value::Int4(i32::MAX),
        Value::Int8(i64::MIN),
        Value::Float8(2.5),
        Value::Oid(u32::MAX),
        Value::Text("héllo, 'quoted' \"text\"".into()),
        Value::Text(String::new()),
        Value::BoolArray(vec![Some(true), None, Some(false)]),
        Value::Int2Array(vec![Some(1), None, Some(i16::MIN)]),
        Value::Int8Array(vec![Some(i64::MAX), None]),
        Value::Int8Array(vec![]),
        Value::TextArray(vec![Some("a".into()), None, Some("".into())]),
        Value::UuidArray(vec![Some(id(1)), None, Some(id(0xfe))]),
    ]
}

const KINDS: [Kind; 12] = [
    Kind::Bool,
    Kind::Int2,
    Kind::Int4,
    Kind::Int8,
    Kind::Float8,
    Kind::Oid,
    Kind::Text,
    Kind::BoolArray,
    Kind::Int2Array,
    Kind::Int8Array,
    Kind::TextArray,
    Kind::UuidArray,
];

#[test]
fn every_kind_round_trips_through_select_nulls_included() {
    let pg = server();
    let mut db = database(&pg);
    let nulls = KINDS.iter().map(|kind| Value::Null(*kind));
    for value in values().into_iter().chain(nulls) {
        let rows = select_one(&mut db, "SELECT $1", std::slice::from_ref(&value)).unwrap();
        assert_eq!(rows, vec![Row::new(vec![value.clone()])], "SELECT $1 of {value:?}");
    }
    // The same text prepared with other argument types plans again: a NULL keeps its type.
    let rows = select_one(&mut db, "SELECT $1", &[Value::Null(Kind::Int4)]).unwrap();
    assert_eq!(rows[0].get::<i32>(0), Ok(None));
    let rows = select_one(&mut db, "SELECT pg_typeof($1)::text", &[Value::Null(Kind::UuidArray)]).unwrap();
    assert_eq!(rows[0].get::<String>(0), Ok(Some("uuid[]".into())));
    // The uuids cross as their bytes, in the server's order.
    let rows =
        select_one(&mut db, "SELECT ($1::uuid[])[1]::text", &[Value::UuidArray(vec![Some([0x11; 16])])]).unwrap();
    assert_eq!(rows[0].get::<String>(0), Ok(Some("11111111-1111-1111-1111-111111111111".into())));
}

#[test]
fn text_like_columns_read_as_text_and_other_types_are_named() {
    let pg = server();
    let mut db = database(&pg);
    let rows = select_one(&mut db, "SELECT 'v'::varchar, 'n'::name, 'c'::char(2), ARRAY['x'::varchar]", &[]).unwrap();
    assert_eq!(
        rows,
        vec![Row::new(vec![
            Value::Text("v".into()),
            Value::Text("n".into()),
            Value::Text("c ".into()),
            Value::TextArray(vec![Some("x".into())]),
        ])]
    );
    // A uuid reads as its text, a timestamptz as its microseconds since 2000 (the window reads').
    let rows = select_one(
        &mut db,
        "SELECT '11111111-2222-3333-4444-55555555aaaa'::uuid, '2000-01-01 00:00:01.000002+00'::timestamptz, \
                '-infinity'::timestamptz, 'infinity'::timestamptz",
        &[],
    )
    .unwrap();
    assert_eq!(
        rows,
        vec![Row::new(vec![
            Value::Text("11111111-2222-3333-4444-55555555aaaa".into()),
            Value::Int8(1_000_002),
            Value::Int8(i64::MIN),
            Value::Int8(i64::MAX),
        ])]
    );
    let error = select_one(&mut db, "SELECT 1 AS one, 1.5 AS amount", &[]).unwrap_err();
    assert!(error.message.contains("column 1 (\"amount\")"), "{error:?}");
    assert!(error.message.contains("numeric (oid 1700)"), "{error:?}");
    assert!(error.message.contains("cast it in the statement"), "{error:?}");
    assert_eq!(error.sqlstate, None);
    let error = select_one(&mut db, "SELECT '{}'::jsonb AS payload", &[]).unwrap_err();
    assert!(error.message.contains("jsonb (oid 3802)"), "{error:?}");
}

#[test]
fn a_server_error_carries_its_sqlstate_and_the_transaction_rolls_back() {
    let pg = server();
    let mut db = database(&pg);
    let error = select_one(&mut db, "SELECT 1 / $1", &[Value::Int4(0)]).unwrap_err();
    assert_eq!(error.sqlstate.as_deref(), Some("22012"));
    assert_eq!(error.message, "division by zero");
    db.transaction(|s| s.execute("CREATE TABLE public.t (n int)", &[])).unwrap();
    let count = |db: &mut PgDatabase| -> i64 {
        let rows = select_one(db, "SELECT count(*) FROM public.t", &[]).unwrap();
        rows[0].get::<i64>(0).unwrap().unwrap()
    };
    // Err from the body.
    let outcome: Result<(), DbError> = db.transaction(|s| {
        assert_eq!(s.execute("INSERT INTO public.t VALUES ($1)", &[Value::Int4(1)])?, 1);
        Err(DbError::new("the body gave up"))
    });
    assert_eq!(outcome.unwrap_err().message, "the body gave up");
    assert_eq!(count(&mut db), 0);
    // A statement that failed, its error swallowed by the body: still rolled back, and said so.
    let outcome = db.transaction(|s| {
        s.execute("INSERT INTO public.t VALUES ($1)", &[Value::Int4(2)])?;
        let _ = s.execute("INSERT INTO public.t VALUES ($1 / 0)", &[Value::Int4(3)]);
        Ok(())
    });
    assert_eq!(outcome.unwrap_err().sqlstate.as_deref(), Some("22012"));
    assert_eq!(count(&mut db), 0);
    // A failure at commit (a deferred constraint) is the transaction's error.
    db.transaction(|s| {
        s.execute("CREATE TABLE public.u (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)", &[])?;
        s.execute("INSERT INTO public.u VALUES (1)", &[])
    })
    .unwrap();
    let error = db.transaction(|s| s.execute("INSERT INTO public.u VALUES (1)", &[])).unwrap_err();
    assert_eq!(error.sqlstate.as_deref(), Some("23505"));
    // And the connection goes on.
    let n = db.transaction(|s| s.execute("INSERT INTO public.t VALUES ($1)", &[Value::Int4(4)])).unwrap();
    assert_eq!(n, 1);
    assert_eq!(count(&mut db), 1);
}

#[test]
fn a_notification_arrives_within_a_deadline() {
    let pg = server();
    let mut db = database(&pg);
    assert_eq!(db.listening(), [DEFAULT_WAKE_CHANNEL.to_string()]);
    assert_eq!(db.wait_for_notification(Duration::from_millis(20)).unwrap(), None);
    let mut other = pg.connect();
    let (name, address): (String, String) = {
        let row = other
            .query_one(
                "SELECT application_name, client_addr::text FROM pg_stat_activity WHERE pid = $1",
                &[&db.backend_pid()],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(name, APPLICATION_NAME);
    assert!(address.starts_with("127.0.0.1"), "{address}");
    other.execute("SELECT pg_notify($1, '')", &[&DEFAULT_WAKE_CHANNEL]).unwrap();
    let got = db.wait_for_notification(DEADLINE).unwrap();
    assert_eq!(got.as_deref(), Some(DEFAULT_WAKE_CHANNEL));
    // Several, then drained without waiting.
    other.batch_execute("SELECT pg_notify('outbox_pg', '1'); SELECT pg_notify('outbox_pg', '2');").unwrap();
    assert!(db.wait_for_notification(DEADLINE).unwrap().is_some());
    wait_for(DEADLINE, "the second notification", || (db.drain_notifications().unwrap() == 1).then_some(()));
    assert_eq!(db.drain_notifications().unwrap(), 0);
    assert!(!db.is_closed());
    other.execute("SELECT pg_terminate_backend($1)", &[&db.backend_pid()]).unwrap();
    wait_for(DEADLINE, "the relay's connection to be seen closed", || {
        let _ = db.wait_for_notification(Duration::from_millis(10));
        db.is_closed().then_some(())
    });
}
