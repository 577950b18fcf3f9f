//! The consumer against a real redis-server: dedup, reclaim, dead-lettering, concurrency,
//! shutdown and reconnection.

mod common;

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{event_fields, event_id, pending_count, pending_ids, wait_until, xadd, xrange, RedisServer, DEADLINE};
use outbox_consumer::{Consumer, ConsumerConfig, ConsumerError, Event, Stats};

const STREAM: &str = "outbox:order";
const GROUP: &str = "billing";

/// Calls `poll_once` until `done(stats)` holds, failing the test after the deadline.
fn poll_until<H, E>(consumer: &mut Consumer, mut handler: H, what: &str, done: impl Fn(&Stats) -> bool)
where
    H: FnMut(&Event) -> Result<(), E>,
    E: std::fmt::Display,
{
    let deadline = std::time::Instant::now() + DEADLINE;
    while !done(&consumer.stats()) {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}; stats {:?}", consumer.stats());
        consumer.poll_once(&mut handler).expect("poll_once");
    }
}

fn ok(_: &Event) -> Result<(), String> {
    Ok(())
}

#[test]
fn redelivered_event_is_processed_once_and_the_copy_acked_as_duplicate() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut consumer = Consumer::connect(server.config(STREAM, GROUP, "c1")).expect("connect");
    // A second member of the same group: the group already exists (BUSYGROUP is tolerated).
    let mut other = Consumer::connect(server.config(STREAM, GROUP, "c2")).expect("connect again");

    let id = event_id(1);
    let first = xadd(&mut conn, STREAM, &event_fields(&id, 1));
    let copy = xadd(&mut conn, STREAM, &event_fields(&id, 1));
    let second = event_id(2);
    xadd(&mut conn, STREAM, &event_fields(&second, 2));

    let mut calls: Vec<(String, String)> = Vec::new();
    poll_until(
        &mut consumer,
        |e: &Event| -> Result<(), String> {
            calls.push((e.event_id.clone(), e.entry_id.clone()));
            Ok(())
        },
        "three entries handled",
        |s| s.processed + s.duplicates == 3,
    );
    assert_eq!(calls, vec![(id.clone(), first), (second, calls[1].1.clone())]);
    let stats = consumer.stats();
    assert_eq!((stats.processed, stats.duplicates, stats.handler_errors), (2, 1, 0));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0, "the duplicate copy {copy} is acknowledged");

    // A copy arriving later, consumed by another member of the group, is a duplicate as well.
    xadd(&mut conn, STREAM, &event_fields(&id, 1));
    poll_until(
        &mut other,
        |_: &Event| -> Result<(), String> { panic!("handler called for a duplicate") },
        "late copy",
        |s| s.duplicates == 1,
    );
    assert_eq!(other.stats().processed, 0);
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
}

#[test]
fn crashed_consumers_pending_entries_are_reclaimed_and_processed() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut config = server.config(STREAM, GROUP, "b");
    config.claim_idle_timeout = Duration::from_millis(200);
    let mut b = Consumer::connect(config).expect("connect");

    let ids: Vec<String> = (1..=3).map(event_id).collect();
    for (seq, id) in ids.iter().enumerate() {
        xadd(&mut conn, STREAM, &event_fields(id, seq as i64 + 1));
    }
    // Consumer "a" reads everything and dies without acknowledging anything.
    {
        let mut a = server.conn();
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("a")
            .arg("COUNT")
            .arg(10)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(">")
            .query(&mut a)
            .expect("XREADGROUP as a");
    }
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 3);

    let mut seen = Vec::new();
    poll_until(
        &mut b,
        |e: &Event| -> Result<(), String> {
            seen.push(e.event_id.clone());
            Ok(())
        },
        "b processes a's entries",
        |s| s.processed == 3,
    );
    assert_eq!(seen, ids);
    assert_eq!(b.stats().reclaimed, 3);
    assert_eq!(b.stats().duplicates, 0);
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
}

