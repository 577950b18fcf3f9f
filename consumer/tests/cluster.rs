//! The consumer against a real six-node Redis Cluster (three masters, one replica each) started
//! by the test: reading, dedup, acks, dead letters on another node, reclaiming, as a restricted
//! ACL user with a password file; and riding out the SIGKILL of the stream's master.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{
    event_fields, event_id, least_privileges, pending_count, set_user_command, wait_until_for, write_secret, xadd,
    xrange, RedisCluster, TempDir, CLUSTER_DEADLINE, DEADLINE,
};
use outbox_consumer::{Consumer, ConsumerError, Event, Stats};

const GROUP: &str = "billing";
const USER: &str = "outbox-consumer";

/// A stream name whose dead-letter stream `<stream>:dead` lives on another master, so that the
/// test proves dead-lettering across nodes.
fn stream_with_dead_letters_elsewhere(cluster: &RedisCluster) -> String {
    (0..100)
        .map(|n| format!("outbox:order-{n}"))
        .find(|s| cluster.master_port_of(s) != cluster.master_port_of(&format!("{s}:dead")))
        .expect("some stream name whose dead letters hash to another master")
}

/// The README's least privileges for cluster mode, on every node (ACLs are per node), minus
/// `without`.
fn create_restricted_user(cluster: &RedisCluster, stream: &str, password: &str, without: Option<&str>) {
    let rules: Vec<String> =
        least_privileges(stream, GROUP, true).into_iter().filter(|rule| Some(rule.as_str()) != without).collect();
    cluster.on_every_node(&set_user_command(USER, password, &rules));
}

fn poll_until<H>(consumer: &mut Consumer, handler: &mut H, what: &str, done: impl Fn(&Stats) -> bool)
where
    H: FnMut(&Event) -> Result<(), String>,
{
    let deadline = Instant::now() + DEADLINE;
    while !done(&consumer.stats()) {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}; stats {:?}", consumer.stats());
        consumer.poll_once(&mut *handler).expect("poll_once");
    }
}

