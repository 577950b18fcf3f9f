//! TLS to PostgreSQL (src/tls.rs) against a real server with `ssl = on`, a certificate for
//! 127.0.0.1 and localhost signed by a CA made here, and a pg_hba.conf that rejects every
//! connection of the test roles made without TLS (as `rds.force_ssl` does): `require` and the
//! default `prefer` encrypt, `verify-full` with the CA succeeds and with another CA fails naming
//! the certificate problem, `verify-ca` ignores the host name that `verify-full` checks,
//! `disable` gets the server's refusal, a Unix socket ignores sslmode, and a client certificate
//! logs in a `cert` role.

mod common;

use std::path::Path;

use common::*;
use outbox_relay::pg::{ConnectOptions, PgDatabase};
use outbox_round::db::{DbError, Row};
use outbox_testkit::{chown_to_server_user, Certificates};

const ROLE: &str = "tls_user";
/// The client certificate's CN (testkit's), logged in by pg_hba's `cert` method.
const CERT_ROLE: &str = "outbox test client";

/// A server whose test roles connect over TCP only with TLS; `postgres` (the testkit's own
/// connections, without TLS) still may.
fn tls_server(certs: &Certificates) -> Cluster {
    let pg = Cluster::builder(install())
        .for_tests()
        .settings(&[
            "ssl = on",
            "ssl_cert_file = 'server.crt'",
            "ssl_key_file = 'server.key'",
            "ssl_ca_file = 'ca.crt'",
        ])
        .create();
    // The server reads its key only if its own user owns it, mode 0600.
    for (from, to) in [(&certs.server_cert, "server.crt"), (&certs.server_key, "server.key"), (&certs.ca, "ca.crt")] {
        let copy = pg.data.join(to);
        std::fs::copy(from, &copy).unwrap();
        chown_to_server_user(&copy);
    }
    let hba = pg.data.join("pg_hba.conf");
    let rules = format!(
        "hostnossl all postgres 127.0.0.1/32 trust\n\
         hostnossl all all 0.0.0.0/0 reject\n\
         hostssl all \"{CERT_ROLE}\" 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 trust\n"
    );
    // The first matching line decides: these come before the template's.
    let rest = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(&hba, format!("{rules}{rest}")).unwrap();
    pg.pg_ctl_start();
    pg.connect().batch_execute(&format!("CREATE ROLE {ROLE} LOGIN; CREATE ROLE \"{CERT_ROLE}\" LOGIN")).unwrap();
    pg
}

fn connect(url: &str) -> Result<PgDatabase, DbError> {
    PgDatabase::connect(url, &ConnectOptions::default())
}

/// The connection's TLS version from pg_stat_ssl, None when it is not encrypted.
fn tls_version(db: &mut PgDatabase) -> Option<String> {
    let rows: Vec<Row> =
        db.query_outside_transaction("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).unwrap();
    match rows[0].get::<bool>(0).unwrap() {
        Some(true) => rows[0].get::<String>(1).unwrap(),
        _ => None,
    }
}

fn path(file: &Path) -> String {
    file.display().to_string()
}

#[test]
fn sslmodes_against_a_server_that_requires_tls() {
    let certs = Certificates::generate();
    let pg = tls_server(&certs);
    let port = pg.port;
    let base = format!("postgresql://{ROLE}@127.0.0.1:{port}/postgres");
    let ca = path(&certs.ca);

    for url in [
        format!("{base}?sslmode=require"),
        base.clone(),
        format!("host=127.0.0.1 port={port} user={ROLE} dbname=postgres"),
    ] {
        let mut db = connect(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let version = tls_version(&mut db);
        assert!(version.as_deref().is_some_and(|v| v.starts_with("TLSv1.")), "{url}: {version:?}");
    }

    for host in ["127.0.0.1", "localhost"] {
        let url = format!("postgresql://{ROLE}@{host}:{port}/postgres?sslmode=verify-full&sslrootcert={ca}");
        let mut db = connect(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(tls_version(&mut db).is_some());
    }

    // A certificate from another CA: refused, saying why and against what.
    let other = path(&certs.other_ca);
    let error = connect(&format!("{base}?sslmode=verify-full&sslrootcert={other}")).err().expect("refused");
    let message = error.to_string();
    assert!(message.contains("certificate") && message.contains("UnknownIssuer"), "{message}");
    assert!(message.contains(&format!("sslmode=verify-full against sslrootcert {other}")), "{message}");
    // libpq's rule: `require` with a root certificate file verifies the chain.
    let error = connect(&format!("{base}?sslmode=require&sslrootcert={other}")).err().expect("refused");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");

    // A name the certificate does not give: verify-full refuses, verify-ca does not look.
    let misnamed = format!("postgresql://{ROLE}@db.example:{port}/postgres?hostaddr=127.0.0.1&sslrootcert={ca}");
    let error = connect(&format!("{misnamed}&sslmode=verify-full")).err().expect("refused");
    assert!(error.to_string().contains("certificate not valid for name \"db.example\""), "{error}");
    let mut db = connect(&format!("{misnamed}&sslmode=verify-ca")).unwrap();
    assert!(tls_version(&mut db).is_some());

    // Without TLS: the server's own refusal, with its SQLSTATE (invalid_authorization_specification).
    let error = connect(&format!("{base}?sslmode=disable")).err().expect("refused");
    assert!(
        error.message.contains("pg_hba.conf rejects connection") && error.message.contains("no encryption"),
        "{error}"
    );
    assert_eq!(error.sqlstate.as_deref(), Some("28000"));

    // A Unix socket has no TLS: sslmode is ignored there, as by libpq.
    let socket = format!(
        "host={} port={port} user={ROLE} dbname=postgres sslmode=verify-full sslrootcert={other}",
        pg.dir.display()
    );
    let mut db = connect(&socket).unwrap_or_else(|e| panic!("{socket}: {e}"));
    assert_eq!(tls_version(&mut db), None);

    // A client certificate, for a role pg_hba.conf logs in only by certificate.
    let cert_role =
        format!("postgresql://outbox%20test%20client@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={ca}");
    assert!(connect(&cert_role).is_err(), "no client certificate, no login");
    let with_cert = format!("{cert_role}&sslcert={}&sslkey={}", path(&certs.client_cert), path(&certs.client_key));
    let mut db = connect(&with_cert).unwrap_or_else(|e| panic!("{with_cert}: {e}"));
    assert_eq!(db.role(), CERT_ROLE);
    assert!(tls_version(&mut db).is_some());
}