#[test]
fn consumer_that_crashed_mid_handler_does_not_make_the_event_a_duplicate() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut config_a = server.config(STREAM, GROUP, "a");
    config_a.claim_idle_timeout = Duration::from_millis(200);
    let mut config_b = config_a.clone();
    config_b.consumer_name = "b".to_string();
    let id = event_id(7);
    xadd(&mut conn, STREAM, &event_fields(&id, 1));

    // "a" takes the dedup key, then its handler dies (a panic stands in for a crash); the
    // in-flight marker is left behind and the entry stays pending.
    let mut a = Consumer::connect(config_a).expect("connect a");
    let crashed = panic::catch_unwind(AssertUnwindSafe(|| {
        a.poll_once(|_: &Event| -> Result<(), String> { panic!("simulated crash inside the handler") })
    }));
    assert!(crashed.is_err());
    drop(a);
    let marker: String = redis::cmd("GET").arg(format!("outbox:dedup:{GROUP}:{id}")).query(&mut conn).expect("GET");
    assert!(marker.starts_with("inflight|"), "{marker}");

    let mut b = Consumer::connect(config_b).expect("connect b");
    let mut handled = 0;
    poll_until(
        &mut b,
        |_: &Event| -> Result<(), String> {
            handled += 1;
            Ok(())
        },
        "b reprocesses the abandoned event",
        |s| s.processed == 1,
    );
    assert_eq!(handled, 1);
    assert_eq!(b.stats().duplicates, 0);
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
    let state: String = redis::cmd("GET").arg(format!("outbox:dedup:{GROUP}:{id}")).query(&mut conn).expect("GET");
    assert_eq!(state, "done");
}

#[test]
fn poison_entry_is_dead_lettered_after_max_deliveries_while_others_are_processed() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut config = server.config(STREAM, GROUP, "c1");
    config.claim_idle_timeout = Duration::from_millis(100);
    config.max_deliveries = 3;
    let mut consumer = Consumer::connect(config).expect("connect");

    let poison = event_id(666);
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    let poison_entry = xadd(&mut conn, STREAM, &event_fields(&poison, 2));
    xadd(&mut conn, STREAM, &event_fields(&event_id(3), 3));

    let mut poison_calls = 0;
    let mut good = Vec::new();
    let mut handler = |e: &Event| -> Result<(), String> {
        if e.event_id == poison {
            poison_calls += 1;
            Err(format!("boom #{poison_calls}"))
        } else {
            good.push(e.event_id.clone());
            Ok(())
        }
    };
    poll_until(&mut consumer, &mut handler, "poison dead-lettered", |s| s.dead_lettered == 1 && s.processed == 2);
    // More polls do not bring it back.
    for _ in 0..5 {
        consumer.poll_once(&mut handler).expect("poll_once");
    }
    assert_eq!(poison_calls, 3);
    assert_eq!(good, vec![event_id(1), event_id(3)]);
    let stats = consumer.stats();
    assert_eq!((stats.handler_errors, stats.dead_lettered, stats.malformed), (3, 1, 0));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);

    let dead = xrange(&mut conn, &format!("{STREAM}:dead"));
    assert_eq!(dead.len(), 1);
    let fields = &dead[0].1;
    assert_eq!(fields["event_id"], poison);
    assert_eq!(fields["payload"], r#"{"seq":2}"#);
    assert_eq!(fields["deliveries"], "3");
    assert_eq!(fields["original_id"], poison_entry);
    assert_eq!(fields["original_stream"], STREAM);
    assert!(fields["error"].contains("boom #3"), "{}", fields["error"]);
    // A later copy of the poison event is not treated as a duplicate: it was never processed.
    let key: Option<String> =
        redis::cmd("GET").arg(format!("outbox:dedup:{GROUP}:{poison}")).query(&mut conn).expect("GET");
    assert_eq!(key, None);
}

#[test]
fn malformed_entries_are_dead_lettered_and_counted() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut consumer = Consumer::connect(server.config(STREAM, GROUP, "c1")).expect("connect");

    let mut not_json = event_fields(&event_id(1), 1);
    not_json.retain(|(k, _)| k != "payload");
    not_json.push(("payload".into(), "{not json".into()));
    let no_event_id: Vec<(String, String)> =
        event_fields(&event_id(2), 2).into_iter().filter(|(k, _)| k != "event_id").collect();
    let mut bad_headers = event_fields(&event_id(3), 3);
    bad_headers.push(("headers".into(), "[1,2]".into()));
    let garbage = vec![("hello".to_string(), "world".to_string())];
    for fields in [&not_json, &no_event_id, &bad_headers, &garbage] {
        xadd(&mut conn, STREAM, fields);
    }
    let mut good = event_fields(&event_id(4), 4);
    good.push(("headers".into(), r#"{"trace":"t-4"}"#.into()));
    xadd(&mut conn, STREAM, &good);

    let mut handled = Vec::new();
    poll_until(
        &mut consumer,
        |e: &Event| -> Result<(), String> {
            handled.push(e.clone());
            Ok(())
        },
        "all entries handled",
        |s| s.processed + s.dead_lettered == 5,
    );
    assert_eq!(handled.len(), 1);
    assert_eq!(handled[0].headers, Some(serde_json::json!({"trace": "t-4"})));
    let stats = consumer.stats();
    assert_eq!((stats.malformed, stats.dead_lettered, stats.handler_errors), (4, 4, 0));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);

    let errors: Vec<String> =
        xrange(&mut conn, &format!("{STREAM}:dead")).into_iter().map(|(_, f)| f["error"].clone()).collect();
    assert_eq!(errors.len(), 4);
    assert!(errors[0].contains("`payload`"), "{}", errors[0]);
    assert!(errors[1].contains("`event_id`"), "{}", errors[1]);
    assert!(errors[2].contains("`headers`"), "{}", errors[2]);
    assert!(errors[3].contains("`event_id`"), "{}", errors[3]);
}

