//! TLS towards Redis, against a real redis-server with certificates made by openssl at test time:
//! the server's certificate is verified against `outbox.redis_tls_ca_file`, a client certificate is
//! presented when the server requires one, and every failure to verify is a clear, logged,
//! Redis-wide failure (events wait, nothing is dead-lettered).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::{free_port, status_counts, wait_for, Certificates, Cluster, Redis, DEADLINE};

fn path(file: &Path) -> String {
    file.display().to_string()
}

#[test]
fn tls_is_verified_against_the_configured_ca_and_presents_the_client_certificate() {
    let certs = Certificates::generate();
    let tls_port = free_port();
    // Plain port for the test's own reads, TLS port (client certificates required) for the relay.
    let redis = Redis::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &path(&certs.server_cert),
        "--tls-key-file",
        &path(&certs.server_key),
        "--tls-ca-cert-file",
        &path(&certs.ca),
        "--tls-auth-clients",
        "yes",
    ]);
    let url = format!("outbox.redis_url = 'rediss://127.0.0.1:{tls_port}'");
    let ca = format!("outbox.redis_tls_ca_file = '{}'", path(&certs.ca));
    let cert = format!("outbox.redis_tls_cert_file = '{}'", path(&certs.client_cert));
    let key = format!("outbox.redis_tls_key_file = '{}'", path(&certs.client_key));
    let pg = Cluster::start(redis.port, &[&url, &ca, &cert, &key, "outbox.max_attempts = 1"]);
    let mut client = pg.connect();
    client
        .batch_execute(
            "CREATE EXTENSION outbox_pg; SELECT outbox_enqueue('tls', i, 'e', '{}') FROM generate_series(1, 5) i",
        )
        .unwrap();
    redis.wait_for_entries("outbox:tls", 5);
    assert!(pg.log().contains(&format!("Redis at 127.0.0.1:{tls_port} (TLS)")), "{}", pg.log());

    // A server certificate that does not chain to the configured CA: refused, logged, events wait.
    // Each refusal below is a new error (a later last_error_at) that names its cause.
    let mut expect_refusal = |settings: &[(&str, &str)], what: &str, events: i64, cause: &str| {
        let before: Option<std::time::SystemTime> =
            client.query_one("SELECT last_error_at FROM outbox.stats", &[]).unwrap().get(0);
        pg.set(&mut client, settings);
        // The reload reaches the relay asynchronously, and until it reads it the relay could still
        // publish over its old connection. Changed Redis settings drop that connection at once.
        wait_for(DEADLINE, "the relay to read the reload and drop its Redis connection", || {
            let clients: String = redis.query(redis::cmd("CLIENT").arg("LIST"));
            (!clients.lines().any(|line| !line.contains("cmd=client"))).then_some(())
        });
        client
            .batch_execute(&format!(
                "SELECT outbox_enqueue('tls', 100 + i, 'e', '{{}}') FROM generate_series(1, {events}) i"
            ))
            .unwrap();
        let error = wait_for(DEADLINE, what, || {
            let row = client.query_one("SELECT last_error, last_error_at FROM outbox.stats", &[]).unwrap();
            let (error, at): (Option<String>, Option<std::time::SystemTime>) = (row.get(0), row.get(1));
            (at > before).then_some(error).flatten().filter(|e| e.to_lowercase().contains(cause))
        });
        eprintln!("{what}: {error}");
        let counts = status_counts(&mut client);
        assert_eq!(counts.get("failed"), None, "{what}: a Redis-wide failure dead-letters nothing ({error})");
        assert!(counts.get("pending").copied().unwrap_or(0) >= 1, "{what}: {counts:?}");
        error
    };
    let error = expect_refusal(
        &[("outbox.redis_tls_ca_file", &path(&certs.other_ca))],
        "the unverifiable certificate to be reported",
        1,
        "certificate",
    );
    wait_for(DEADLINE, "the outage WARNING", || {
        pg.log().contains(&format!("cannot publish to Redis at 127.0.0.1:{tls_port} (TLS)")).then_some(())
    });
    assert_eq!(redis.xlen("outbox:tls"), 5, "nothing went to a server that did not verify ({error})");

    // Without the client certificate the server refuses the handshake.
    expect_refusal(
        &[
            ("outbox.redis_tls_ca_file", &path(&certs.ca)),
            ("outbox.redis_tls_cert_file", ""),
            ("outbox.redis_tls_key_file", ""),
        ],
        "the refused handshake to be reported",
        0,
        "",
    );
    // A client key that others may read is refused before it is used.
    fs::set_permissions(&certs.client_key, fs::Permissions::from_mode(0o644)).unwrap();
    expect_refusal(
        &[
            ("outbox.redis_tls_cert_file", &path(&certs.client_cert)),
            ("outbox.redis_tls_key_file", &path(&certs.client_key)),
        ],
        "the readable key to be refused",
        0,
        "group or world access",
    );
    fs::set_permissions(&certs.client_key, fs::Permissions::from_mode(0o600)).unwrap();
    // Certificates for a plain URL are a configuration error, not a silent plain connection.
    expect_refusal(
        &[("outbox.redis_url", &format!("redis://127.0.0.1:{}", redis.port))],
        "TLS files with a plain URL to be refused",
        0,
        "not a rediss:// url",
    );

    // All set right again: everything that waited is delivered.
    pg.set(&mut client, &[("outbox.redis_url", &format!("rediss://127.0.0.1:{tls_port}"))]);
    redis.wait_for_entries("outbox:tls", 6);
    wait_for(DEADLINE, "every event published", || {
        (status_counts(&mut client).get("published").copied() == Some(6)).then_some(())
    });
}