#[test]
fn cluster_consumer_dedups_acks_dead_letters_and_reclaims_as_a_restricted_user() {
    let cluster = RedisCluster::start();
    let stream = stream_with_dead_letters_elsewhere(&cluster);
    let dead = format!("{stream}:dead");
    let secrets = TempDir::new("secrets");
    let password_file = secrets.path().join("redis-password");
    write_secret(&password_file, "s3cret-pw\n");
    create_restricted_user(&cluster, &stream, "s3cret-pw", None);

    // The user name in the URL (compact seed list), the password from the file only.
    let mut config = cluster.config(&stream, GROUP, "c1");
    config.redis_url = config.redis_url.replacen("redis://", &format!("redis://{USER}@"), 1);
    config.password_file = Some(password_file);
    config.claim_idle_timeout = Duration::from_millis(200);
    config.max_deliveries = 2;
    let mut consumer = Consumer::connect(config.clone()).expect("connect to the cluster");

    let mut admin = cluster.conn();
    // Two entries read by a consumer that then dies: reclaimed by c1.
    for n in 1..=2 {
        xadd(&mut admin, &stream, &event_fields(&event_id(n), n as i64));
    }
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg("ghost")
        .arg("COUNT")
        .arg(2)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query(&mut admin)
        .expect("XREADGROUP as ghost");
    xadd(&mut admin, &stream, &event_fields(&event_id(3), 3));
    xadd(&mut admin, &stream, &event_fields(&event_id(1), 1)); // a copy of a reclaimed one
    let poison = event_id(666);
    let poison_entry = xadd(&mut admin, &stream, &event_fields(&poison, 4));
    xadd(&mut admin, &stream, &[("hello".to_string(), "world".to_string())]); // malformed

    let mut handled: Vec<String> = Vec::new();
    let mut handler = |e: &Event| -> Result<(), String> {
        handled.push(e.event_id.clone());
        if e.event_id == poison {
            Err("poison".to_string())
        } else {
            Ok(())
        }
    };
    poll_until(&mut consumer, &mut handler, "everything handled", |s| {
        s.processed == 3 && s.duplicates == 1 && s.dead_lettered == 2
    });
    let stats = consumer.stats();
    assert!(stats.reclaimed >= 3, "ghost's two entries and the poison's retry: {stats:?}");
    assert_eq!((stats.malformed, stats.handler_errors), (1, 2));
    let mut once: Vec<String> = handled.iter().filter(|id| **id != poison).cloned().collect();
    once.sort();
    assert_eq!(once, vec![event_id(1), event_id(2), event_id(3)], "each good event handled once");
    assert_eq!(pending_count(&mut admin, &stream, GROUP), 0);

    // Dead letters went to their own stream, on another master than the stream.
    assert_ne!(cluster.master_port_of(&stream), cluster.master_port_of(&dead));
    let letters = xrange(&mut admin, &dead);
    assert_eq!(letters.len(), 2);
    let poison_letter = letters.iter().find(|(_, f)| f.get("event_id") == Some(&poison)).expect("poison letter");
    assert_eq!(poison_letter.1["original_id"], poison_entry);
    assert_eq!(poison_letter.1["deliveries"], "2");

    // Dedup keys are hash-tagged with the stream: same slot, "done".
    let key = config.dedup_key(&event_id(1));
    assert_eq!(key, format!("outbox:dedup:{GROUP}:{{{stream}}}:{}", event_id(1)));
    assert_eq!(cluster.key_slot(&key), cluster.key_slot(&stream));
    let state: String = redis::cmd("GET").arg(&key).query(&mut admin).expect("GET");
    assert_eq!(state, "done");

    // A second member of the group sees a late copy as a duplicate.
    let mut other_config = config.clone();
    other_config.consumer_name = "c2".to_string();
    let mut other = Consumer::connect(other_config).expect("connect c2");
    xadd(&mut admin, &stream, &event_fields(&event_id(2), 2));
    let mut never = |_: &Event| -> Result<(), String> { Err("handler called for a duplicate".to_string()) };
    poll_until(&mut other, &mut never, "late copy skipped", |s| s.duplicates == 1);
    assert_eq!(other.stats().handler_errors, 0);

    // Without the password file the URL names a user and no password: refused rather than
    // silently connecting as the default user.
    let mut no_password = config.clone();
    no_password.password_file = None;
    match Consumer::connect(no_password) {
        Err(ConsumerError::InvalidConfig(message)) => assert!(message.contains("no password"), "{message}"),
        Err(other) => panic!("expected InvalidConfig, got {other}"),
        Ok(_) => panic!("connected without a password"),
    }

    // Standalone mode against a cluster node: redirections are not followed, and say why.
    let other_master = cluster.master_port_of(&dead);
    let mut standalone = cluster.config(&stream, GROUP, "c1");
    standalone.redis_mode = outbox_consumer::RedisMode::Standalone;
    standalone.redis_url = format!("redis://127.0.0.1:{other_master}/");
    match Consumer::connect(standalone) {
        Err(error) => {
            assert!(!error.is_transient(), "{error}");
            assert!(error.to_string().contains("use cluster mode"), "{error}");
        }
        Ok(_) => panic!("standalone mode worked on a key of another node"),
    }

    // What cluster mode needs beyond standalone: PING (every node connection is checked with it)
    // and CLUSTER SLOTS (the slot map). ASKING is only sent during a slot migration.
    for missing in ["+ping", "+cluster|slots"] {
        create_restricted_user(&cluster, &stream, "s3cret-pw", Some(missing));
        match Consumer::connect(config.clone()) {
            Err(error) => {
                assert!(!error.is_transient(), "without {missing}: {error}");
                assert!(error.to_string().contains("no permissions"), "without {missing}: {error}");
            }
            Ok(_) => panic!("connected without {missing}: it is not needed"),
        }
    }
}