#[test]
fn four_concurrent_consumers_process_each_event_exactly_once() {
    const EVENTS: u64 = 2_000;
    let server = RedisServer::start();
    let mut conn = server.conn();
    let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));

    let add = |conn: &mut redis::Connection, range: std::ops::Range<u64>| {
        let mut pipe = redis::pipe();
        for n in range {
            pipe.cmd("XADD").arg(STREAM).arg("*");
            for (k, v) in event_fields(&event_id(n), n as i64 + 1) {
                pipe.arg(k).arg(v);
            }
            pipe.ignore();
        }
        pipe.exec(conn).expect("XADD batch");
    };
    // Half before the consumers start, half while they run.
    add(&mut conn, 0..EVENTS / 2);

    let workers: Vec<_> = (0..4)
        .map(|i| {
            let config = server.config(STREAM, GROUP, &format!("worker-{i}"));
            let seen = Arc::clone(&seen);
            let stop = Arc::clone(&stop);
            thread::spawn(move || -> Result<Stats, ConsumerError> {
                let mut consumer = Consumer::connect(config)?;
                consumer.run(
                    |e: &Event| -> Result<(), String> {
                        let mut seen = seen.lock().map_err(|_| "poisoned".to_string())?;
                        *seen.entry(e.event_id.clone()).or_default() += 1;
                        Ok(())
                    },
                    &stop,
                )?;
                Ok(consumer.stats())
            })
        })
        .collect();
    add(&mut conn, EVENTS / 2..EVENTS);

    let total = || seen.lock().expect("lock").values().map(|&n| u64::from(n)).sum::<u64>();
    wait_until("all events handled", || total() >= EVENTS);
    stop.store(true, Ordering::SeqCst);
    let stats: Vec<Stats> = workers.into_iter().map(|w| w.join().expect("worker thread").expect("worker")).collect();

    let seen = seen.lock().expect("lock");
    assert_eq!(seen.len() as u64, EVENTS);
    assert!((0..EVENTS).all(|n| seen.get(&event_id(n)) == Some(&1)), "some event was handled twice or never");
    assert_eq!(stats.iter().map(|s| s.processed).sum::<u64>(), EVENTS);
    assert_eq!(stats.iter().map(|s| s.duplicates + s.dead_lettered + s.handler_errors).sum::<u64>(), 0);
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
}

#[test]
fn failed_handler_is_retried_and_the_retry_is_not_a_duplicate() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut config = server.config(STREAM, GROUP, "c1");
    config.claim_idle_timeout = Duration::from_millis(100);
    let mut consumer = Consumer::connect(config).expect("connect");
    let id = event_id(9);
    xadd(&mut conn, STREAM, &event_fields(&id, 1));

    let key = format!("outbox:dedup:{GROUP}:{id}");
    let mut attempts = 0;
    let mut handler = |_: &Event| -> Result<(), String> {
        attempts += 1;
        if attempts == 1 {
            Err("transient failure".to_string())
        } else {
            Ok(())
        }
    };
    poll_until(&mut consumer, &mut handler, "first attempt fails", |s| s.handler_errors == 1);
    // The failure removed the dedup key and left the entry pending for a retry.
    let state: Option<String> = redis::cmd("GET").arg(&key).query(&mut conn).expect("GET");
    assert_eq!(state, None);
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 1);

    poll_until(&mut consumer, &mut handler, "retry succeeds", |s| s.processed == 1);
    assert_eq!(attempts, 2);
    let stats = consumer.stats();
    assert_eq!((stats.handler_errors, stats.duplicates, stats.dead_lettered, stats.reclaimed), (1, 0, 0, 1));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
    let state: String = redis::cmd("GET").arg(&key).query(&mut conn).expect("GET");
    assert_eq!(state, "done");
    let ttl: i64 = redis::cmd("TTL").arg(&key).query(&mut conn).expect("TTL");
    assert!(ttl > 0, "dedup keys expire, got TTL {ttl}");
}

