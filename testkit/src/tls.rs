//! Certificates for TLS tests, made at test time with the `openssl` CLI (no certificate is kept in
//! the tree, so none can expire there).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::dirs::TempDir;
use crate::os::{chown_to_server_user, run};

/// What a client presents to a TLS server: the CA it verifies the server with, and its own
/// certificate and key.
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA with a server certificate (SAN IP:127.0.0.1 and DNS:localhost, usable as a client too, as
/// a cluster node or a replica presents it) and a client certificate; and a second, unrelated CA
/// with a server certificate of its own, for "signed by another CA". EC P-256 keys, owner-only.
///
/// The client key belongs to PostgreSQL's OS user (when root), so that a relay running as that
/// user can present it; the tests, as root, read it anyway. The directory and the certificates are
/// readable by everyone. Removed on drop.
pub struct Certificates {
    dir: TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub other_ca: PathBuf,
    pub other_server_cert: PathBuf,
    pub other_server_key: PathBuf,
}

impl Certificates {
    /// Makes every certificate and key, in a directory of their own.
    pub fn generate() -> Certificates {
        let dir = TempDir::new("tls");
        let base = dir.path().to_path_buf();
        let p = |name: &str| base.join(name);
        let certs = Certificates {
            ca: p("ca.crt"),
            server_cert: p("server.crt"),
            server_key: p("server.key"),
            client_cert: p("client.crt"),
            client_key: p("client.key"),
            other_ca: p("other-ca.crt"),
            other_server_cert: p("other-server.crt"),
            other_server_key: p("other-server.key"),
            dir,
        };
        let server_ext = p("server.ext");
        write(
            &server_ext,
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
        let client_ext = p("client.ext");
        write(
            &client_ext,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
        );

        make_ca(&certs.ca, &p("ca.key"), "outbox test CA");
        make_ca(&certs.other_ca, &p("other-ca.key"), "some other CA");
        sign(&certs.server_cert, &certs.server_key, "localhost", &certs.ca, &p("ca.key"), &server_ext, 2);
        sign(&certs.client_cert, &certs.client_key, "outbox test client", &certs.ca, &p("ca.key"), &client_ext, 3);
        sign(
            &certs.other_server_cert,
            &certs.other_server_key,
            "localhost",
            &certs.other_ca,
            &p("other-ca.key"),
            &server_ext,
            4,
        );
        fs::set_permissions(certs.dir.path(), fs::Permissions::from_mode(0o755))
            .unwrap_or_else(|e| panic!("chmod 755 {}: {e}", certs.dir.path().display()));
        for cert in [&certs.ca, &certs.server_cert, &certs.client_cert, &certs.other_ca, &certs.other_server_cert] {
            chmod(cert, 0o644);
        }
        for key in [&certs.server_key, &certs.client_key, &certs.other_server_key] {
            chmod(key, 0o600);
        }
        chown_to_server_user(&certs.client_key);
        certs
    }

    /// The directory holding the files (and a few non-PEM helper files such as `server.ext`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Our CA and client certificate: what a well-configured client uses.
    pub fn client(&self) -> ClientTls {
        ClientTls { ca: self.ca.clone(), cert: self.client_cert.clone(), key: self.client_key.clone() }
    }
}

fn write(path: &Path, contents: &str) {
    fs::write(path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
}

fn openssl(args: &[&str]) {
    let mut cmd = Command::new("openssl");
    cmd.args(args).stdin(Stdio::null());
    run(cmd, &format!("openssl {args:?} (apt-get install openssl)"));
}

/// `openssl req` with a new P-256 key written to `key`, for subject `CN=name`, writing `out`: a
/// signing request, or with `-x509` among `extra` a self-signed certificate.
fn new_key(key: &Path, out: &Path, name: &str, extra: &[&str]) {
    let [key, out] = [key, out].map(|p| p.display().to_string());
    let subject = format!("/CN={name}");
    let mut args = vec!["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    args.extend(["-keyout", &key, "-out", &out, "-subj", &subject]);
    args.extend(extra);
    openssl(&args);
}

fn make_ca(cert: &Path, key: &Path, name: &str) {
    let ca = ["basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign"];
    new_key(key, cert, name, &["-x509", "-days", "2", "-addext", ca[0], "-addext", ca[1]]);
}

fn sign(cert: &Path, key: &Path, name: &str, ca: &Path, ca_key: &Path, ext: &Path, serial: u32) {
    let csr = cert.with_extension("csr");
    new_key(key, &csr, name, &[]);
    let [csr, ca, ca_key, cert, ext] = [csr.as_path(), ca, ca_key, cert, ext].map(|p| p.display().to_string());
    let serial = serial.to_string();
    let signing = ["-CA", &ca, "-CAkey", &ca_key, "-set_serial", &serial, "-days", "2", "-extfile", &ext];
    openssl(&[&["x509", "-req", "-in", &csr, "-out", &cert][..], &signing].concat());
}
