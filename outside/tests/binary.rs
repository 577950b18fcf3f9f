//! The `outbox-relay` binary as an outside check runs it (issue 37): `outbox-relay --database-url
//! URL --redis-url URL` against a server that preloads nothing, with the SQL-only install made by
//! its non-superuser owner: it says it is ready, and SIGTERM makes it exit 0. Pointed at a
//! database without the schema it says so in one line, once, however many times it looks, and is
//! ready once the schema is installed. A bad setting exits 2 with its message; no line shows a
//! password.

mod common;

use std::process::Command;

use common::*;
use outbox_testkit::Redis;

const PASSWORD: &str = "s3cret-in-the-url";

/// The database URL with a password (trust authentication ignores it): it must never be shown.
fn url_with_password(pg: &Cluster) -> String {
    format!("postgresql://{OWNER}:{PASSWORD}@127.0.0.1:{}/{DATABASE}", pg.port)
}

/// Transactions committed in `DATABASE`: each readiness check is one.
fn commits(pg: &Cluster) -> i64 {
    pg.connect().query_one("SELECT xact_commit FROM pg_stat_database WHERE datname = $1", &[&DATABASE]).unwrap().get(0)
}

#[test]
fn it_reports_ready_and_exits_0_on_sigterm() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut relay = RelayProcess::start(&["--database-url", &url_with_password(&pg), "--redis-url", &redis.url()]);
    let ready = relay.wait_for_line("LOG:  ready: relaying database \"app\"");
    assert!(ready.contains("as role \"app_owner\"") && ready.contains("channel outbox_pg"), "{ready}");
    // Its backend is there under its name, and it sleeps holding the wake key (a writer would
    // notify it).
    let mut admin = pg.connect();
    wait_for(DEADLINE, "the relay to sleep holding the wake key", || {
        admin
            .query_opt(
                "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                  WHERE a.application_name = 'outbox-relay' AND l.locktype = 'advisory' AND l.granted
                    AND l.mode = 'ExclusiveLock' AND l.objid = (8037766566451159921::bigint & 4294967295)::text::oid",
                &[],
            )
            .unwrap()
            .map(|_| ())
    });
    let status = relay.terminate();
    assert_eq!(status.code(), Some(0), "{status:?}");
    let lines = relay.lines();
    assert!(lines.last().is_some_and(|line| line.ends_with("LOG:  outbox-relay stopped")), "{lines:?}");
    assert!(lines.iter().all(|line| !line.contains(PASSWORD)), "{lines:?}");
    assert!(lines.iter().any(|line| line.contains(&format!("{OWNER}:****@127.0.0.1"))), "{lines:?}");
}

#[test]
fn a_database_without_the_schema_is_reported_once_then_relayed_when_installed() {
    let pg = server();
    owned_database(&pg);
    let url = url(&pg, OWNER, DATABASE);
    let mut relay = RelayProcess::start(&["--database-url", &url, "--poll-interval", "20ms"]);
    let line = relay.wait_for_line("the schema outbox is missing");
    assert!(
        line.contains("WARNING:  database \"app\": the schema outbox is missing; install it: bash scripts/sql-only.sh"),
        "{line}"
    );
    // Ten more looks, and still one line.
    let before = commits(&pg);
    wait_for(DEADLINE, "ten more readiness checks", || (commits(&pg) >= before + 10).then_some(()));
    let missing = relay.lines().iter().filter(|line| line.contains("is missing")).count();
    assert_eq!(missing, 1, "{:?}", relay.lines());
    install_sql_only(&pg);
    relay.wait_for_line("LOG:  ready: relaying database \"app\"");
    assert_eq!(relay.terminate().code(), Some(0));
}

#[test]
fn a_bad_setting_exits_2_naming_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["--database-url", "postgresql:///app", "--batch-size", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr,
        "outbox-relay: invalid value for batch_size: \"0\" (from the flag --batch-size): out of range [1 .. 10000]\n"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["--database-url", "postgresql:///app", "--redis-url", "redis://:hunter2@127.0.0.1:6379"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("redis_password_file") && !stderr.contains("hunter2"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay")).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--poll-interval"));
}

