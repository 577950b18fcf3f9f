//! The readiness of a database for a relay outside the server, against real servers: a database
//! without the schema, the SQL-only install made by a non-superuser owner (ready, with the commit
//! wake-up), a schema recording another version, a role lacking USAGE or EXECUTE, and a streaming
//! standby (testkit's `pg_basebackup` standby), each with its one line.

mod common;

use common::*;
use outbox_relay::pg::{ConnectOptions, PgDatabase};
use outbox_relay::readiness::{check, Readiness, RELAY_VERSION};

fn connect(pg: &Cluster, user: &str, database: &str) -> PgDatabase {
    PgDatabase::connect(&url(pg, user, database), &ConnectOptions::default()).unwrap()
}

#[test]
fn a_database_without_the_schema_is_named_with_how_to_install_it() {
    let pg = server();
    owned_database(&pg);
    let mut db = connect(&pg, OWNER, DATABASE);
    let readiness = check(&mut db).unwrap();
    assert_eq!(readiness, Readiness::MissingSchema);
    let line = readiness.message(db.database(), db.role()).unwrap();
    assert!(line.starts_with("database \"app\": the schema outbox is missing"), "{line}");
    assert!(line.contains("bash scripts/sql-only.sh | psql"), "{line}");
}

#[test]
fn the_sql_only_install_by_its_owner_is_ready_with_the_wake_up() {
    let pg = sql_only_server();
    let mut db = connect(&pg, OWNER, DATABASE);
    assert_eq!(
        check(&mut db).unwrap(),
        Readiness::Ready { wake: Some("outbox_pg".into()), version: Some(RELAY_VERSION.into()) }
    );
}

#[test]
fn a_schema_at_another_version_is_named_with_both_versions() {
    let pg = sql_only_server();
    let mut owner = connect_as(&pg, DATABASE, OWNER);
    owner
        .batch_execute("CREATE OR REPLACE FUNCTION outbox._version() RETURNS text LANGUAGE sql AS $$ SELECT '0.2.0' $$")
        .unwrap();
    let mut db = connect(&pg, OWNER, DATABASE);
    let readiness = check(&mut db).unwrap();
    assert_eq!(readiness, Readiness::OtherVersion("0.2.0".into()));
    let line = readiness.message(db.database(), db.role()).unwrap();
    assert!(line.contains("at version 0.2.0, this relay is"), "{line}");
    owner
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION outbox._version() RETURNS text LANGUAGE sql AS $$ SELECT '{RELAY_VERSION}' $$"
        ))
        .unwrap();
    assert_eq!(
        check(&mut db).unwrap(),
        Readiness::Ready { wake: Some("outbox_pg".into()), version: Some(RELAY_VERSION.into()) }
    );
}

#[test]
fn a_role_lacking_a_privilege_is_told_which() {
    let pg = sql_only_server();
    let mut owner = connect_as(&pg, DATABASE, OWNER);
    owner.batch_execute("CREATE ROLE relay_role LOGIN").unwrap();
    let mut db = connect(&pg, "relay_role", DATABASE);
    let readiness = check(&mut db).unwrap();
    assert_eq!(readiness, Readiness::MissingPrivilege(vec!["USAGE on schema outbox".into()]));
    let line = readiness.message(db.database(), db.role()).unwrap();
    assert!(line.contains("role \"relay_role\" lacks USAGE on schema outbox"), "{line}");
    owner.batch_execute("GRANT USAGE ON SCHEMA outbox TO relay_role").unwrap();
    let Readiness::MissingPrivilege(missing) = check(&mut db).unwrap() else { panic!("still lacking EXECUTE") };
    assert!(missing.contains(&"EXECUTE on outbox._claim_shards(integer,integer,integer)".to_string()), "{missing:?}");
    assert!(missing.iter().all(|what| what.starts_with("EXECUTE on outbox.")), "{missing:?}");
    owner
        .batch_execute("GRANT EXECUTE ON FUNCTION outbox._claim_shards(integer,integer,integer) TO relay_role")
        .unwrap();
    let Readiness::MissingPrivilege(fewer) = check(&mut db).unwrap() else { panic!("still lacking others") };
    assert_eq!(fewer.len(), missing.len() - 1);
    // What the owner may give (since PostgreSQL 16 a CREATEROLE role may not grant itself, having
    // no ADMIN option on its own role): EXECUTE on every function of the schema.
    owner.batch_execute("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO relay_role").unwrap();
    assert!(check(&mut db).unwrap().is_ready());
}

#[test]
fn a_standby_is_never_ready() {
    let pg = sql_only_server();
    let standby = pg.standby();
    pg.wait_replayed_by(&standby);
    let mut db = connect(&standby, OWNER, DATABASE);
    assert!(db.in_recovery().unwrap());
    let readiness = check(&mut db).unwrap();
    assert_eq!(readiness, Readiness::Standby);
    let line = readiness.message(db.database(), db.role()).unwrap();
    assert!(line.contains("the server is a standby"), "{line}");
}
