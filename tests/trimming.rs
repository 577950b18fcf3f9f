//! `outbox.stream_trim = 'acked'` (README, "Trimming"): on Redis 8.2 or later the relay trims with
//! `XADD ... ACKED MAXLEN = n`, so a consumer group that stops reading loses nothing; on an older
//! Redis, or when the relay's user may not ask the server what it offers, it publishes nothing and
//! says why. Tests that need one kind of server return early, saying so, on the other: CI runs
//! this file on Redis 7.0 and on 8.2.

mod common;

use common::{enqueue_to, status_counts, wait_drained, wait_for, Cluster, Env, Redis, DEADLINE, RELAY_ACL_USER};

/// Redis under test offers `XADD ... ACKED` (8.2 or later), by its version as the tests know it.
fn offers_acked(env: &Env) -> bool {
    let version = env.redis.info_field("server", "redis_version").expect("INFO server");
    let mut parts = version.split('.').map(|part| part.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (8, 2)
}

fn redis_version(env: &Env) -> String {
    env.redis.info_field("server", "redis_version").expect("INFO server")
}

fn xlen(env: &Env, stream: &str) -> i64 {
    env.redis.query(redis::cmd("XLEN").arg(stream))
}

fn losses(client: &mut postgres::Client) -> i64 {
    client.query_one("SELECT count(*) FROM outbox.redis_losses", &[]).unwrap().get(0)
}

/// Reads every entry of `stream` not yet delivered to `group` and acknowledges all its pending
/// entries: the group has caught up.
fn catch_up(env: &Env, stream: &str, group: &str) {
    let _: redis::Value = env.redis.query(
        redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("c")
            .arg("COUNT")
            .arg(100_000)
            .arg("STREAMS")
            .arg(stream)
            .arg(">"),
    );
    let pending: Vec<(String, String, i64, i64)> =
        env.redis.query(redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(100_000));
    let mut ack = redis::cmd("XACK");
    ack.arg(stream).arg(group);
    for (id, ..) in &pending {
        ack.arg(id);
    }
    if !pending.is_empty() {
        let _: i64 = env.redis.query(&ack);
    }
}

/// The stream bound is 10.
const SETTINGS: &[&str] =
    &["outbox.stream_maxlen = 10", "outbox.stream_trim = 'acked'", "outbox.poll_interval = '100ms'"];

/// The relay's connections are closed: its next write checks every stream it knows first.
fn reconnect_relay(env: &Env) {
    let _: i64 = env.redis.query(redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"));
}

#[test]
fn a_stalled_group_loses_nothing_and_the_stream_shrinks_back_once_it_acknowledges() {
    let env = Env::start(SETTINGS);
    if !offers_acked(&env) {
        println!("skipped: Redis {} has no XADD ... ACKED (8.2 or later needed)", redis_version(&env));
        return;
    }
    let mut client = env.pg.connect();
    // The relay is running already; the group is created after it started, on a stream it has
    // written to, and reads three entries before it stalls.
    enqueue_to(&mut client, "order", "0", None);
    env.redis.wait_for_entries("outbox:order", 1);
    let _: () = env.redis.query(redis::cmd("XGROUP").arg("CREATE").arg("outbox:order").arg("billing").arg("$"));
    for n in 0..130 {
        enqueue_to(&mut client, "order", &n.to_string(), None);
        enqueue_to(&mut client, "audit", &n.to_string(), None);
    }
    wait_drained(&mut client);
    let _: redis::Value = env.redis.query(
        redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("billing")
            .arg("c")
            .arg("COUNT")
            .arg(3)
            .arg("STREAMS")
            .arg("outbox:order")
            .arg(">"),
    );
    enqueue_to(&mut client, "order", "130", None);
    wait_drained(&mut client);
    // Nothing the group had not acknowledged was trimmed: the 131 entries written since it was
    // created are all there (the one before it counts as acknowledged by it, and may go).
    let order = xlen(&env, "outbox:order");
    assert!(
        (131..=132).contains(&order),
        "outbox:order holds {order} entries, not the 131 billing has not acknowledged"
    );
    // A stream without groups is trimmed to the bound.
    assert_eq!(xlen(&env, "outbox:audit"), 10);

    // The next check (forced by a new connection) warns of the stream held back, once.
    reconnect_relay(&env);
    enqueue_to(&mut client, "order", "131", None);
    let warning = "stream \"outbox:order\" holds 13";
    wait_for(DEADLINE, "the WARNING of the stream held back", || env.pg.log().contains(warning).then_some(()));
    assert!(!env.pg.log().contains("stream \"outbox:audit\" holds"), "{}", env.pg.log());

    catch_up(&env, "outbox:order", "billing");
    enqueue_to(&mut client, "order", "132", None);
    wait_drained(&mut client);
    assert_eq!(xlen(&env, "outbox:order"), 10, "after billing caught up");

    // A check after a new connection does not take the trimmed entries for lost ones, and says
    // the stream is back.
    reconnect_relay(&env);
    enqueue_to(&mut client, "order", "133", None);
    enqueue_to(&mut client, "audit", "133", None);
    wait_drained(&mut client);
    wait_for(DEADLINE, "the LOG of the stream back to its bound", || {
        env.pg.log().contains("stream \"outbox:order\" is back to").then_some(())
    });
    assert_eq!(losses(&mut client), 0, "{}", env.pg.log());
    let log = env.pg.log();
    assert_eq!(log.matches(warning).count(), 1, "{log}");
    assert!(log.contains(": XADD ACKED offered"), "{log}");
    assert!(!log.contains("outbox.stream_trim = 'acked' needs"), "{log}");
}

#[test]
fn acked_trimming_against_a_redis_without_it_publishes_nothing_and_says_why() {
    let env = Env::start(SETTINGS);
    if offers_acked(&env) {
        println!("skipped: Redis {} has XADD ... ACKED; the refusal needs an older one", redis_version(&env));
        return;
    }
    let version = redis_version(&env);
    let mut client = env.pg.connect();
    for n in 0..12 {
        enqueue_to(&mut client, "order", &n.to_string(), None);
    }
    let refusal = format!(
        "outbox.stream_trim = 'acked' needs XADD ... ACKED (Redis 8.2 or later), which Redis {version} does not offer"
    );
    wait_for(DEADLINE, "the refusal in outbox.stats", || {
        let last_error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
        last_error.filter(|error| error.contains(&refusal))
    });
    assert!(env.pg.log().contains(&refusal), "{}", env.pg.log());
    assert!(env.pg.log().contains("XADD ACKED not offered"), "{}", env.pg.log());
    // Nothing published, nothing trimmed, nothing failed: the events wait.
    assert_eq!(xlen(&env, "outbox:order"), 0);
    assert_eq!(status_counts(&mut client).get("pending").copied(), Some(12), "{:?}", status_counts(&mut client));

    // Back to trimming by length on reload: they go out, trimmed as before.
    env.pg.set(&mut client, &[("outbox.stream_trim", "length")]);
    wait_drained(&mut client);
    let order = xlen(&env, "outbox:order");
    assert!((1..=12).contains(&order), "outbox:order holds {order} entries");
    assert_eq!(status_counts(&mut client).get("published").copied(), Some(12));
}

#[test]
fn acked_trimming_refuses_when_the_relay_may_not_ask_what_redis_offers() {
    let redis = Redis::start();
    let mut acl = redis::cmd("ACL");
    acl.arg("SETUSER").arg(RELAY_ACL_USER);
    let _: () = redis.query(&acl);
    let url = format!("outbox.redis_url = 'redis://relay:relay-pw@127.0.0.1:{}'", redis.port);
    let pg = Cluster::start(redis.port, &[SETTINGS, &[url.as_str()]].concat());
    let env = Env { redis, pg };
    if !offers_acked(&env) {
        println!("skipped: Redis {} has no XADD ... ACKED (8.2 or later needed)", redis_version(&env));
        return;
    }
    let mut client = env.pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    enqueue_to(&mut client, "order", "1", None);
    wait_for(DEADLINE, "the refusal naming the permission", || {
        let last_error: Option<String> = client.query_one("SELECT last_error FROM outbox.stats", &[]).unwrap().get(0);
        last_error.filter(|error| error.contains("COMMAND DOCS XADD was refused") && error.contains("+command|docs"))
    });
    assert!(env.pg.log().contains("XADD ACKED unknown"), "{}", env.pg.log());
    assert_eq!(xlen(&env, "outbox:order"), 0);
    assert_eq!(status_counts(&mut client).get("pending").copied(), Some(1));

    // Granted, it is asked again at the next connect and publishes.
    let _: () = env.redis.query(redis::cmd("ACL").arg("SETUSER").arg("relay").arg("+command|docs"));
    env.redis.wait_for_entries("outbox:order", 1);
    wait_drained(&mut client);
}
