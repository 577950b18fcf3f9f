//! TLS towards Redis, against a real redis-server with certificates made by openssl at test time:
//! the server's certificate is verified against `outbox.redis_tls_ca_file`, a client certificate is
//! presented when the server requires one, and every failure to verify is a clear, logged,
//! Redis-wide failure (events wait, nothing is dead-lettered).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{free_port, status_counts, wait_for, Cluster, Redis, DEADLINE};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA with a server certificate for 127.0.0.1 and a client certificate, and an unrelated CA, in a
/// directory the server's OS user can read; the client key is the server user's, owner-only.
struct Certificates {
    dir: PathBuf,
}

impl Certificates {
    fn make() -> Certificates {
        let dir = PathBuf::from(format!("/tmp/opg-it/tls-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        for (ca, subject) in [("ca", "/CN=outbox test CA"), ("rogue", "/CN=some other CA")] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    subject,
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.crt"),
                ],
            );
        }
        fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
        fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (who, subject) in [("server", "/CN=localhost"), ("client", "/CN=outbox relay")] {
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    subject,
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{who}.ext"),
                    "-out",
                    &format!("{who}.crt"),
                ],
            );
        }
        for file in ["ca.crt", "rogue.crt", "server.crt", "client.crt"] {
            fs::set_permissions(dir.join(file), fs::Permissions::from_mode(0o644)).unwrap();
        }
        let key = dir.join("client.key");
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(Command::new("chown").arg("postgres:postgres").arg(&key).status().unwrap().success());
        }
        Certificates { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }
}

impl Drop for Certificates {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn tls_is_verified_against_the_configured_ca_and_presents_the_client_certificate() {
    let certs = Certificates::make();
    let tls_port = free_port();
    // Plain port for the test's own reads, TLS port (client certificates required) for the relay.
    let redis = Redis::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &certs.path("server.crt"),
        "--tls-key-file",
        &certs.path("server.key"),
        "--tls-ca-cert-file",
        &certs.path("ca.crt"),
        "--tls-auth-clients",
        "yes",
    ]);
    let url = format!("outbox.redis_url = 'rediss://127.0.0.1:{tls_port}'");
    let ca = format!("outbox.redis_tls_ca_file = '{}'", certs.path("ca.crt"));
    let cert = format!("outbox.redis_tls_cert_file = '{}'", certs.path("client.crt"));
    let key = format!("outbox.redis_tls_key_file = '{}'", certs.path("client.key"));
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
        &[("outbox.redis_tls_ca_file", &certs.path("rogue.crt"))],
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
            ("outbox.redis_tls_ca_file", &certs.path("ca.crt")),
            ("outbox.redis_tls_cert_file", ""),
            ("outbox.redis_tls_key_file", ""),
        ],
        "the refused handshake to be reported",
        0,
        "",
    );
    // A client key that others may read is refused before it is used.
    fs::set_permissions(certs.dir.join("client.key"), fs::Permissions::from_mode(0o644)).unwrap();
    expect_refusal(
        &[
            ("outbox.redis_tls_cert_file", &certs.path("client.crt")),
            ("outbox.redis_tls_key_file", &certs.path("client.key")),
        ],
        "the readable key to be refused",
        0,
        "group or world access",
    );
    fs::set_permissions(certs.dir.join("client.key"), fs::Permissions::from_mode(0o600)).unwrap();
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
