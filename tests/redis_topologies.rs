//! The relay against Redis Sentinel and Redis Cluster, every server a real process started here:
//! a master killed mid-drain behind Sentinel; a Cluster master killed and a slot migrated (ASK,
//! then MOVED) mid-drain; a standalone relay pointed at a cluster node. Each drain ends with the
//! invariant checker: nothing lost, duplicates only where the README says, order per aggregate.

mod common;

use common::*;

/// Producers spread over six streams, so that a cluster's three masters all get some.
fn spread_workload() -> Workload {
    Workload {
        aggregate_types: vec!["order", "payment", "invoice", "refund", "customer", "shipment"],
        max_txns: 1_000_000,
        max_time: std::time::Duration::from_secs(150),
        ..Workload::default()
    }
}

/// The relay's Redis user in a cluster, with the least privileges the README lists for cluster
/// mode (password `relay-pw`).
fn relay_user() -> Vec<&'static str> {
    [RELAY_ACL_USER, &["+wait", "+cluster|slots", "+asking"]].concat()
}

fn relay_settings(url: &str, mode: &str) -> Vec<String> {
    vec![
        "shared_preload_libraries = 'outbox_pg'".into(),
        format!("outbox.redis_url = '{url}'"),
        format!("outbox.redis_mode = '{mode}'"),
        format!("outbox.redis_sentinel_master = '{SENTINEL_MASTER}'"),
        // A batch counts once the replica has it: the failover must not lose acknowledged entries.
        "outbox.redis_wait_replicas = 1".into(),
        "outbox.redis_timeout = '2s'".into(),
        "outbox.poll_interval = '200ms'".into(),
        "outbox.workers = 2".into(),
    ]
}

#[test]
fn a_sentinel_failover_mid_drain_loses_nothing_and_the_relay_follows_the_new_master() {
    let mut sentinels = SentinelSet::start();
    let pg = Cluster::start_with(&relay_settings(&sentinels.url(), "sentinel"));
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let ledger = SharedLedger::default();
    let producers = Producers::start(pg.port, spread_workload(), ledger.clone());
    producers.wait_for_commits(100);
    let old_master = sentinels.master.port;
    wait_for(DEADLINE, "the relay to publish to the first master", || {
        (sentinels.master.total_entries() > 0).then_some(())
    });

    sentinels.fail_over();
    assert_ne!(sentinels.master.port, old_master);
    producers.wait_for_commits(150);
    producers.stop();

    let report = check_invariants("sentinel failover", &pg, &sentinels, &ledger, Expect { duplicates: true });
    assert!(report.delivered > 0);
    let log = pg.log();
    assert!(log.contains("cannot publish to Redis at master \"outbox\" of sentinels"), "{log}");
    assert!(log.contains("publishing to Redis at master \"outbox\" of sentinels"), "{log}");
}

#[test]
fn a_cluster_master_killed_and_a_slot_migrated_mid_drain_lose_nothing() {
    let mut cluster = RedisCluster::start();
    cluster.add_user(&relay_user());
    let pg = Cluster::start_with(&relay_settings(&cluster.seed_url("relay:relay-pw@", 2), "cluster"));
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let ledger = SharedLedger::default();
    let producers = Producers::start(pg.port, spread_workload(), ledger.clone());
    producers.wait_for_commits(100);
    // The streams are spread over the masters.
    wait_for(DEADLINE, "entries on every master", || {
        let topology = cluster.topology()?;
        topology
            .iter()
            .filter(|node| node.master && !node.slots.is_empty())
            .all(|node| cluster.nodes.iter().any(|n| n.port == node.port && n.total_entries() > 0))
            .then_some(())
    });

    // A master dies: its replica takes over, the relay follows the new slot map.
    let payment_slot = cluster.key_slot("outbox:payment");
    cluster.fail_over(payment_slot);
    producers.wait_for_commits(100);

    // A slot migrates: while it is migrating, the old owner answers ASK for the moved stream; the
    // relay must ask the new owner, which then holds entries the old one never had.
    let order_slot = cluster.key_slot("outbox:order");
    let before = cluster.master_of(order_slot).port;
    let target = cluster.migrate_slot(order_slot, |target| {
        let moved = cluster.entries_at(target, "outbox:order").len();
        wait_for(DEADLINE, "entries written to the migrating slot's new owner (ASK followed)", || {
            (cluster.entries_at(target, "outbox:order").len() > moved + 5).then_some(())
        });
    });
    assert_ne!(before, target);
    assert_eq!(cluster.master_of(order_slot).port, target);
    producers.wait_for_commits(100);
    producers.stop();

    let report =
        check_invariants("cluster failover and migration", &pg, &cluster, &ledger, Expect { duplicates: true });
    assert!(report.delivered > 0);
    assert_eq!(cluster.keys_in_slot_at(before, order_slot), 0, "the old owner kept no copy of the stream");
}

#[test]
fn a_standalone_relay_pointed_at_a_cluster_node_says_so_and_fails_no_event() {
    let cluster = RedisCluster::start();
    // A stream whose slot the first node does not serve: MOVED.
    let first = cluster.nodes[0].port;
    let stream = (0..)
        .map(|n| format!("outbox:t{n}"))
        .find(|key| cluster.master_of(cluster.key_slot(key)).port != first)
        .unwrap();
    let pg = Cluster::start(first, &["outbox.poll_interval = '200ms'", "outbox.max_attempts = 1"]);
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let aggregate_type = stream.trim_start_matches("outbox:");
    client.execute("SELECT outbox_enqueue($1, 1, 'e', '{}')", &[&aggregate_type]).unwrap();
    let error = wait_for_failed_rounds(&mut client, 2, "rounds refused with MOVED");
    assert!(error.contains("it is a Redis Cluster node; set outbox.redis_mode = cluster"), "{error}");
    assert_eq!(
        client.query_one("SELECT failed FROM outbox.stats", &[]).unwrap().get::<_, i64>(0),
        0,
        "a redirection is not the event's fault"
    );

    // Switched to cluster mode, the same relay delivers it.
    pg.set(&mut client, &[("outbox.redis_mode", "cluster")]);
    wait_drained(&mut client);
    let delivered = cluster.entries_at(cluster.master_of(cluster.key_slot(&stream)).port, &stream);
    assert_eq!(delivered.len(), 1);
}

