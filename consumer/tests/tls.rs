//! The consumer over TLS against a real TLS-only redis-server that requires client certificates,
//! with certificates made by the `openssl` CLI at test time: consuming and deduplicating with
//! mutual TLS, and refusing what must be refused (a server certificate from another CA, no client
//! certificate, a world-readable key, certificates with a plain URL).

mod common;

use std::path::PathBuf;

use common::{chmod, event_fields, event_id, pending_count, xadd, RedisServer, TlsFiles, DEADLINE};
use outbox_consumer::{Consumer, ConsumerConfig, ConsumerError, Event, Stats};

const STREAM: &str = "outbox:order";
const GROUP: &str = "billing";

fn poll_until(consumer: &mut Consumer, what: &str, done: impl Fn(&Stats) -> bool) -> Vec<String> {
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + DEADLINE;
    while !done(&consumer.stats()) {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}; stats {:?}", consumer.stats());
        consumer
            .poll_once(|e: &Event| -> Result<(), String> {
                seen.push(e.event_id.clone());
                Ok(())
            })
            .expect("poll_once");
    }
    seen
}

/// A TLS config: our CA, and our client certificate when `client_cert`.
fn tls_config(server: &RedisServer, files: &TlsFiles, client_cert: bool) -> ConsumerConfig {
    let mut config = server.config(STREAM, GROUP, "c1");
    config.tls_ca_file = Some(files.ca.clone());
    if client_cert {
        config.tls_cert_file = Some(files.client_cert.clone());
        config.tls_key_file = Some(files.client_key.clone());
    }
    config
}

fn connect_error(config: ConsumerConfig) -> ConsumerError {
    match Consumer::connect(config) {
        Ok(_) => panic!("connected although it should have been refused"),
        Err(e) => e,
    }
}

#[test]
fn consumes_and_dedups_over_mutual_tls() {
    let files = TlsFiles::generate();
    let server = RedisServer::start_tls(&files, &files.server_cert, &files.server_key, files.client());
    assert!(server.url().starts_with("rediss://"));
    let mut conn = server.conn();
    let mut consumer = Consumer::connect(tls_config(&server, &files, true)).expect("connect over mutual TLS");

    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    xadd(&mut conn, STREAM, &event_fields(&event_id(2), 2));
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1)); // a redelivered copy
    let seen = poll_until(&mut consumer, "three entries handled", |s| s.processed + s.duplicates == 3);
    assert_eq!(seen, vec![event_id(1), event_id(2)]);
    assert_eq!((consumer.stats().processed, consumer.stats().duplicates), (2, 1));
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
    let state: String =
        redis::cmd("GET").arg(format!("outbox:dedup:{GROUP}:{}", event_id(1))).query(&mut conn).expect("GET");
    assert_eq!(state, "done");

    // The system trust store does not know our CA: without tls_ca_file the server is refused.
    let mut no_ca = tls_config(&server, &files, true);
    no_ca.tls_ca_file = None;
    let error = connect_error(no_ca);
    assert!(!error.is_transient(), "{error}");
    assert!(error.to_string().contains("certificate"), "{error}");
}

#[test]
fn server_certificate_signed_by_another_ca_is_refused() {
    let files = TlsFiles::generate();
    // The server presents a certificate of another CA (the test's own probe trusts that CA).
    let mut probe = files.client();
    probe.ca = files.other_ca.clone();
    let server = RedisServer::start_tls(&files, &files.other_server_cert, &files.other_server_key, probe);

    let error = connect_error(tls_config(&server, &files, true));
    let message = error.to_string();
    assert!(matches!(error, ConsumerError::Redis { operation: "connect", .. }), "{message}");
    assert!(message.contains("TLS") && message.contains("certificate"), "not a clear TLS error: {message}");
    assert!(message.contains("UnknownIssuer"), "{message}");
    assert!(!error.is_transient(), "a certificate problem is not cured by retrying: {message}");
}

#[test]
fn missing_client_certificate_is_refused() {
    let files = TlsFiles::generate();
    let server = RedisServer::start_tls(&files, &files.server_cert, &files.server_key, files.client());

    let error = connect_error(tls_config(&server, &files, false));
    let message = error.to_string();
    assert!(matches!(error, ConsumerError::Redis { operation: "connect", .. }), "{message}");
    assert!(message.contains("TLS"), "not a clear TLS error: {message}");
    assert!(!error.is_transient(), "{message}");

    // A certificate the server's CA did not sign is refused as well.
    let mut foreign = tls_config(&server, &files, true);
    foreign.tls_cert_file = Some(files.other_server_cert.clone());
    foreign.tls_key_file = Some(files.other_server_key.clone());
    let error = connect_error(foreign);
    assert!(error.to_string().contains("TLS"), "{error}");
    assert!(!error.is_transient(), "{error}");
}

#[test]
fn key_file_with_group_or_world_access_is_refused() {
    let files = TlsFiles::generate();
    let server = RedisServer::start_tls(&files, &files.server_cert, &files.server_key, files.client());
    for mode in [0o640, 0o604] {
        chmod(&files.client_key, mode);
        match connect_error(tls_config(&server, &files, true)) {
            ConsumerError::InvalidConfig(message) => {
                assert!(message.contains("tls_key_file"), "{message}");
                assert!(message.contains(&files.client_key.display().to_string()), "names the file: {message}");
                assert!(message.contains("group or world"), "{message}");
            }
            other => panic!("mode {mode:o}: expected InvalidConfig, got {other}"),
        }
    }
    chmod(&files.client_key, 0o600);
    assert!(Consumer::connect(tls_config(&server, &files, true)).is_ok());
}

#[test]
fn unusable_tls_settings_are_configuration_errors() {
    let files = TlsFiles::generate();
    let base = || {
        let mut c = ConsumerConfig::new("rediss://127.0.0.1:1/", STREAM, GROUP);
        c.tls_ca_file = Some(files.ca.clone());
        c
    };
    type Change<'a> = Box<dyn Fn(&mut ConsumerConfig) + 'a>;
    let cases: Vec<(Change, &str)> = vec![
        // Certificates with a plain URL: never send in the clear what was meant to be protected.
        (Box::new(|c| c.redis_url = "redis://127.0.0.1:1/".into()), "not a rediss:// URL"),
        (Box::new(|c| c.tls_cert_file = Some(files.client_cert.clone())), "set together"),
        (Box::new(|c| c.tls_key_file = Some(files.client_key.clone())), "set together"),
        (Box::new(|c| c.redis_url = "rediss://127.0.0.1:1/#insecure".into()), "always verified"),
        (Box::new(|c| c.tls_ca_file = Some(PathBuf::from("/nonexistent/ca.crt"))), "/nonexistent/ca.crt"),
        (Box::new(|c| c.tls_ca_file = Some(files.dir().join("server.ext"))), "no PEM certificate"),
    ];
    for (change, needle) in cases {
        let mut config = base();
        change(&mut config);
        match Consumer::connect(config) {
            Err(ConsumerError::InvalidConfig(message)) => assert!(message.contains(needle), "{needle}: {message}"),
            Err(other) => panic!("{needle}: expected InvalidConfig, got {other}"),
            Ok(_) => panic!("{needle}: connected"),
        }
    }
}
