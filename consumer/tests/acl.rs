//! The consumer as a restricted ACL user of a real redis-server: the least privileges listed in
//! the README are enough for every code path (read, dedup, duplicate, reclaim, dead letter), and
//! each one of them is needed. Also the password file: it overrides the URL's password, and a
//! file others may read is refused.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    event_fields, event_id, least_privileges, pending_count, set_user_command, write_secret, xadd, xrange, RedisServer,
    TempDir, DEADLINE,
};
use outbox_consumer::{Consumer, ConsumerConfig, ConsumerError, Event};

const STREAM: &str = "outbox:order";
const GROUP: &str = "billing";
const USER: &str = "outbox-consumer";
const PASSWORD: &str = "pw-for-the-consumer";

fn privileges() -> Vec<String> {
    least_privileges(STREAM, GROUP, false)
}

fn set_user(conn: &mut redis::Connection, rules: &[String]) {
    set_user_command(USER, PASSWORD, rules).exec(conn).expect("ACL SETUSER");
}

fn user_config(server: &RedisServer, password_file: &Path) -> ConsumerConfig {
    let mut config = server.config(STREAM, GROUP, "c1");
    config.redis_url = format!("redis://{USER}@127.0.0.1:{}/", server.port);
    config.password_file = Some(password_file.to_path_buf());
    config.claim_idle_timeout = Duration::from_millis(1);
    config.max_deliveries = 2;
    config
}

/// Runs every path of the consumer once on an empty server: a group that exists (BUSYGROUP), an
/// entry left by a dead consumer (XAUTOCLAIM, XPENDING), a new event (SET NX, EVAL done + XACK), a
/// copy of it (EVAL acquire: GET, then XACK), and a failing event (EVAL release: GET, DEL, then
/// XADD to the dead-letter stream, XACK). Returns the first error.
fn every_path(server: &RedisServer, config: &ConsumerConfig) -> Result<(), ConsumerError> {
    let mut admin = server.conn();
    redis::cmd("FLUSHALL").exec(&mut admin).expect("FLUSHALL");
    redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").arg("MKSTREAM").exec(&mut admin).expect("group");
    xadd(&mut admin, STREAM, &event_fields(&event_id(3), 3));
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg("ghost")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(STREAM)
        .arg(">")
        .query(&mut admin)
        .expect("XREADGROUP as ghost");
    xadd(&mut admin, STREAM, &event_fields(&event_id(1), 1));
    xadd(&mut admin, STREAM, &event_fields(&event_id(666), 2));
    xadd(&mut admin, STREAM, &event_fields(&event_id(1), 1));

    let mut consumer = Consumer::connect(config.clone())?;
    let mut handler = |e: &Event| -> Result<(), String> {
        if e.event_id == event_id(666) {
            Err("poison".to_string())
        } else {
            Ok(())
        }
    };
    let deadline = Instant::now() + DEADLINE;
    loop {
        let s = consumer.stats();
        if s.processed == 2 && s.duplicates == 1 && s.dead_lettered == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "timed out; stats {s:?}");
        consumer.poll_once(&mut handler)?;
    }
    assert_eq!(consumer.stats().reclaimed, 2, "ghost's entry and the poison's retry");
    assert_eq!(pending_count(&mut admin, STREAM, GROUP), 0);
    assert_eq!(xrange(&mut admin, &format!("{STREAM}:dead")).len(), 1);
    Ok(())
}

#[test]
fn least_privileges_are_enough_and_each_one_is_needed() {
    let server = RedisServer::start();
    let mut admin = server.conn();
    let secrets = TempDir::new("secrets");
    let password_file = secrets.path().join("password");
    // A trailing newline, as `echo pw > file` leaves, is not part of the password.
    write_secret(&password_file, &format!("{PASSWORD}\n"));
    let config = user_config(&server, &password_file);

    set_user(&mut admin, &privileges());
    every_path(&server, &config).expect("the documented privileges are enough");

    for missing in privileges() {
        let rules: Vec<String> = privileges().into_iter().filter(|rule| *rule != missing).collect();
        set_user(&mut admin, &rules);
        match every_path(&server, &config) {
            Ok(()) => panic!("still works without {missing}: it is not needed"),
            Err(error) => {
                assert!(!error.is_transient(), "without {missing}: {error}");
                // NOPERM for a command or key; from inside a script, "can't run this command".
                let message = error.to_string();
                assert!(
                    message.contains("permission") || message.contains("can't run this command"),
                    "without {missing}: {message}"
                );
            }
        }
    }
}

#[test]
fn password_file_overrides_the_urls_password_and_must_be_private() {
    let server = RedisServer::start();
    let mut admin = server.conn();
    set_user(&mut admin, &privileges());
    let secrets = TempDir::new("secrets");
    let password_file = secrets.path().join("password");
    write_secret(&password_file, PASSWORD);

    // The URL's (wrong) password is replaced by the file's.
    let mut config = user_config(&server, &password_file);
    config.redis_url = format!("redis://{USER}:wrong@127.0.0.1:{}/", server.port);
    let mut consumer = Consumer::connect(config.clone()).expect("connect with the password file");
    xadd(&mut admin, STREAM, &event_fields(&event_id(1), 1));
    let deadline = Instant::now() + DEADLINE;
    while consumer.stats().processed < 1 {
        assert!(Instant::now() < deadline, "event not processed");
        consumer.poll_once(|_: &Event| -> Result<(), String> { Ok(()) }).expect("poll_once");
    }

    // Without the file, the URL's wrong password is refused by the server: not transient.
    let mut without = config.clone();
    without.password_file = None;
    match Consumer::connect(without) {
        Err(error @ ConsumerError::Redis { .. }) => assert!(!error.is_transient(), "{error}"),
        Err(other) => panic!("expected an authentication error, got {other}"),
        Ok(_) => panic!("connected with a wrong password"),
    }

    // A file its group or others may read is refused, naming the file; so is an empty one.
    for mode in [0o640, 0o644] {
        common::chmod(&password_file, mode);
        match Consumer::connect(config.clone()) {
            Err(ConsumerError::InvalidConfig(message)) => {
                assert!(message.contains("password_file"), "{message}");
                assert!(message.contains(&password_file.display().to_string()), "{message}");
            }
            Err(other) => panic!("mode {mode:o}: expected InvalidConfig, got {other}"),
            Ok(_) => panic!("mode {mode:o}: accepted"),
        }
    }
    write_secret(&password_file, "\n");
    match Consumer::connect(config) {
        Err(ConsumerError::InvalidConfig(message)) => assert!(message.contains("empty"), "{message}"),
        Err(other) => panic!("expected InvalidConfig, got {other}"),
        Ok(_) => panic!("empty password file accepted"),
    }
}
