//! pg_dump of a database with published, failed and undelivered events, restored into another
//! cluster whose transaction counter is far lower: the restore rebases the log and the cursors
//! (src/sql/restore.sql), so the new relay publishes exactly the undelivered events, in order,
//! with aggregate_seq continuing; failed events stay failed; nothing published is sent again.

mod common;

use common::{
    enqueue_to, pg_command, publish_and_fail, run, status_counts, status_of, wait_for, Cluster, Env,
    PublishedAndFailed, Redis, DEADLINE,
};

#[test]
fn a_restored_dump_delivers_its_undelivered_events_and_nothing_else() {
    let old = Env::start(&["outbox.max_attempts = 1", "outbox.poll_interval = '50ms'"]);
    let mut client = old.pg.connect();
    // The dumped cluster is far ahead of the new one (a copy of the same template): its txids,
    // and so its cursors, lie in the new cluster's future.
    client
        .batch_execute("DO $$ BEGIN FOR i IN 1..3000 LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$")
        .unwrap();

    // Published: three events of payment 1. Failed: refund 7's event, with its next one behind it.
    let PublishedAndFailed { published: _, poison, behind_poison } = publish_and_fail(&mut client, &old.redis);

    // Undelivered: the relay is switched off, then payment 1 gets two more events, payment 2 one.
    old.pg.set(&mut client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the relay to report it is off", || {
        old.pg.log().contains("outbox.enabled is off").then_some(())
    });
    let undelivered: Vec<String> = vec![
        enqueue_to(&mut client, "payment", "1", None),
        enqueue_to(&mut client, "payment", "2", None),
        enqueue_to(&mut client, "payment", "1", None),
    ];
    let before = status_counts(&mut client);
    assert_eq!(before.get("pending"), Some(&4), "{before:?}"); // three undelivered + the one behind the poison
    assert_eq!(before.get("failed"), Some(&1), "{before:?}");

    let dump = old.pg.dir.join("app.dump");
    let mut pg_dump = pg_command("pg_dump");
    pg_dump
        .args(["-h", "127.0.0.1", "-U", "postgres", "-Fc", "-p"])
        .arg(old.pg.port.to_string())
        .arg("-f")
        .arg(&dump)
        .arg("postgres");
    run(pg_dump, "pg_dump");

    // The new cluster relays database app, into its own Redis.
    let redis = Redis::start();
    let new = Cluster::start(
        redis.port,
        &["outbox.database = 'app'", "outbox.max_attempts = 1", "outbox.poll_interval = '50ms'"],
    );
    new.connect().batch_execute("CREATE DATABASE app").unwrap();
    let mut pg_restore = pg_command("pg_restore");
    pg_restore
        .args(["-h", "127.0.0.1", "-U", "postgres", "--single-transaction", "--exit-on-error", "-d", "app", "-p"])
        .arg(new.port.to_string())
        .arg(&dump);
    run(pg_restore, "pg_restore");
    let mut app = new.connect_to("app");

    // Exactly the undelivered events, each once, in id order, numbered after the dumped counters.
    let entries = redis.wait_for_entries("outbox:payment", 3);
    let ids: Vec<&str> = entries.iter().map(|e| e["event_id"].as_str()).collect();
    assert_eq!(ids, undelivered.iter().map(String::as_str).collect::<Vec<_>>());
    let seqs: Vec<(&str, &str)> =
        entries.iter().map(|e| (e["aggregate_id"].as_str(), e["aggregate_seq"].as_str())).collect();
    assert_eq!(seqs, [("1", "4"), ("2", "1"), ("1", "5")]);
    wait_for(DEADLINE, "the restored undelivered events to show published", || {
        let counts = status_counts(&mut app);
        (counts.get("published") == Some(&6)).then_some(counts)
    });
    // The failed event stays failed and its aggregate waits behind it.
    assert_eq!(status_of(&mut app, &poison), "failed");
    assert_eq!(status_of(&mut app, &behind_poison), "pending");
    let failed: i64 = app.query_one("SELECT failed FROM outbox.stats", &[]).unwrap().get(0);
    assert_eq!(failed, 1);

    // New events after the restore are published, numbering continues.
    let after = enqueue_to(&mut app, "payment", "1", None);
    let entries = redis.wait_for_entries("outbox:payment", 4);
    assert_eq!(entries[3]["event_id"], after);
    assert_eq!(entries[3]["aggregate_seq"], "6");
    // The dead letter can be retried in the new cluster (no poisoned key here): both go, in order.
    assert_eq!(app.query_one("SELECT outbox.retry_failed()", &[]).unwrap().get::<_, i64>(0), 1);
    let refunds = redis.wait_for_entries("outbox:refund", 1);
    let poisoned = redis.wait_for_entries("poisoned", 1);
    assert_eq!(poisoned[0]["event_id"], poison);
    assert_eq!(poisoned[0]["aggregate_seq"], "1");
    assert_eq!(refunds[0]["event_id"], behind_poison);
    assert_eq!(refunds[0]["aggregate_seq"], "2");
    // Nothing was published twice, nothing else reached Redis.
    assert_eq!(redis.total_entries(), 6);
    assert!(new.log().contains("restored outbox rebased"), "{}", new.log());
}