/// Issue 28: `outbox.redis_url` takes the sentinels or a cluster's nodes as comma-separated full
/// URLs, each with its own credentials, the form other Redis clients take (the compact
/// `redis://h1:1,h2:2` of the tests above works as well). A list with a part that does not parse
/// is a Redis-wide failure whose error names that part; nothing is dead-lettered.
#[test]
fn the_relay_takes_sentinels_and_cluster_nodes_as_full_urls_and_names_a_bad_part() {
    let sentinels = SentinelSet::start();
    let compact = sentinels.url();
    let full: Vec<String> = compact["redis://".len()..].split(',').map(|node| format!("redis://{node}")).collect();
    assert!(full.len() > 1, "{compact}");
    let pg = Cluster::start_with(&relay_settings(&full.join(","), "sentinel"));
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    client.execute("SELECT outbox_enqueue('order', 1, 'e', '{}')", &[]).unwrap();
    wait_drained(&mut client);
    assert_eq!(sentinels.master.entries("outbox:order").len(), 1);

    let mut cluster = RedisCluster::start();
    cluster.add_user(&relay_user());
    let urls = cluster.full_urls("relay:relay-pw@");
    assert!(urls.matches("redis://relay:relay-pw@").count() > 1, "{urls}");
    pg.set(&mut client, &[("outbox.redis_mode", "cluster"), ("outbox.redis_url", &urls)]);
    wait_for(DEADLINE, "the relays to publish to the cluster after the reload", || {
        pg.log().contains("after the reload, Redis is cluster").then_some(())
    });
    let streams = ["order", "payment", "invoice", "refund", "customer", "shipment"];
    for aggregate_type in streams {
        client.execute("SELECT outbox_enqueue($1, 2, 'e', '{}')", &[&aggregate_type]).unwrap();
    }
    wait_drained(&mut client);
    for aggregate_type in streams {
        let stream = format!("outbox:{aggregate_type}");
        let master = cluster.master_of(cluster.key_slot(&stream)).port;
        assert_eq!(cluster.entries_at(master, &stream).len(), 1, "{stream}");
    }

    // A node of the list that does not parse: the error names it, by position, without secrets.
    let bad = format!("{urls},redis://relay:relay-pw@127.0.0.1:notaport");
    pg.set(&mut client, &[("outbox.redis_url", &bad)]);
    wait_for(DEADLINE, "the relays to take the malformed list", || {
        pg.log().contains("Redis is cluster 127.0.0.1:notaport (invalid outbox.redis_url)").then_some(())
    });
    client.execute("SELECT outbox_enqueue('order', 3, 'e', '{}')", &[]).unwrap();
    let nodes = bad.matches("redis://").count();
    let error = wait_for_failed_rounds(&mut client, 1, "rounds refused for the malformed list");
    assert!(error.contains(&format!("(node {nodes} of {nodes})")) && error.contains("127.0.0.1:notaport"), "{error}");
    assert!(!error.contains("relay-pw"), "{error}");
    // An empty part: named as the part of the list it is.
    pg.set(&mut client, &[("outbox.redis_url", &format!("{urls},redis://127.0.0.1:1,,127.0.0.1:2"))]);
    let error = wait_for_failed_rounds(&mut client, 1, "rounds refused for the list with an empty node");
    let part = format!("part {nodes} of {nodes} (\"127.0.0.1:1,,127.0.0.1:2\") has an empty node in its host list");
    assert!(error.contains(&part), "{error}");
    assert_eq!(client.query_one("SELECT failed FROM outbox.stats", &[]).unwrap().get::<_, i64>(0), 0);
    pg.set(&mut client, &[("outbox.redis_url", &urls)]);
    wait_drained(&mut client);
}

/// The Redis matrix is real: with `REDIS_VERSION` set (scripts/test.sh sets it, 7.0 or 8.2), every
/// server the tests start, Sentinel and Cluster nodes included, is that version.
#[test]
fn the_redis_under_test_is_the_version_asked_for() {
    let Ok(asked) = std::env::var("REDIS_VERSION") else { return };
    let prefix = format!("{asked}.");
    let plain = Redis::start();
    let version = plain.info_field("server", "redis_version").expect("INFO server of a plain server");
    assert!(version.starts_with(&prefix), "REDIS_VERSION={asked}, but the plain server is Redis {version}");
    let sentinels = SentinelSet::start();
    for (what, server) in [("Sentinel's master", &sentinels.master), ("Sentinel's replica", &sentinels.replica)] {
        let version = server.info_field("server", "redis_version").expect("INFO server");
        assert!(version.starts_with(&prefix), "REDIS_VERSION={asked}, but the {what} is Redis {version}");
    }
    let sentinel_version = sentinels.sentinel_info_field("server", "redis_version");
    assert!(sentinel_version.starts_with(&prefix), "REDIS_VERSION={asked}, but a sentinel is Redis {sentinel_version}");
}