#[test]
fn stop_finishes_the_current_event_acks_it_and_returns() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut consumer = Consumer::connect(server.config(STREAM, GROUP, "c1")).expect("connect");
    let entries: Vec<String> =
        (1..=5).map(|n| xadd(&mut conn, STREAM, &event_fields(&event_id(n), n as i64))).collect();

    let stop = AtomicBool::new(false);
    let mut handled = 0;
    consumer
        .run(
            |_: &Event| -> Result<(), String> {
                handled += 1;
                if handled == 2 {
                    stop.store(true, Ordering::SeqCst);
                }
                Ok(())
            },
            &stop,
        )
        .expect("run");
    assert_eq!(handled, 2);
    assert_eq!(consumer.stats().processed, 2);
    // The two handled entries are acknowledged; the rest of the batch stays pending for a reclaim.
    assert_eq!(pending_ids(&mut conn, STREAM, GROUP), entries[2..].to_vec());
}

#[test]
fn run_with_idle_exit_drains_the_stream_and_returns() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut consumer = Consumer::connect(server.config(STREAM, GROUP, "c1")).expect("connect");
    for n in 1..=3 {
        xadd(&mut conn, STREAM, &event_fields(&event_id(n), n as i64));
    }
    let stop = AtomicBool::new(false);
    consumer.run_with_idle_exit(ok, &stop, Duration::from_millis(200)).expect("run");
    assert_eq!(consumer.stats().processed, 3);
}

#[test]
fn run_reconnects_after_the_server_restarts() {
    let mut server = RedisServer::start();
    let mut config = server.config(STREAM, GROUP, "c1");
    config.reconnect_attempts = 100;
    let stop = Arc::new(AtomicBool::new(false));
    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let worker = {
        let stop = Arc::clone(&stop);
        let handled = Arc::clone(&handled);
        thread::spawn(move || -> Result<Stats, ConsumerError> {
            let mut consumer = Consumer::connect(config)?;
            consumer.run(
                |e: &Event| -> Result<(), String> {
                    handled.lock().map_err(|_| "poisoned".to_string())?.push(e.event_id.clone());
                    Ok(())
                },
                &stop,
            )?;
            Ok(consumer.stats())
        })
    };
    {
        let mut conn = server.conn();
        xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    }
    wait_until("first event handled", || handled.lock().expect("lock").len() == 1);

    // Without persistence the restarted server has neither the stream nor the group.
    server.restart();
    let mut conn = server.conn();
    xadd(&mut conn, STREAM, &event_fields(&event_id(2), 2));
    wait_until("event after restart handled", || handled.lock().expect("lock").len() == 2);
    stop.store(true, Ordering::SeqCst);
    let stats = worker.join().expect("worker thread").expect("run");
    assert_eq!(*handled.lock().expect("lock"), vec![event_id(1), event_id(2)]);
    assert!(stats.reconnects >= 1, "{stats:?}");
}

#[test]
fn connect_rejects_an_invalid_config_and_reports_an_unreachable_server() {
    let mut config = ConsumerConfig::new("redis://127.0.0.1:1/", STREAM, GROUP);
    config.batch_size = 0;
    assert!(
        matches!(Consumer::connect(config.clone()), Err(ConsumerError::InvalidConfig(m)) if m.contains("batch_size"))
    );
    config.batch_size = 10;
    match Consumer::connect(config) {
        Err(e @ ConsumerError::Redis { .. }) => assert!(e.is_transient(), "{e}"),
        Err(other) => panic!("expected a Redis error, got {other}"),
        Ok(_) => panic!("connected to port 1"),
    }
}

#[test]
fn copy_read_while_the_original_is_in_flight_is_deferred_then_acked_as_duplicate() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let mut config_a = server.config(STREAM, GROUP, "a");
    config_a.batch_size = 1;
    let mut config_b = server.config(STREAM, GROUP, "b");
    config_b.claim_idle_timeout = Duration::from_millis(100);
    let mut a = Consumer::connect(config_a).expect("connect a");
    let mut b = Consumer::connect(config_b).expect("connect b");
    let id = event_id(5);
    xadd(&mut conn, STREAM, &event_fields(&id, 1));
    let copy = xadd(&mut conn, STREAM, &event_fields(&id, 1));

    let mut b_calls = 0;
    let mut b_handler = |_: &Event| -> Result<(), String> {
        b_calls += 1;
        Ok(())
    };
    let mut a_calls = 0;
    // While "a" is inside its handler for the original, "b" reads the copy.
    poll_until(
        &mut a,
        |_: &Event| -> Result<(), String> {
            a_calls += 1;
            poll_until(&mut b, &mut b_handler, "b sees the copy", |s| s.deferred == 1);
            Ok(())
        },
        "a processes the original",
        |s| s.processed == 1,
    );
    assert_eq!(pending_ids(&mut conn, STREAM, GROUP), vec![copy]);
    poll_until(&mut b, &mut b_handler, "b acks the reclaimed copy as a duplicate", |s| s.duplicates == 1);
    assert_eq!((a_calls, b_calls), (1, 0));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
}
