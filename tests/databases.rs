//! One launcher, many databases: every database where outbox_pg is installed gets its own relays,
//! started by `CREATE EXTENSION` without a restart and stopped by `DROP EXTENSION` and `DROP
//! DATABASE`; each has its own settings, stats and relays; a worker-slot shortage is logged and
//! shown. Real PostgreSQL clusters and a real redis-server, waits with deadlines.

mod common;

use common::{wait_for, Cluster, Redis, DEADLINE};

fn count(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// Relays connected to `database`, as pg_stat_activity shows them.
fn relays_in(admin: &mut postgres::Client, database: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay' AND datname = $1",
            &[&database],
        )
        .unwrap()
        .get(0)
}

fn wait_relays_in(admin: &mut postgres::Client, database: &str, expected: i64) {
    wait_for(DEADLINE, &format!("{expected} relays in database {database}"), || {
        (relays_in(admin, database) == expected).then_some(())
    });
}

fn enqueue(client: &mut postgres::Client, aggregate_type: &str, aggregate_id: i32) {
    client.execute("SELECT outbox_enqueue($1, $2::int::text, 'e', '{}')", &[&aggregate_type, &aggregate_id]).unwrap();
}

#[test]
fn every_database_with_the_extension_gets_its_own_relays_settings_and_stats() {
    let redis = Redis::start();
    let pg = Cluster::start(redis.port, &["outbox.workers = 2", "outbox.poll_interval = '200ms'"]);
    let mut admin = pg.connect();
    for database in ["shop", "billing", "plain"] {
        admin.batch_execute(&format!("CREATE DATABASE {database}")).unwrap();
    }
    // Per-database settings: billing's events go to their own streams.
    admin.batch_execute("ALTER DATABASE billing SET outbox.stream = 'billing:{aggregate_type}'").unwrap();
    let mut shop = pg.connect_to("shop");
    let mut billing = pg.connect_to("billing");
    shop.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    billing.batch_execute("CREATE EXTENSION outbox_pg").unwrap();

    // No restart: both get outbox.workers relays each, and deliver.
    wait_relays_in(&mut admin, "shop", 2);
    wait_relays_in(&mut admin, "billing", 2);
    for id in 0..20 {
        enqueue(&mut shop, "order", id);
        enqueue(&mut billing, "invoice", id);
    }
    let orders = redis.wait_for_entries("outbox:order", 20);
    let invoices = redis.wait_for_entries("billing:invoice", 20);
    assert_eq!(redis.xlen("outbox:invoice"), 0, "billing's own stream template applies to its relays");
    for (entries, kind) in [(&orders, "order"), (&invoices, "invoice")] {
        // Twenty aggregates, so in no particular order across them.
        let mut ids: Vec<i32> = entries.iter().map(|entry| entry["aggregate_id"].parse().unwrap()).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..20).collect::<Vec<_>>(), "{kind}");
    }

    // Each database reports its own relays and counts.
    for client in [&mut shop, &mut billing] {
        wait_for(DEADLINE, "published_total to count the database's own events", || {
            (count(client, "SELECT published_total FROM outbox.stats") == 20).then_some(())
        });
        assert_eq!(count(client, "SELECT workers::bigint FROM outbox.stats"), 2);
        assert_eq!(count(client, "SELECT count(*) FROM outbox.relays()"), 2);
    }
    // A database without the extension has no relay left connected to it (the probe exited).
    wait_relays_in(&mut admin, "plain", 0);
    wait_relays_in(&mut admin, "postgres", 0);

    // CREATE EXTENSION in a third database starts its relays at once.
    let mut plain = pg.connect_to("plain");
    plain.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    enqueue(&mut plain, "note", 1);
    redis.wait_for_entries("outbox:note", 1);
    wait_relays_in(&mut admin, "plain", 2);

    // A changed database setting applies after a reload: the relays start again with it.
    admin.batch_execute("ALTER DATABASE plain SET outbox.stream = 'plain:{aggregate_type}'").unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    wait_for(DEADLINE, "plain's relays to restart with the new setting", || {
        pg.log().contains("the settings of database \"plain\" changed").then_some(())
    });
    drop(plain);
    let mut plain = pg.connect_to("plain");
    enqueue(&mut plain, "note", 2);
    let moved = redis.wait_for_entries("plain:note", 1);
    assert_eq!(moved[0]["aggregate_id"], "2");
    assert_eq!(redis.xlen("outbox:note"), 1, "event 2 was published once, to the new stream");

    // DROP EXTENSION stops that database's relays and leaves the others running.
    shop.batch_execute("SET statement_timeout = '30s'; DROP EXTENSION outbox_pg").unwrap();
    wait_relays_in(&mut admin, "shop", 0);
    assert!(pg.log().contains("extension outbox_pg was dropped from database \"shop\""), "{}", pg.log());
    enqueue(&mut billing, "invoice", 20);
    redis.wait_for_entries("billing:invoice", 21);

    // A plain DROP DATABASE succeeds: the relays step aside and are not started again.
    drop(billing);
    admin.batch_execute("SET statement_timeout = '30s'").unwrap();
    admin.batch_execute("DROP DATABASE billing").unwrap();
    wait_relays_in(&mut admin, "billing", 0);
    // And CREATE EXTENSION again brings shop's relays back.
    shop.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    enqueue(&mut shop, "order", 20);
    redis.wait_for_entries("outbox:order", 21);
    wait_relays_in(&mut admin, "shop", 2);
    let log = pg.log();
    assert!(!log.contains("FATAL:  database \"billing\" does not exist"), "crash loop:\n{log}");
}

#[test]
fn too_few_worker_slots_are_logged_once_and_shown_in_the_stats_while_the_running_relay_delivers() {
    let redis = Redis::start();
    // The logical replication launcher takes one slot, outbox_pg's launcher another: one is left
    // for the two relays asked for.
    let pg = Cluster::start(
        redis.port,
        &[
            "max_worker_processes = 3",
            "max_parallel_workers = 0",
            "outbox.workers = 2",
            "outbox.poll_interval = '200ms'",
        ],
    );
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    wait_for(DEADLINE, "the launcher to report the missing slot", || {
        pg.log().contains("could not start relay 1 of database \"postgres\": no free background worker slot (max_worker_processes = 3)").then_some(())
    });
    let error: String = wait_for(DEADLINE, "outbox.stats to show the shortfall", || {
        client
            .query_one("SELECT last_error FROM outbox.stats", &[])
            .unwrap()
            .get::<_, Option<String>>(0)
            .filter(|error| error.contains("no free background worker slot"))
    });
    assert!(error.contains("outbox.workers (2) per relayed database"), "{error}");
    assert_eq!(count(&mut client, "SELECT workers::bigint FROM outbox.stats"), 1);
    // The one relay running still delivers everything.
    for id in 0..50 {
        enqueue(&mut client, "scarce", id % 7);
    }
    redis.wait_for_entries("outbox:scarce", 50);
    // The WARNING is logged once per shortage, not at every retry.
    let log = pg.log();
    assert_eq!(log.matches("could not start relay 1 of database").count(), 1, "{log}");
}
