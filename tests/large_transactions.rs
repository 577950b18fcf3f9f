//! One transaction of any size is published in bounded rounds (issue 23, item 2): a window was read
//! whole, so one transaction of 1,000,000 events took the relay to a gigabyte and, under a memory
//! limit, to an abort that restarted every backend of the cluster, twice a minute. A round now takes
//! at most 10,000 events or 16 MB (src/log/window.rs), reading on inside the transaction from the last id
//! it published.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{wait_for, Env, DEADLINE};
use outbox_testkit::{rss_kb, vm_size_kb, PeakMemory};

/// 200,000 events of 1 KB each (about 230 MB as the relay holds them) in one transaction, with
/// every server process's address space limited to 192 MB above what the relay maps at rest:
/// every event arrives, in order per aggregate, in rounds of at most 10,000 events, the relay never
/// grows by more than a few rounds' worth, and nothing crashes.
#[test]
fn one_large_transaction_goes_out_in_bounded_rounds_within_a_memory_limit() {
    let mut env = Env::start(&["outbox.log_min_duration = 0", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let relay = env.pg.relay_pid(&mut client);
    let mapped_at_rest = vm_size_kb(relay);
    assert!(mapped_at_rest > 0);
    drop(client);
    env.pg.restart_with_address_space_limit(mapped_at_rest + 192 * 1024);
    let mut client = env.pg.connect();
    let relay = env.pg.relay_pid(&mut client);
    let started_at: String = client.query_one("SELECT pg_postmaster_start_time()::text", &[]).unwrap().get(0);
    let at_rest = rss_kb(relay);
    let memory = PeakMemory::watch(relay);
    let events = 200_000usize;
    let mut producer = env.pg.connect();
    let mut big = producer.transaction().unwrap();
    big.batch_execute(&format!(
        "SELECT outbox_enqueue('bulk', (i % 1000)::text, 'bulk.item', jsonb_build_object('i', i, 'pad', repeat('x', 1000)))
           FROM generate_series(1, {events}) i"
    ))
    .unwrap();
    big.commit().unwrap();
    wait_for(Duration::from_secs(300), &format!("{events} entries in outbox:bulk"), || {
        (env.redis.xlen("outbox:bulk") >= events).then_some(())
    });
    let peak = memory.peak_kb();
    drop(memory);

    let entries = env.redis.entries("outbox:bulk");
    assert_eq!(entries.len(), events, "each event once");
    let mut seqs: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
    for entry in &entries {
        let id: i64 = entry["outbox_id"].parse().unwrap();
        let seq: i64 = entry["aggregate_seq"].parse().unwrap();
        seqs.entry(entry["aggregate_id"].as_str()).or_default().push((id, seq));
    }
    assert_eq!(seqs.len(), 1000);
    for (aggregate, events) in &seqs {
        assert!(events.windows(2).all(|w| w[0].0 < w[1].0), "aggregate {aggregate}'s events out of id order");
        assert!(events.iter().map(|e| e.1).eq(1..=200), "aggregate {aggregate} numbered other than 1..200");
    }

    // Every round that published took at most 10,000 events (outbox.log_min_duration = 0 logs each).
    let log = env.pg.log();
    let rounds: Vec<usize> = log
        .lines()
        .filter_map(|line| line.split("slow round: ").nth(1))
        .filter_map(|rest| rest.split(" claimed").next()?.rsplit('(').next()?.parse().ok())
        .filter(|&claimed| claimed > 0)
        .collect();
    assert!(rounds.iter().all(|&claimed| claimed <= 10_000), "a round took more than 10,000 events: {rounds:?}");
    assert!(
        rounds.iter().sum::<usize>() >= events,
        "{} events in {} rounds",
        rounds.iter().sum::<usize>(),
        rounds.len()
    );
    let grown_mb = peak.saturating_sub(at_rest) / 1024;
    eprintln!("relay at rest {} MB, peak {} MB over {} rounds", at_rest / 1024, peak / 1024, rounds.len());
    assert!(grown_mb < 100, "the relay grew by {grown_mb} MB publishing a 230 MB transaction");
    // Nothing aborted: the same postmaster, no backend restarted.
    let now_started: String = client.query_one("SELECT pg_postmaster_start_time()::text", &[]).unwrap().get(0);
    assert_eq!(now_started, started_at);
    assert!(!log.contains("terminated by signal") && !log.contains("memory allocation"), "a process crashed");
    assert_eq!(env.pg.relay_pid(&mut client), relay, "the same relay published it all");
}

/// A relay killed (SIGKILL, so PostgreSQL restarts every backend) while it publishes one large
/// transaction in parts: the next relay reads on from the position the last finished round stored,
/// so every event arrives, in order per aggregate after dropping duplicates, and the only
/// duplicates are of the rounds around the kill (in flight, or finished with an asynchronous
/// commit the crash took).
#[test]
fn a_relay_killed_inside_a_large_transaction_goes_on_from_where_it_was() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let relay = env.pg.relay_pid(&mut client);
    let events = 150_000usize;
    let mut producer = env.pg.connect();
    let mut big = producer.transaction().unwrap();
    big.batch_execute(&format!(
        "SELECT outbox_enqueue('parts', (i % 100)::text, 'e', jsonb_build_object('i', i)) FROM generate_series(1, {events}) i"
    ))
    .unwrap();
    big.commit().unwrap();
    drop(producer);
    let published = wait_for(Duration::from_secs(120), "the relay to be part way through", || {
        let published = env.redis.xlen("outbox:parts");
        (published >= 15_000).then_some(published)
    });
    env.pg.kill_9(relay);
    assert!(published < events, "the relay had finished before it could be killed inside the transaction");
    drop(client);
    // The postmaster resets the whole cluster (crash recovery); the launcher starts a new relay.
    wait_for(DEADLINE, "the postmaster to notice the killed relay", || {
        env.pg.log().contains(&format!("(PID {relay}) was terminated by signal 9")).then_some(())
    });
    let mut client = env.pg.connect_eventually();
    wait_for(DEADLINE, "a new relay after crash recovery", || {
        env.pg.backend_pids(&mut client, "outbox_pg relay").first().copied().filter(|&pid| pid != relay)
    });
    let mut distinct = std::collections::HashSet::new();
    wait_for(Duration::from_secs(120), "every event after the kill", || {
        distinct = env.redis.entries("outbox:parts").into_iter().map(|e| e["event_id"].clone()).collect();
        (distinct.len() >= events).then_some(())
    });
    let entries = env.redis.entries("outbox:parts");
    // The round in flight, and the last rounds finished before the kill: the relay commits its
    // finishes asynchronously, so a crash can take the last few hundred milliseconds of them.
    assert!(entries.len() - events <= 30_000, "{} duplicates: more than three rounds", entries.len() - events);
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for entry in &entries {
        if !seen.insert(entry["event_id"].clone()) {
            continue;
        }
        let seq: i64 = entry["aggregate_seq"].parse().unwrap();
        let previous = last.insert(entry["aggregate_id"].clone(), seq).unwrap_or(0);
        assert_eq!(seq, previous + 1, "aggregate {} out of order after dropping duplicates", entry["aggregate_id"]);
    }
    assert!(last.values().all(|&seq| seq == 1500));
}

/// The Redis entry ids of `stream`, as (milliseconds, sequence).
fn entry_ids(env: &Env, stream: &str) -> Vec<(u64, u64)> {
    let reply: Vec<(String, Vec<(String, String)>)> =
        env.redis.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"));
    reply
        .into_iter()
        .map(|(id, _)| {
            let (ms, seq) = id.split_once('-').unwrap();
            (ms.parse().unwrap(), seq.parse().unwrap())
        })
        .collect()
}

/// One transaction of 30,000 and 20,000 events in two shards, both windows published in parts: the rounds go to
/// each in turn (found by attack: a shard whose window was being published in parts and that got
/// none of a round's allowance did not count as passed over, so the other window got every round
/// until it was done, and a third of the first one waited for all of it).
#[test]
fn two_windows_published_in_parts_take_turns() {
    let env = Env::start(&["outbox.enabled = off", "outbox.poll_interval = '100ms'"]);
    let mut client = env.pg.connect();
    let (a, b): (String, String) = {
        let row = client
            .query_one(
                "SELECT a, (SELECT i::text FROM generate_series(1, 1000) i
                             WHERE tests.shard_of('turns_b', i::text) > tests.shard_of('turns_a', a) LIMIT 1)
                   FROM (SELECT i::text AS a FROM generate_series(1, 1000) i
                          WHERE tests.shard_of('turns_a', i::text) = 0 LIMIT 1) first",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    // The first in shard 0, the lowest; the second in a higher one. One transaction: two would
    // let the relay's housekeeping record a snapshot between their commits, and a relay catching
    // up then rightly publishes the whole first window before the second (docs/worker.md,
    // "Catching up"), which is not the case under test.
    let mut transaction = client.transaction().unwrap();
    for (aggregate_type, aggregate_id, events) in [("turns_a", &a, 30_000i32), ("turns_b", &b, 20_000)] {
        transaction
            .execute(
                "SELECT outbox_enqueue($1, $2, 'e', jsonb_build_object('i', i)) FROM generate_series(1, $3) i",
                &[&aggregate_type, aggregate_id, &events],
            )
            .unwrap();
    }
    transaction.commit().unwrap();
    env.pg.set(&mut client, &[("outbox.enabled", "on")]);
    env.redis.wait_for_entries("outbox:turns_a", 30_000);
    env.redis.wait_for_entries("outbox:turns_b", 20_000);
    // Both streams' entries in the order Redis added them: the runs of one stream between entries
    // of the other are rounds (a round takes at most 10,000 events; entries of the two streams
    // added within the same millisecond may sort either way, hence the slack).
    let mut all: Vec<((u64, u64), char)> = entry_ids(&env, "outbox:turns_a").into_iter().map(|id| (id, 'a')).collect();
    all.extend(entry_ids(&env, "outbox:turns_b").into_iter().map(|id| (id, 'b')));
    all.sort();
    let mut runs: Vec<(char, usize)> = Vec::new();
    for (_, stream) in all {
        match runs.last_mut() {
            Some((last, length)) if *last == stream => *length += 1,
            _ => runs.push((stream, 1)),
        }
    }
    let longest = runs.iter().map(|&(_, length)| length).max().unwrap();
    assert!(longest <= 12_000, "one window got several rounds in a row: runs {runs:?}");
    assert_eq!(env.redis.entries("outbox:turns_a").len() + env.redis.entries("outbox:turns_b").len(), 50_000);
}
