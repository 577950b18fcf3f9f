//! Hardening against hostile users and careless operators, each against a real PostgreSQL with the
//! extension preloaded and a real redis-server: secrets never shown, every argument bounded, no
//! lock an unprivileged role can take stalls the relay, UTF-8 databases only, allowed streams and
//! Redis ACLs, one database's truth in its stats, DROP DATABASE, and the small items of the
//! hardening review.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::{status_counts, wait_for, Cluster, Env, Redis, DEADLINE, RELAY_ACL_USER};

fn count(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// The SQLSTATE and message of a statement that must fail.
fn error_of(client: &mut postgres::Client, sql: &str) -> (String, String) {
    let error = client.batch_execute(sql).expect_err(sql);
    let db = error.as_db_error().unwrap_or_else(|| panic!("{sql}: {error}"));
    (db.code().code().to_string(), format!("{} | {}", db.message(), db.hint().unwrap_or("")))
}

/// Connects to `database` as `user` (the test clusters trust every local login).
fn connect_as(pg: &Cluster, user: &str, database: &str) -> postgres::Client {
    postgres::Client::connect(
        &format!("host=127.0.0.1 port={} user={user} dbname={database} connect_timeout=10", pg.port),
        postgres::NoTls,
    )
    .unwrap()
}

/// Restarts the cluster so that `ALTER DATABASE ... SET` applies to the relay (it reads the
/// database's settings when it connects), and connects again.
fn restart_with_database_settings(env: &Env) -> postgres::Client {
    env.pg.pg_ctl_stop("fast");
    env.pg.pg_ctl_start();
    env.pg.connect()
}

/// Everything a role can read about the settings, as one text.
fn every_visible_setting(client: &mut postgres::Client) -> String {
    let mut seen: String =
        client.query_one("SELECT string_agg(s::text, E'\\n') FROM pg_settings s", &[]).unwrap().get(0);
    for sql in [
        "SHOW outbox.redis_url",
        "SELECT current_setting('outbox.redis_url')",
        "SELECT coalesce(string_agg(s::text, E'\\n'), '') FROM pg_settings s WHERE name LIKE 'outbox.%'",
    ] {
        let row = client.query_one(sql, &[]).unwrap();
        seen.push('\n');
        seen.push_str(&row.get::<_, String>(0));
    }
    seen
}

/// A file only the server's OS user may read, as `outbox.redis_password_file` requires.
fn password_file(dir_tag: &str, password: &str) -> String {
    let dir = std::path::PathBuf::from(format!("/tmp/opg-it/pw-{dir_tag}-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join("redis.pw");
    fs::write(&path, format!("{password}\n")).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let status = Command::new("chown").arg("postgres:postgres").arg(&path).status().unwrap();
        assert!(status.success());
    }
    path.display().to_string()
}

#[test]
fn the_redis_password_is_never_shown_to_monitoring_roles_in_logs_or_in_rows() {
    // Generated secrets hold URL-reserved characters; written raw into the URL, it does not parse.
    let secret = "S3cr/et?x#y";
    let redis = Redis::start_with(&["--requirepass", secret]);
    let pg = Cluster::start(redis.port, &[&format!("outbox.redis_url = 'redis://:{secret}@127.0.0.1:{}'", redis.port)]);
    let mut admin = pg.connect();
    admin.batch_execute("CREATE EXTENSION outbox_pg; CREATE ROLE watcher LOGIN IN ROLE pg_monitor").unwrap();
    admin.batch_execute("SELECT outbox_enqueue('secret', 1, 'e', '{}')").unwrap();
    wait_for(DEADLINE, "the relay to report the unusable URL", || {
        let error: Option<String> = admin.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
        error.filter(|e| e.contains("not a valid Redis URL"))
    });
    wait_for(DEADLINE, "the outage WARNING", || pg.log().contains("cannot publish to Redis at").then_some(()));

    // The fragments a leak would show: the whole secret or any piece of it around the reserved
    // characters, raw or percent-encoded.
    let fragments = ["S3cr", "et?x", "x#y", "S3cr%2F"];
    let assert_hidden = |what: &str, text: &str| {
        for fragment in fragments {
            assert!(!text.contains(fragment), "{what} shows the secret ({fragment}):\n{text}");
        }
    };
    let mut watcher = connect_as(&pg, "watcher", "postgres");
    assert_hidden("what pg_monitor reads", &every_visible_setting(&mut watcher));
    assert_hidden("what a superuser reads", &every_visible_setting(&mut admin));
    let shown: String = watcher.query_one("SHOW outbox.redis_url", &[]).unwrap().get(0);
    assert_eq!(shown, format!("redis://:****@127.0.0.1:{}", redis.port));
    let stats: String = watcher.query_one("SELECT s::text FROM outbox.stats s", &[]).unwrap().get(0);
    assert_hidden("outbox.stats", &stats);
    let rows: String =
        admin.query_one("SELECT string_agg(m::text, E'\\n') FROM outbox.messages m", &[]).unwrap().get(0);
    assert_hidden("outbox.messages", &rows);
    assert!(pg.log().contains(&format!("127.0.0.1:{} (invalid outbox.redis_url)", redis.port)), "{}", pg.log());

    // Percent-encoded, the same secret works; it is still shown nowhere.
    pg.set(&mut admin, &[("outbox.redis_url", &format!("redis://:S3cr%2Fet%3Fx%23y@127.0.0.1:{}", redis.port))]);
    redis.wait_for_entries("outbox:secret", 1);
    admin.batch_execute("SELECT outbox_enqueue('secret', 2, 'e', '{}')").unwrap();
    redis.wait_for_entries("outbox:secret", 2);
    assert_hidden("what pg_monitor reads", &every_visible_setting(&mut watcher));
    assert_hidden("the server log", &pg.log());

    // The `@` forgotten (found by attack): the password then stands where the host does, and the
    // relay showed that "location" in its log lines, its error and SHOW, as PostgreSQL's reload
    // line did. Nothing of the location is shown now.
    let typo = "Forg0tAtSign";
    pg.set(&mut admin, &[("outbox.redis_url", &format!("redis://:{typo}127.0.0.1:{}/1", redis.port))]);
    wait_for(DEADLINE, "the relay to take the URL without its @", || {
        pg.log().contains("Redis is **** (invalid outbox.redis_url)").then_some(())
    });
    admin.batch_execute("SELECT outbox_enqueue('secret', 3, 'e', '{}')").unwrap();
    wait_for(DEADLINE, "the relay to report the unusable URL", || {
        let error: Option<String> = admin.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
        error.filter(|e| e.contains("not a valid Redis URL"))
    });
    let shown: String = watcher.query_one("SHOW outbox.redis_url", &[]).unwrap().get(0);
    assert_eq!(shown, "redis://****");
    for (what, text) in [
        ("what pg_monitor reads", every_visible_setting(&mut watcher)),
        ("outbox.stats", watcher.query_one("SELECT s::text FROM outbox.stats s", &[]).unwrap().get(0)),
        ("the server log", pg.log()),
    ] {
        assert!(!text.contains(typo), "{what} shows the password typed without its @:\n{text}");
    }
}

/// Review of issue 28, 10b: the log hook ended a URL at the first quote or blank, so statements
/// logged by log_statement kept passwords holding `'`, `"` or a space, and `?pass=` values; a
/// failing ALTER ROLE too (its statement is logged before it fails).
#[test]
fn passwords_with_quotes_blanks_or_in_pass_parameters_stay_out_of_the_log() {
    let redis = Redis::start();
    let pg = Cluster::start(redis.port, &["log_statement = 'all'", "log_min_error_statement = 'error'"]);
    let mut admin = pg.connect();
    admin.batch_execute("CREATE ROLE nobody LOGIN").unwrap();
    let secrets = ["Qu'ote1", "Dq\"uote2", "Dq\"uote3", "Sp ace4", "S3cretUnix5", "Pw\"d 6"];
    admin.batch_execute("ALTER SYSTEM SET outbox.redis_url = 'redis://app:Qu''ote1@127.0.0.1:1'").unwrap();
    admin.batch_execute("SET outbox.redis_url = 'redis://app:Dq\"uote2@127.0.0.1:1'").unwrap();
    let refused = admin.batch_execute("ALTER ROLE nobody SET outbox.redis_url = 'redis://:Dq\"uote3@127.0.0.1:1'");
    assert!(refused.is_err(), "a per-role password is refused");
    let failed = admin.batch_execute("SELECT 'redis://app:Sp ace4@127.0.0.1:1'::text AS x, 1/0");
    assert!(failed.is_err());
    let refused = admin
        .batch_execute("ALTER ROLE nobody SET outbox.redis_url = 'redis+unix:///tmp/r.sock?db=0&pass=S3cretUnix5'");
    assert!(refused.is_err(), "a socket URL's pass= is refused per role");
    admin.batch_execute("SET outbox.redis_url = 'redis://h:1/0?password=Pw\"d 6'").unwrap();
    admin.batch_execute("ALTER SYSTEM RESET outbox.redis_url").unwrap();
    admin.batch_execute("SELECT 'logged after the others'").unwrap();
    wait_for(DEADLINE, "the last statement in the log", || pg.log().contains("logged after the others").then_some(()));
    let log = pg.log();
    assert!(log.contains("statement: SET outbox.redis_url = 'redis://app:****@127.0.0.1:1'"), "{log}");
    for secret in secrets {
        assert!(!log.contains(secret), "the server log shows {secret}:\n{log}");
    }
    for fragment in ["ote1", "uote2", "uote3", "ace4", "Unix5", "d 6"] {
        assert!(!log.contains(fragment), "the server log shows {fragment}:\n{log}");
    }
}

/// Enqueues small events around one too large for a Redis whose `proto-max-bulk-len` is 1 MB, and
/// checks that the large one is dead-lettered while everything else, its aggregate excepted, flows.
fn an_oversized_event_is_the_events_fault(redis: &Redis, pg: &Cluster) {
    let mut client = pg.connect();
    client
        .batch_execute(
            "SELECT outbox_enqueue('small', i, 'e', '{}') FROM generate_series(1, 5) i;
             SELECT outbox_enqueue('big', 1, 'huge', jsonb_build_object('blob', repeat('x', 1500000)));
             SELECT outbox_enqueue('big', 1, 'after', '{}');
             SELECT outbox_enqueue('small', i, 'e', '{}') FROM generate_series(6, 10) i;",
        )
        .unwrap();
    redis.wait_for_entries("outbox:small", 10);
    let error: String = wait_for(DEADLINE, "the oversized event to be dead-lettered", || {
        let row = client
            .query_one("SELECT status, coalesce(last_error, '') FROM outbox.messages WHERE event_type = 'huge'", &[])
            .unwrap();
        (row.get::<_, String>(0) == "failed").then(|| row.get(1))
    });
    assert!(error.contains("proto-max-bulk-len"), "{error}");
    // Its aggregate's next event waits behind it; Redis stayed usable for everyone else.
    let after: String =
        client.query_one("SELECT status FROM outbox.messages WHERE event_type = 'after'", &[]).unwrap().get(0);
    assert_eq!(after, "pending");
    assert_eq!(redis.xlen("outbox:big"), 0);
    client.batch_execute("SELECT outbox_enqueue('small', 11, 'e', '{}')").unwrap();
    redis.wait_for_entries("outbox:small", 11);
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox.messages WHERE status = 'failed'"), 1);
}

const OVERSIZE_SETTINGS: [&str; 3] =
    ["outbox.max_payload_size = '4MB'", "outbox.max_attempts = 2", "outbox.retry_delay = '10ms'"];

#[test]
fn an_event_too_large_for_redis_is_dead_lettered_and_holds_back_only_its_aggregate() {
    // The relay reads the limit (CONFIG GET proto-max-bulk-len) and refuses the event unsent.
    let env = Env::start_with_redis(&["--proto-max-bulk-len", "1mb"], &OVERSIZE_SETTINGS);
    an_oversized_event_is_the_events_fault(&env.redis, &env.pg);
}

#[test]
fn an_event_too_large_for_redis_is_found_out_even_when_the_limit_cannot_be_read() {
    // A Redis user without CONFIG (ACLs, managed services): the large event goes alone, Redis drops
    // the connection on it, answers a PING right after, so the event, not Redis, is at fault.
    let redis = Redis::start_with(&["--proto-max-bulk-len", "1mb"]);
    redis::cmd("ACL")
        .arg(&["SETUSER", "relay", "on", ">relay-pw", "~*", "+@all", "-config"][..])
        .query::<()>(&mut redis.connection())
        .unwrap();
    let pw = password_file("oversize", "relay-pw");
    let url = format!("outbox.redis_url = 'redis://relay@127.0.0.1:{}'", redis.port);
    let pw_setting = format!("outbox.redis_password_file = '{pw}'");
    let mut settings = vec![url.as_str(), pw_setting.as_str()];
    settings.extend(OVERSIZE_SETTINGS);
    let pg = Cluster::start(redis.port, &settings);
    pg.connect().batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    an_oversized_event_is_the_events_fault(&redis, &pg);
}

#[test]
fn no_lock_an_unprivileged_role_can_take_stalls_the_relay_and_a_waiting_relay_still_exits() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut admin = env.pg.connect();
    admin.batch_execute("CREATE ROLE mallory LOGIN").unwrap();
    let mut mallory = connect_as(&env.pg, "mallory", "postgres");
    // The advisory keys the claim lock used to be, in both forms, held for the whole test.
    mallory
        .batch_execute(
            "SELECT pg_advisory_lock(1869968482, 1);
             SELECT pg_advisory_lock((1869968482::bigint << 32) | 1);
             BEGIN; SELECT pg_advisory_xact_lock(1869968482, 1);",
        )
        .unwrap();
    admin.batch_execute("SELECT outbox_enqueue('flow', i, 'e', '{}') FROM generate_series(1, 20) i").unwrap();
    env.redis.wait_for_entries("outbox:flow", 20);

    // A superuser's session that keeps the shards locked does hold the relays back (they wait at
    // most lock_timeout for a row, then back off)...
    let mut locker = env.pg.connect();
    locker.batch_execute("BEGIN; SELECT shard FROM outbox.shards FOR UPDATE").unwrap();
    let relay = env.pg.relay_pid(&mut admin);
    admin.batch_execute("SELECT outbox_enqueue('flow', 21, 'e', '{}')").unwrap();
    // ...but a relay kept waiting still answers pg_terminate_backend, and its successor delivers
    // once the session lets go.
    admin.query_one("SELECT pg_terminate_backend($1)", &[&relay]).unwrap();
    wait_for(DEADLINE, "the waiting relay to exit", || {
        (count(&mut admin, &format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {relay}")) == 0).then_some(())
    });
    locker.batch_execute("COMMIT").unwrap();
    env.redis.wait_for_entries("outbox:flow", 21);
    mallory.batch_execute("COMMIT").unwrap();
}

#[test]
fn create_extension_refuses_foreign_roles_and_non_utf8_databases() {
    let redis = Redis::start();
    let pg = Cluster::start(redis.port, &[]);
    let mut admin = pg.connect();
    admin.batch_execute("CREATE ROLE outbox_admin LOGIN").unwrap();
    let (code, message) = error_of(&mut admin, "CREATE EXTENSION outbox_pg");
    assert_eq!(code, "42710", "{message}");
    assert!(message.contains("role \"outbox_admin\" already exists and was not created by outbox_pg"), "{message}");
    admin.batch_execute("DROP ROLE outbox_admin; CREATE EXTENSION outbox_pg").unwrap();
    // The roles it created are reused by a second database.
    admin.batch_execute("CREATE DATABASE second").unwrap();
    pg.connect_to("second").batch_execute("CREATE EXTENSION outbox_pg").unwrap();

    admin
        .batch_execute("CREATE DATABASE latin TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'")
        .unwrap();
    let (code, message) = error_of(&mut pg.connect_to("latin"), "CREATE EXTENSION outbox_pg");
    assert_eq!(code, "0A000", "{message}");
    assert!(
        message.contains("uses encoding LATIN1, but outbox_pg needs UTF8") && message.contains("TEMPLATE template0"),
        "{message}"
    );
}

#[test]
fn a_redis_acl_that_denies_one_key_holds_back_only_its_event_and_one_that_denies_xadd_dead_letters_nothing() {
    let redis = Redis::start();
    let mut root = redis.connection();
    redis::cmd("ACL").arg([&["SETUSER"][..], RELAY_ACL_USER].concat()).query::<()>(&mut root).unwrap();
    let pw = password_file("acl", "relay-pw");
    let pg = Cluster::start(
        redis.port,
        &[
            &format!("outbox.redis_url = 'redis://relay@127.0.0.1:{}'", redis.port),
            &format!("outbox.redis_password_file = '{pw}'"),
            "outbox.max_attempts = 2",
            "outbox.retry_delay = '10ms'",
        ],
    );
    let mut client = pg.connect();
    client
        .batch_execute(
            "CREATE EXTENSION outbox_pg;
             SELECT outbox_enqueue('ok', i, 'e', '{}') FROM generate_series(1, 5) i;
             SELECT outbox_enqueue('denied', 1, 'e', '{}', stream => 'private:ledger');
             SELECT outbox_enqueue('denied', 1, 'after', '{}');
             SELECT outbox_enqueue('ok', i, 'e', '{}') FROM generate_series(6, 10) i;",
        )
        .unwrap();
    redis.wait_for_entries("outbox:ok", 10);
    let error: String = wait_for(DEADLINE, "the denied event to be dead-lettered", || {
        let row = client
            .query_one(
                "SELECT status, coalesce(last_error, '') FROM outbox.messages WHERE stream = 'private:ledger'",
                &[],
            )
            .unwrap();
        (row.get::<_, String>(0) == "failed").then(|| row.get(1))
    });
    // Redis 7.0: "... access one of the keys used as arguments"; 8.2: "No permissions to access a key".
    assert!(error.to_lowercase().starts_with("noperm") && error.contains("key"), "{error}");
    let after: String =
        client.query_one("SELECT status FROM outbox.messages WHERE event_type = 'after'", &[]).unwrap().get(0);
    assert_eq!(after, "pending", "the denied event's aggregate waits behind it");

    // A user who may not XADD at all can publish nothing: a Redis-wide failure, never the events'.
    redis::cmd("ACL").arg(&["SETUSER", "relay", "-xadd"][..]).query::<()>(&mut root).unwrap();
    client.batch_execute("SELECT outbox_enqueue('ok', i, 'e', '{}') FROM generate_series(11, 13) i").unwrap();
    wait_for(DEADLINE, "the relay to report the missing permission", || {
        let error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
        error.filter(|e| e.to_lowercase().contains("noperm") && e.contains("xadd"))
    });
    let first: std::time::SystemTime = client.query_one("SELECT last_error_at FROM outbox.stats", &[]).unwrap().get(0);
    wait_for(DEADLINE, "several failed rounds", || {
        let at: std::time::SystemTime = client.query_one("SELECT last_error_at FROM outbox.stats", &[]).unwrap().get(0);
        (at > first).then_some(())
    });
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox.messages WHERE aggregate_id::int > 10 AND (status = 'failed' OR rejections > 0)"), 0);
    redis::cmd("ACL").arg(&["SETUSER", "relay", "+xadd"][..]).query::<()>(&mut root).unwrap();
    redis.wait_for_entries("outbox:ok", 13);
}

#[test]
fn enqueue_is_refused_where_no_relay_runs_and_each_database_reports_its_own_relay() {
    let env = Env::start(&["outbox.databases = 'postgres'"]);
    let mut relayed = env.pg.connect();
    relayed.batch_execute("CREATE DATABASE other").unwrap();
    let mut other = env.pg.connect_to("other");
    other.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let (code, message) = error_of(&mut other, "SELECT outbox_enqueue('x', 1, 'e', '{}')");
    assert_eq!(code, "55000", "{message}");
    assert!(message.contains("relays only database \"postgres\" (outbox.databases), not \"other\""), "{message}");
    assert!(message.contains("add \"other\" to outbox.databases (currently 'postgres')"), "{message}");
    assert_eq!(count(&mut other, "SELECT count(*) FROM outbox.messages"), 0);
    let there: String = other
        .query_one(
            "SELECT concat_ws(',', worker_pid IS NULL, workers, redis_connected, published_total, (SELECT count(*) FROM outbox.relays()))
               FROM outbox.stats",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(there, "t,0,f,0,0");
    relayed.batch_execute("SELECT outbox_enqueue('x', 1, 'e', '{}')").unwrap();
    env.redis.wait_for_entries("outbox:x", 1);
    let here: String = relayed
        .query_one("SELECT concat_ws(',', worker_pid IS NOT NULL, workers, (SELECT count(*) FROM outbox.relays())) FROM outbox.stats", &[])
        .unwrap()
        .get(0);
    assert_eq!(here, "t,1,1");
}

#[test]
fn drop_database_of_the_relayed_database_works_and_the_relay_comes_back() {
    let redis = Redis::start();
    let pg = Cluster::start(redis.port, &["outbox.database = 'app'"]);
    let mut admin = pg.connect();
    admin.batch_execute("CREATE DATABASE app").unwrap();
    let mut app = pg.connect_to("app");
    app.batch_execute("CREATE EXTENSION outbox_pg; SELECT outbox_enqueue('a', 1, 'e', '{}')").unwrap();
    redis.wait_for_entries("outbox:a", 1);
    // The retired setting still works, and says it is retired.
    assert!(
        pg.log().contains("relaying only \"app\" because outbox.database is set; that setting is retired"),
        "{}",
        pg.log()
    );

    // With a client still connected the drop fails, and counts that client only: the relay
    // stepped aside. It comes back and delivers.
    let refused = admin.batch_execute("DROP DATABASE app").unwrap_err();
    let refused = refused.as_db_error().unwrap();
    assert_eq!(refused.code().code(), "55006", "{refused:?}");
    let detail = refused.detail().unwrap_or_default();
    assert!(detail.contains("There is 1 other session using the database"), "{detail}");
    app.batch_execute("SELECT outbox_enqueue('a', 2, 'e', '{}')").unwrap();
    redis.wait_for_entries("outbox:a", 2);

    // Without it, a plain DROP DATABASE succeeds.
    drop(app);
    admin.batch_execute("DROP DATABASE app").unwrap();
    assert!(pg.log().contains("is being dropped, renamed or copied; stepping aside"), "{}", pg.log());

    // And the relay returns with the database.
    admin.batch_execute("CREATE DATABASE app").unwrap();
    let mut app = pg.connect_to("app");
    app.batch_execute("CREATE EXTENSION outbox_pg; SELECT outbox_enqueue('b', 1, 'e', '{}')").unwrap();
    redis.wait_for_entries("outbox:b", 1);
}

#[test]
fn published_total_counts_every_published_event_exactly() {
    let env = Env::start(&["outbox.workers = 2"]);
    let mut client = env.pg.connect();
    for _ in 0..5 {
        client
            .batch_execute("SELECT outbox_enqueue('burst', i % 37, 'e', '{}') FROM generate_series(1, 507) i")
            .unwrap();
    }
    client.batch_execute("SELECT outbox_enqueue('burst', 1, 'e', '{}')").unwrap();
    wait_for(DEADLINE, "every event published", || {
        (status_counts(&mut client).get("published").copied() == Some(2536)).then_some(())
    });
    assert_eq!(count(&mut client, "SELECT published_total FROM outbox.stats"), 2536);
}

#[test]
fn a_settle_never_marks_the_events_of_a_newer_installation() {
    let env = Env::start(&["outbox.redis_timeout = '10s'", "outbox.lease = '30s'"]);
    let mut client = env.pg.connect();
    let mut redis = env.redis.connection();
    // Writes wait in Redis: the relay's round stays open between its claim and its settle.
    redis::cmd("CLIENT").arg(&["PAUSE", "3000", "WRITE"][..]).query::<()>(&mut redis).unwrap();
    client.batch_execute("SELECT outbox_enqueue('old', 1, 'e', '{}')").unwrap();
    wait_for(DEADLINE, "the relay to hold its claim", || {
        (count(&mut client, "SELECT coalesce(sum(claimed), 0)::bigint FROM outbox.relays()") == 1).then_some(())
    });
    // A new installation starts its ids at 1 again, like the event the relay is publishing.
    client.batch_execute("DROP EXTENSION outbox_pg; CREATE EXTENSION outbox_pg").unwrap();
    let new_event: String = client.query_one("SELECT outbox_enqueue('new', 1, 'e', '{}')::text", &[]).unwrap().get(0);
    assert_eq!(count(&mut client, "SELECT id FROM outbox.messages"), 1);
    let entries = env.redis.wait_for_entries("outbox:new", 1);
    assert_eq!(entries[0]["event_id"], new_event);
    assert_eq!(env.redis.xlen("outbox:old"), 1, "the old installation's event was published once");
    wait_for(DEADLINE, "the new event to be marked published", || {
        (status_counts(&mut client).get("published").copied() == Some(1)).then_some(())
    });
}

#[test]
fn relays_keep_their_own_transaction_rules_and_warn_about_a_lease_shorter_than_redis_waits() {
    let env = Env::start(&["outbox.lease = '1s'", "outbox.redis_timeout = '2s'", "outbox.workers = 2"]);
    let mut admin = env.pg.connect();
    // With settings whose names are not all lower case (TimeZone, DateStyle, IntervalStyle): the
    // relay compared pg_settings' names with the catalog's lowered ones, took every such setting
    // for one removed since it connected, and restarted about once a second, publishing nothing
    // (found by attack).
    admin
        .batch_execute(
            "ALTER DATABASE postgres SET default_transaction_isolation = 'serializable';
             ALTER DATABASE postgres SET default_transaction_read_only = on;
             ALTER DATABASE postgres SET timezone = 'Asia/Kathmandu';
             ALTER DATABASE postgres SET datestyle = 'SQL, DMY';
             ALTER DATABASE postgres SET intervalstyle = 'sql_standard';",
        )
        .unwrap();
    drop(admin);
    let mut client = restart_with_database_settings(&env);
    let isolation: String = client.query_one("SHOW default_transaction_isolation", &[]).unwrap().get(0);
    assert_eq!(isolation, "serializable", "the database default applies to sessions");
    client.batch_execute("SET default_transaction_read_only = off").unwrap();
    for _ in 0..4 {
        client
            .batch_execute("SELECT outbox_enqueue('strict', i % 25, 'e', '{}') FROM generate_series(1, 250) i")
            .unwrap();
    }
    wait_for(DEADLINE, "every event published by relays in read committed, read-write transactions", || {
        (status_counts(&mut client).get("published").copied() == Some(1000)).then_some(())
    });
    // Every aggregate's events in order: the first occurrence of each event carries 1, 2, 3, ...
    let mut seen = std::collections::HashSet::new();
    let mut next_seq = std::collections::HashMap::new();
    for entry in env.redis.entries("outbox:strict") {
        if seen.insert(entry["event_id"].clone()) {
            let expected = next_seq.entry(entry["aggregate_id"].clone()).or_insert(1);
            assert_eq!(entry["aggregate_seq"].parse::<i64>().unwrap(), *expected, "{entry:?}");
            *expected += 1;
        }
    }
    assert_eq!(seen.len(), 1000);
    // created_at in UTC, RFC 3339, whatever the database's time zone and date style.
    let created_at = env.redis.entries("outbox:strict")[0]["created_at"].clone();
    assert!(created_at.starts_with("20") && created_at.ends_with('Z') && created_at.contains('T'), "{created_at}");
    assert!(!env.pg.log().contains("was reset while the relay connected"), "{}", env.pg.log());
    assert!(
        env.pg.log().contains("outbox.lease (1.0s) is shorter than twice outbox.redis_timeout (2.0s)"),
        "{}",
        env.pg.log()
    );
}

#[test]
fn a_database_search_path_never_chooses_the_operators_the_relay_runs() {
    // The database's owner may set its default search_path; the relay runs as the bootstrap
    // superuser. An `=` in a schema listed before pg_catalog would win over pg_catalog's for every
    // unqualified comparison of the relay's own statements (a kept claim's `claimed_by = $1`,
    // housekeeping's `state = 'running'`), and run with superuser rights.
    let env = Env::start(&[]);
    let mut admin = env.pg.connect();
    let record = "INSERT INTO evil.calls SELECT a.backend_type, pg_catalog.current_setting('search_path') FROM pg_catalog.pg_stat_activity a \
                  WHERE a.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()";
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA evil;
             CREATE TABLE evil.calls (backend text, search_path text);
             GRANT INSERT ON evil.calls TO PUBLIC;
             CREATE FUNCTION evil.int_eq(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
                 $$BEGIN {record}; RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE FUNCTION evil.text_eq(text, text) RETURNS boolean LANGUAGE plpgsql AS
                 $$BEGIN {record}; RETURN $1 OPERATOR(pg_catalog.=) $2; END$$;
             CREATE OPERATOR evil.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.int_eq);
             CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.text_eq);
             ALTER DATABASE postgres SET search_path = evil, pg_catalog, public;"
        ))
        .unwrap();
    drop(admin);
    let mut client = restart_with_database_settings(&env);
    client.batch_execute("SET search_path = pg_catalog, public").unwrap();
    for _ in 0..20 {
        client.batch_execute("SELECT outbox_enqueue('path', i % 7, 'e', '{}') FROM generate_series(1, 50) i").unwrap();
    }
    wait_for(DEADLINE, "every event published", || {
        (status_counts(&mut client).get("published").copied() == Some(1000)).then_some(())
    });
    // Rounds one after another, each within a kept claim's life of the last (a kept claim's read
    // compares `claimed_by = $1`).
    for n in 1..=5 {
        client.batch_execute("SELECT outbox_enqueue('path', 1, 'e', '{}')").unwrap();
        wait_for(DEADLINE, "the next event published", || {
            (status_counts(&mut client).get("published").copied() == Some(1000 + n)).then_some(())
        });
    }
    // The trap is armed: a session on the database's default path reaches it.
    let mut plain = env.pg.connect();
    plain.batch_execute("SELECT count(*) FROM pg_catalog.pg_class WHERE relname::text = 'pg_class'").unwrap();
    assert!(
        count(&mut client, "SELECT count(*) FROM evil.calls WHERE backend = 'client backend'") > 0,
        "a plain session's comparisons go through the database's search_path"
    );
    let by_relays: String = client
        .query_one(
            "SELECT coalesce(string_agg(DISTINCT backend || ' with search_path ' || search_path, ', '), '') FROM evil.calls WHERE backend LIKE 'outbox_pg%'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(by_relays, "", "the relay ran an operator the database's search_path chose");
}

#[test]
fn a_database_owner_cannot_change_who_the_relay_runs_as() {
    // `ALTER DATABASE ... SET role` and `SET session_authorization` are open to the database's
    // owner and applied to every connection, the relay's too: it then ran as the owner, was refused
    // its own tables, and published nothing until a superuser removed the setting.
    let env = Env::start(&[]);
    let mut admin = env.pg.connect();
    admin.batch_execute("CREATE ROLE owner LOGIN; ALTER DATABASE postgres OWNER TO owner").unwrap();
    let mut owner = connect_as(&env.pg, "owner", "postgres");
    owner
        .batch_execute(
            "ALTER DATABASE postgres SET session_authorization = owner;
             ALTER DATABASE postgres SET role = owner;",
        )
        .unwrap();
    drop((admin, owner));
    let mut client = restart_with_database_settings(&env);
    let became: String = client.query_one("SELECT current_user::text", &[]).unwrap().get(0);
    assert_eq!(became, "owner", "the settings apply to a superuser's connection too");
    client.batch_execute("SET SESSION AUTHORIZATION postgres; SET ROLE NONE").unwrap();
    client.batch_execute("SELECT outbox_enqueue('owned', i, 'e', '{}') FROM generate_series(1, 100) i").unwrap();
    wait_for(DEADLINE, "the events published by a relay that runs as the superuser it connected as", || {
        (status_counts(&mut client).get("published").copied() == Some(100)).then_some(())
    });
    assert!(!env.pg.log().contains("permission denied"), "{}", env.pg.log());
}
