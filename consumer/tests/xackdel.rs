//! `ConsumerConfig::delete_acked`: on a server with `XACKDEL` (Redis 8.2 or later) the consumer
//! acknowledges with `XACKDEL ... ACKED`, so an entry goes once every group acknowledged it; on an
//! older server it acknowledges with `XACK` and deletes nothing. Each test returns early, saying
//! so, on the other kind of server (CI runs the suite on Redis 7.0 and 8.2).

mod common;

use common::{event_fields, event_id, pending_count, xadd, RedisServer};
use outbox_consumer::{Consumer, Event};

const STREAM: &str = "outbox:order";

/// The server has `XACKDEL`, by its version as the tests know it.
fn has_xackdel(server: &RedisServer) -> (bool, String) {
    let version = server.info_field("server", "redis_version").expect("INFO server");
    let mut parts = version.split('.').map(|part| part.parse::<u32>().unwrap_or(0));
    ((parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (8, 2), version)
}

fn xlen(conn: &mut redis::Connection) -> i64 {
    redis::cmd("XLEN").arg(STREAM).query(conn).expect("XLEN")
}

fn ok(_: &Event) -> Result<(), String> {
    Ok(())
}

/// Three events; another group (`audit`) has read and acknowledged the first two only.
fn three_events_two_acked_elsewhere(conn: &mut redis::Connection) {
    let ids: Vec<String> = (1..=3).map(|n| xadd(conn, STREAM, &event_fields(&event_id(n), n as i64))).collect();
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg("audit").arg("0").query(conn).expect("XGROUP");
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("audit")
        .arg("a")
        .arg("COUNT")
        .arg(2)
        .arg("STREAMS")
        .arg(STREAM)
        .arg(">")
        .query(conn)
        .expect("XREADGROUP");
    let acked: i64 = redis::cmd("XACK").arg(STREAM).arg("audit").arg(&ids[..2]).query(conn).expect("XACK");
    assert_eq!(acked, 2);
}

#[test]
fn with_xackdel_an_entry_goes_once_every_group_acknowledged_it() {
    let server = RedisServer::start();
    let (has, version) = has_xackdel(&server);
    if !has {
        println!("skipped: Redis {version} has no XACKDEL (8.2 or later needed)");
        return;
    }
    let mut conn = server.conn();
    three_events_two_acked_elsewhere(&mut conn);
    let mut config = server.config(STREAM, "billing", "c1");
    config.delete_acked = true;
    let mut consumer = Consumer::connect(config).expect("connect");
    assert_eq!(consumer.acknowledges_with(), "XACKDEL");
    while consumer.stats().processed < 3 {
        consumer.poll_once(ok).expect("poll_once");
    }
    assert_eq!(pending_count(&mut conn, STREAM, "billing"), 0);
    // The two audit had acknowledged are gone; the third waits for audit.
    assert_eq!(xlen(&mut conn), 1);
}

#[test]
fn without_xackdel_the_consumer_acknowledges_with_xack_and_deletes_nothing() {
    let server = RedisServer::start();
    let (has, version) = has_xackdel(&server);
    if has {
        println!("skipped: Redis {version} has XACKDEL; the fallback needs an older one");
        return;
    }
    let mut conn = server.conn();
    three_events_two_acked_elsewhere(&mut conn);
    let mut config = server.config(STREAM, "billing", "c1");
    config.delete_acked = true;
    let mut consumer = Consumer::connect(config).expect("connect");
    assert_eq!(consumer.acknowledges_with(), "XACK");
    while consumer.stats().processed < 3 {
        consumer.poll_once(ok).expect("poll_once");
    }
    assert_eq!(pending_count(&mut conn, STREAM, "billing"), 0);
    assert_eq!(xlen(&mut conn), 3);
}

#[test]
fn by_default_the_consumer_acknowledges_with_xack() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    three_events_two_acked_elsewhere(&mut conn);
    let mut consumer = Consumer::connect(server.config(STREAM, "billing", "c1")).expect("connect");
    assert_eq!(consumer.acknowledges_with(), "XACK");
    while consumer.stats().processed < 3 {
        consumer.poll_once(ok).expect("poll_once");
    }
    assert_eq!(xlen(&mut conn), 3);
}

#[test]
fn the_cli_deletes_acknowledged_entries_with_delete_acked() {
    let server = RedisServer::start();
    let (has, version) = has_xackdel(&server);
    if !has {
        println!("skipped: Redis {version} has no XACKDEL (8.2 or later needed)");
        return;
    }
    let mut conn = server.conn();
    three_events_two_acked_elsewhere(&mut conn);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-consume"))
        .args(["--redis", &server.url(), "--stream", STREAM, "--group", "billing", "--delete-acked"])
        .args(["--max-events", "3"])
        .output()
        .expect("run outbox-consume");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(String::from_utf8_lossy(&output.stdout).lines().count(), 3);
    assert_eq!(xlen(&mut conn), 1);
}
