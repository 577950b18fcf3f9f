//! Moving a database from the in-server relays to outbox-relay and back (issue 37, docs/outside-
//! relay.md, "Decisions"): both kinds claim the same shards, keyed by a backend pid, so the outside
//! relay takes them once the paused workers give them up, and the workers take them back once the
//! outside relay exits. The lease is an hour: each handover must come from a release (a paused
//! worker's, or an exited relay's backend), never from a lease lapsing. Writers go on throughout;
//! every event is published, in order per aggregate, and none twice.
//!
//! outbox-relay is built by scripts/test.sh, which gives its path in OUTBOX_RELAY_BIN.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};

use common::{wait_for, Env, DEADLINE};

fn relay_binary() -> String {
    std::env::var("OUTBOX_RELAY_BIN").expect(
        "OUTBOX_RELAY_BIN names the outbox-relay binary: run the tests with bash scripts/test.sh, which builds it",
    )
}

/// Enqueues `count` events over 6 orders in transactions of 10.
fn enqueue(client: &mut postgres::Client, count: i64) {
    for _ in 0..count / 10 {
        client
            .execute(
                "SELECT outbox_enqueue('order', (n % 6)::text, 'order.placed', jsonb_build_object('n', n))
                   FROM generate_series(1, 10) AS n",
                &[],
            )
            .unwrap();
    }
}

/// How many shards the backends with this application_name hold.
fn shards_held_by(client: &mut postgres::Client, application: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox.shards s JOIN pg_stat_activity a ON a.pid = s.claimed_by
              WHERE a.application_name = $1",
            &[&application],
        )
        .unwrap()
        .get(0)
}

fn shards_held_by_workers(client: &mut postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox.shards s JOIN pg_stat_activity a ON a.pid = s.claimed_by
              WHERE a.backend_type = 'outbox_pg relay'",
            &[],
        )
        .unwrap()
        .get(0)
}

fn set_enabled(client: &mut postgres::Client, on: bool) {
    client.batch_execute(&format!("ALTER SYSTEM SET outbox.enabled = {on}")).unwrap();
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
}

fn terminate(mut child: Child) {
    // SAFETY: kill(2) on the child this test started, which has not been waited for.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = wait_for(DEADLINE, "outbox-relay to exit", || child.try_wait().unwrap());
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_database_moves_to_the_outside_relay_and_back_without_loss_or_duplicates() {
    let env = Env::start(&["outbox.lease = '1h'", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let mut total = 0;
    enqueue(&mut client, 200);
    total += 200;
    env.redis.wait_for_entries("outbox:order", total as usize);

    // To the outside relay: started beside the workers, it gets no shard while they hold them;
    // paused, they give them up.
    let url = format!("postgresql://postgres@127.0.0.1:{}/postgres", env.pg.port);
    let relay = Command::new(relay_binary())
        .args(["--database-url", &url, "--redis-url", &env.redis.url(), "--lease", "1h", "--poll-interval", "100ms"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("outbox-relay starts");
    enqueue(&mut client, 100);
    total += 100;
    set_enabled(&mut client, false);
    enqueue(&mut client, 100);
    total += 100;
    wait_for(DEADLINE, "outbox-relay to hold every shard", || {
        (shards_held_by(&mut client, "outbox-relay") == 16).then_some(())
    });
    enqueue(&mut client, 200);
    total += 200;
    env.redis.wait_for_entries("outbox:order", total as usize);

    // And back: the workers resume, the outside relay exits; its shards go with its backend.
    set_enabled(&mut client, true);
    enqueue(&mut client, 100);
    total += 100;
    terminate(relay);
    wait_for(DEADLINE, "the workers to hold every shard", || (shards_held_by_workers(&mut client) == 16).then_some(()));
    enqueue(&mut client, 100);
    total += 100;
    let entries = env.redis.wait_for_entries("outbox:order", total as usize);
    common::wait_drained(&mut client);

    let ids: Vec<&String> = entries.iter().map(|entry| &entry["event_id"]).collect();
    let distinct: HashSet<&String> = ids.iter().copied().collect();
    assert_eq!(distinct.len() as i64, total, "every event published");
    assert_eq!(ids.len(), distinct.len(), "none published twice");
    let mut next: HashMap<&str, i64> = HashMap::new();
    for entry in &entries {
        let seq: i64 = entry["aggregate_seq"].parse().unwrap();
        let expected = next.entry(entry["aggregate_id"].as_str()).or_insert(1);
        assert_eq!(seq, *expected, "order {}: aggregate_seq {seq} where {expected} was due", entry["aggregate_id"]);
        *expected += 1;
    }
}