#[test]
fn connection_parameters_no_retry_can_mend_exit_2_at_start() {
    for (url, says) in [
        ("postgresql://app:hunter2@127.0.0.1:5432/app?sslmode=bogus", "invalid sslmode \"bogus\""),
        ("postgresql://app:hunter2@127.0.0.1:5432/app?colour=blue", "unknown option `colour`"),
        ("postgresql://app:hunter2@127.0.0.1:99999/app", "invalid value for option `port`"),
        (
            "host=127.0.0.1 password=hunter2 sslmode=verify-full sslrootcert=/nonexistent/root.crt",
            "/nonexistent/root.crt",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay")).args(["--database-url", url]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.starts_with("outbox-relay: --database-url cannot be used: "), "{url}: {stderr}");
        assert!(stderr.contains(says) && !stderr.contains("hunter2"), "{url}: {stderr}");
    }
}

#[test]
fn an_unreachable_database_is_retried_and_sigterm_still_stops_it() {
    let port = outbox_testkit::free_port();
    let url = format!("postgresql://{OWNER}:{PASSWORD}@127.0.0.1:{port}/{DATABASE}");
    let mut relay = RelayProcess::start(&["--database-url", &url]);
    let line = relay.wait_for_line("cannot connect to");
    assert!(line.contains("WARNING:") && line.ends_with("; retrying"), "{line}");
    assert_eq!(relay.terminate().code(), Some(0));
    let lines = relay.lines();
    assert_eq!(lines.iter().filter(|line| line.contains("cannot connect")).count(), 1, "{lines:?}");
    assert!(lines.iter().all(|line| !line.contains(PASSWORD)), "{lines:?}");
}

/// The pid of the relay's backend once it sleeps holding the wake key, and when its state last
/// changed.
fn sleeping_relay(admin: &mut postgres::Client) -> (i32, String) {
    wait_for(DEADLINE, "the relay to sleep holding the wake key", || {
        admin
            .query_opt(
                "SELECT a.pid, a.state_change::text FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                  WHERE a.application_name = 'outbox-relay' AND a.state = 'idle' AND l.locktype = 'advisory'
                    AND l.granted AND l.mode = 'ExclusiveLock'
                    AND l.objid = (8037766566451159921::bigint & 4294967295)::text::oid",
                &[],
            )
            .unwrap()
            .map(|row| (row.get(0), row.get(1)))
    })
}

#[test]
fn a_writers_commit_wakes_the_sleeping_relay_and_a_lost_connection_is_reconnected() {
    let pg = sql_only_server();
    let mut owner = connect_as(&pg, DATABASE, OWNER);
    owner.batch_execute("CREATE ROLE app_writer LOGIN IN ROLE outbox_writer").unwrap();
    // An hour between polls: only a notification can make it look again within the test.
    let mut relay = RelayProcess::start(&["--database-url", &url(&pg, OWNER, DATABASE), "--poll-interval", "1h"]);
    relay.wait_for_line("LOG:  ready:");
    let mut admin = pg.connect_to(DATABASE);
    let (pid, asleep_since) = sleeping_relay(&mut admin);
    let mut writer = connect_as(&pg, DATABASE, "app_writer");
    writer.batch_execute("SELECT outbox_enqueue('payment', '42', 'payment.created', '{}')").unwrap();
    wait_for(DEADLINE, "the relay to wake at the writer's commit", || {
        let row = admin.query_one("SELECT state_change::text FROM pg_stat_activity WHERE pid = $1", &[&pid]).unwrap();
        (row.get::<_, String>(0) != asleep_since).then_some(())
    });
    // Asleep again, holding the key again.
    sleeping_relay(&mut admin);
    admin.execute("SELECT pg_terminate_backend($1)", &[&pid]).unwrap();
    relay.wait_for_line("was lost; reconnecting");
    wait_for(DEADLINE, "the relay to sleep again on a new connection", || {
        let (again, _) = sleeping_relay(&mut admin);
        (again != pid).then_some(())
    });
    assert_eq!(relay.terminate().code(), Some(0));
    let lines = relay.lines();
    assert_eq!(lines.iter().filter(|line| line.contains("connected to")).count(), 2, "{lines:?}");
}

/// The database's owner may set its default search_path, and the relay may connect as a
/// superuser: none of its statements, the first ones before it pins its settings included, runs a
/// function or a type check the owner put in a schema listed before pg_catalog.
#[test]
fn a_database_default_search_path_runs_nothing_of_the_owners_with_the_relays_rights() {
    let pg = sql_only_server();
    let redis = Redis::start();
    let mut owner = connect_as(&pg, DATABASE, OWNER);
    owner
        .batch_execute(&format!(
            "CREATE SCHEMA evil;
             CREATE TABLE evil.ran (who text, what text);
             GRANT ALL ON SCHEMA evil TO PUBLIC;
             GRANT ALL ON evil.ran TO PUBLIC;
             CREATE FUNCTION evil.trap(what text) RETURNS boolean LANGUAGE sql
                 AS $$ INSERT INTO evil.ran VALUES (current_user, what) RETURNING true $$;
             CREATE DOMAIN evil.text AS pg_catalog.text CHECK (evil.trap('text ' || VALUE));
             CREATE FUNCTION evil.pg_backend_pid() RETURNS integer LANGUAGE sql
                 AS $$ SELECT CASE WHEN evil.trap('pg_backend_pid') THEN 42 END $$;
             CREATE FUNCTION evil.current_database() RETURNS name LANGUAGE sql
                 AS $$ SELECT CASE WHEN evil.trap('current_database') THEN 'app'::name END $$;
             CREATE FUNCTION evil.pg_is_in_recovery() RETURNS boolean LANGUAGE sql
                 AS $$ SELECT NOT evil.trap('pg_is_in_recovery') $$;
             ALTER DATABASE {DATABASE} SET search_path = evil, pg_catalog"
        ))
        .unwrap();
    let relay = start_relay_at(&url(&pg, "postgres", DATABASE), &redis, &[]);
    let connected = relay.wait_for_line("connected to");
    assert!(!connected.contains("backend pid 42"), "{connected}");
    let ran: Vec<(String, String)> = owner
        .query("SELECT who, what FROM evil.ran", &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert!(ran.is_empty(), "ran with the relay's rights: {ran:?}");
    drop(relay);
}