#[test]
fn consumer_rides_out_the_failover_of_the_streams_master() {
    const EVENTS: u64 = 600;
    let mut cluster = RedisCluster::start();
    let stream = "outbox:order".to_string();
    let mut admin = cluster.conn();
    let add = |conn: &mut redis::cluster::ClusterConnection, range: std::ops::Range<u64>| {
        for n in range {
            xadd(conn, &stream, &event_fields(&event_id(n), n as i64 + 1));
        }
    };
    // The first half before the consumer starts, all of it on the replica before the kill.
    add(&mut admin, 0..EVENTS / 2);
    let master = cluster.master_port_of(&stream);
    let replica = cluster.replica_port_of(master);

    let mut config = cluster.config(&stream, GROUP, "c1");
    config.claim_idle_timeout = Duration::from_millis(500);
    config.batch_size = 10;
    config.reconnect_attempts = 1000;
    // The event_id of every handler call, in call order.
    let calls: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let calls = Arc::clone(&calls);
        let stop = Arc::clone(&stop);
        thread::spawn(move || -> Result<Stats, ConsumerError> {
            let mut consumer = Consumer::connect(config)?;
            consumer.run(
                |e: &Event| -> Result<(), String> {
                    calls.lock().map_err(|_| "poisoned".to_string())?.push(e.event_id.clone());
                    // Slow enough that the kill lands in the middle of the first half.
                    thread::sleep(Duration::from_millis(3));
                    Ok(())
                },
                &stop,
            )?;
            Ok(consumer.stats())
        })
    };
    let handled = || calls.lock().expect("lock").len();
    wait_until_for("consumer under way", DEADLINE, || handled() >= 50);
    cluster.wait_replicated(master);
    cluster.kill(master);
    let calls_at_kill = handled();
    assert!(calls_at_kill < (EVENTS / 2) as usize, "the kill must land mid-consume; raise EVENTS");
    cluster.wait_until_promoted(replica);

    // The second half goes to the promoted replica.
    let mut admin = cluster.conn();
    add(&mut admin, EVENTS / 2..EVENTS);
    let all_handled = || {
        let calls = calls.lock().expect("lock");
        let distinct: std::collections::HashSet<&String> = calls.iter().collect();
        distinct.len() as u64 == EVENTS
    };
    wait_until_for("every event handled after the failover", CLUSTER_DEADLINE, all_handled);
    wait_until_for("nothing left pending", CLUSTER_DEADLINE, || pending_count(&mut admin, &stream, GROUP) == 0);
    stop.store(true, Ordering::SeqCst);
    let stats = worker.join().expect("worker thread").expect("run rode out the failover");

    let calls = calls.lock().expect("lock");
    let mut count: HashMap<&String, usize> = HashMap::new();
    let mut first_call: HashMap<&String, usize> = HashMap::new();
    for (index, id) in calls.iter().enumerate() {
        *count.entry(id).or_default() += 1;
        first_call.entry(id).or_insert(index);
    }
    assert!((0..EVENTS).all(|n| count.contains_key(&event_id(n))), "an event was never handled");
    // The README's windows for a failover: the event whose "done + ack" was cut off by the kill
    // (handled again after its reclaim), and events whose writes the replica had not yet received
    // (the dedup keys lost with the master). Both concern events first handled before the kill;
    // nothing handled after it runs twice.
    for (id, n) in &count {
        if *n > 1 {
            assert!(first_call[id] < calls_at_kill, "{id} handled {n} times but first handled after the kill");
        }
    }
    let duplicated = count.values().filter(|&&n| n > 1).count();
    eprintln!("failover: {stats:?}, handler calls {}, events handled twice {duplicated}", calls.len());
    assert!(stats.reconnects >= 1, "{stats:?}");
}

#[test]
fn cluster_mode_against_a_standalone_server_is_a_clear_error() {
    let server = common::RedisServer::start();
    let mut config = server.config("outbox:order", GROUP, "c1");
    config.redis_mode = outbox_consumer::RedisMode::Cluster;
    match Consumer::connect(config) {
        Err(ConsumerError::InvalidConfig(message)) => assert!(message.contains("not a cluster node"), "{message}"),
        Err(other) => panic!("expected InvalidConfig, got {other}"),
        Ok(_) => panic!("cluster mode connected to a standalone server"),
    }
}

#[test]
fn cluster_over_mutual_tls() {
    let files = common::TlsFiles::generate();
    let cluster = RedisCluster::start_tls(&files);
    assert!(cluster.url().starts_with("rediss://"));
    let stream = stream_with_dead_letters_elsewhere(&cluster);
    let mut admin = cluster.conn();
    xadd(&mut admin, &stream, &event_fields(&event_id(1), 1));
    xadd(&mut admin, &stream, &event_fields(&event_id(1), 1));
    xadd(&mut admin, &stream, &[("hello".to_string(), "world".to_string())]);
    xadd(&mut admin, &stream, &event_fields(&event_id(2), 2));

    let mut consumer = Consumer::connect(cluster.config(&stream, GROUP, "c1")).expect("connect over TLS");
    let mut handled = Vec::new();
    let mut handler = |e: &Event| -> Result<(), String> {
        handled.push(e.event_id.clone());
        Ok(())
    };
    poll_until(&mut consumer, &mut handler, "all handled", |s| {
        s.processed == 2 && s.duplicates == 1 && s.dead_lettered == 1
    });
    assert_eq!(handled, vec![event_id(1), event_id(2)]);
    assert_eq!(pending_count(&mut admin, &stream, GROUP), 0);
    assert_eq!(xrange(&mut admin, &format!("{stream}:dead")).len(), 1, "dead letter on another node, over TLS");

    // Every node verifies the client: without a client certificate the cluster is refused.
    let mut no_cert = cluster.config(&stream, GROUP, "c2");
    no_cert.tls_cert_file = None;
    no_cert.tls_key_file = None;
    match Consumer::connect(no_cert) {
        Err(error) => {
            assert!(!error.is_transient(), "{error}");
            assert!(error.to_string().contains("TLS error"), "{error}");
        }
        Ok(_) => panic!("connected without a client certificate"),
    }
}
