//! TLS to PostgreSQL with libpq's `sslmode` semantics, over rustls (no OpenSSL): managed servers
//! require it (RDS PostgreSQL 15 and later default to `rds.force_ssl = 1`).
//!
//! The `postgres` crate parses the connection string but knows only `sslmode=disable|prefer|
//! require` and no certificate parameters, so `split` takes `sslmode`, `sslrootcert`, `sslcert`
//! and `sslkey` out of the string (a URL's query or a `key=value` string; the `PGSSLMODE`,
//! `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY` variables when it has none) and hands the rest to
//! it unchanged. As libpq:
//!
//! - `disable`: plain text. `prefer` (the default): TLS if the server offers it, certificate not
//!   verified. `require`: TLS or no connection, certificate not verified, unless a root
//!   certificate file is there (`sslrootcert`, else `~/.postgresql/root.crt`): then as `verify-ca`.
//! - `verify-ca`: the server's chain must lead to a root of `sslrootcert` (a file, or `system` for
//!   the system's roots; without it `~/.postgresql/root.crt`, else the system's roots, where
//!   libpq would refuse). `verify-full`: and the certificate must name the host connected to.
//! - `sslcert` and `sslkey` (PEM): a client certificate, for `clientcert=verify-full` servers.
//!
//! No channel binding is offered (`SCRAM-SHA-256`, not `-PLUS`, as libpq with
//! `channel_binding=prefer` on a server that offers none). A Unix socket ignores `sslmode`, as
//! in libpq (src/pg.rs).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use postgres::config::SslMode as PostgresSslMode;
use postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            // libpq's `allow` tries plain text first; the relay never needs less than `prefer`.
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "invalid sslmode \"{other}\": use disable, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The TLS parameters of a connection string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`: a file, or `system`.
    pub root_cert: Option<String>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

const KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// `conninfo` without its TLS parameters (for the `postgres` crate) and those parameters; `env`
/// gives the `PGSSL*` variables used for a parameter the string does not set.
pub fn split(conninfo: &str, env: impl Fn(&str) -> Option<String>) -> Result<(String, TlsSettings), String> {
    let (rest, mut found) = if conninfo.contains("://") { split_url(conninfo) } else { split_key_value(conninfo)? };
    for (key, variable) in KEYS.iter().zip(["PGSSLMODE", "PGSSLROOTCERT", "PGSSLCERT", "PGSSLKEY"]) {
        if !found.iter().any(|(name, _)| name == key) {
            if let Some(value) = env(variable).filter(|value| !value.is_empty()) {
                found.push((key.to_string(), value));
            }
        }
    }
    // The last occurrence wins, as in libpq.
    let get = |key: &str| found.iter().rev().find(|(name, _)| name == key).map(|(_, value)| value.clone());
    let settings = TlsSettings {
        mode: get("sslmode").map(|mode| SslMode::parse(&mode)).transpose()?.unwrap_or(SslMode::Prefer),
        root_cert: get("sslrootcert"),
        cert: get("sslcert").map(PathBuf::from),
        key: get("sslkey").map(PathBuf::from),
    };
    if settings.cert.is_some() != settings.key.is_some() {
        return Err("sslcert and sslkey go together: set both or neither".into());
    }
    Ok((rest, settings))
}

/// A URL's TLS parameters (percent-decoded), and the URL without them.
fn split_url(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Vec::new());
    };
    let mut found = Vec::new();
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name);
        if KEYS.contains(&name.as_str()) {
            found.push((name, percent_decode(value)));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    (rest, found)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = bytes.get(at + 1..at + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[at], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                at += 3;
            }
            (byte, _) => {
                out.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `key=value` string's TLS parameters (unquoted, unescaped), and the string without them.
fn split_key_value(conninfo: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut found = Vec::new();
    let mut rest = String::new();
    let mut chars = conninfo.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else { break };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if chars.next_if(|(_, c)| *c == '=').is_none() {
            return Err(format!("missing \"=\" after \"{key}\" in the connection string"));
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        let quoted = chars.next_if(|(_, c)| *c == '\'').is_some();
        loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, c)) => value.push(c),
                    None => break,
                },
                Some((_, '\'')) if quoted => break,
                Some((_, c)) if !quoted && c.is_whitespace() => break,
                Some((_, c)) => value.push(c),
                None if quoted => return Err("unterminated quoted value in the connection string".into()),
                None => break,
            }
        }
        let end = chars.peek().map_or(conninfo.len(), |&(at, _)| at);
        if KEYS.contains(&key.as_str()) {
            found.push((key, value));
        } else {
            rest.push_str(conninfo[start..end].trim_end());
            rest.push(' ');
        }
    }
    Ok((rest.trim_end().to_string(), found))
}

impl TlsSettings {
    /// The mode the `postgres` crate negotiates with: whether it asks for TLS and whether it
    /// gives up without it. Verification is the connector's.
    pub fn postgres_mode(&self) -> PostgresSslMode {
        match self.mode {
            SslMode::Disable => PostgresSslMode::Disable,
            SslMode::Prefer => PostgresSslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => PostgresSslMode::Require,
        }
    }

    /// The connector for these settings, certificates read now: a missing or unreadable file is
    /// an error here, not at the handshake.
    pub fn connector(&self) -> Result<RustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let root_file = self.root_cert.clone().or_else(|| {
            let default = home_dir()?.join(".postgresql/root.crt");
            default.is_file().then(|| default.display().to_string())
        });
        // libpq's rule: `require` with a root certificate file verifies the chain.
        let mode = match (self.mode, &root_file) {
            (SslMode::Require, Some(file)) if file != "system" => SslMode::VerifyCa,
            (mode, _) => mode,
        };
        let (verifier, described): (Arc<dyn ServerCertVerifier>, String) = match mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => {
                (Arc::new(AnyCertificate(Arc::clone(&provider))), format!("sslmode={}", mode.name()))
            }
            SslMode::VerifyCa | SslMode::VerifyFull => {
                let (roots, from) = match root_file.as_deref() {
                    None | Some("system") => (system_roots()?, "the system's root certificates".to_string()),
                    Some(file) => (file_roots(Path::new(file))?, format!("sslrootcert {file}")),
                };
                let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| format!("TLS: {e}"))?;
                let verifier: Arc<dyn ServerCertVerifier> =
                    if mode == SslMode::VerifyCa { Arc::new(AnyHostName(webpki)) } else { webpki };
                (verifier, format!("sslmode={} against {from}", mode.name()))
            }
        };
        let builder = builder.dangerous().with_custom_certificate_verifier(verifier);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect())
                    .map_err(|e| format!("cannot read sslcert {}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("cannot read sslkey {}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| format!("sslcert and sslkey: {e}"))?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(RustlsConnect { config: Arc::new(config), described: Arc::from(described) })
    }
}

fn home_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|home| !home.is_empty()).map(PathBuf::from)
}

fn file_roots(file: &Path) -> Result<RootCertStore, String> {
    let shown = file.display();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(file)
        .and_then(|certs| certs.collect())
        .map_err(|e| format!("cannot read sslrootcert {shown}: {e}"))?;
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!("sslrootcert {shown} holds no usable certificate"));
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, String> {
    let loaded = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(loaded.certs);
    if added == 0 {
        let errors: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
        return Err(format!(
            "no system root certificates found ({}): give the server's CA with sslrootcert=FILE",
            if errors.is_empty() { "none installed".to_string() } else { errors.join("; ") }
        ));
    }
    Ok(roots)
}

/// `verify-ca`: the chain is verified, the name the certificate gives is not.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require`: encrypted, any certificate accepted (the handshake's signatures are
/// still checked: the server holds the key of the certificate it shows).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The `postgres` crate's TLS connector over rustls.
#[derive(Clone)]
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    /// What is verified, for the error of a failed handshake.
    described: Arc<str>,
}

/// One connection's handshake, to the host it is for (none over a Unix socket).
pub struct RustlsHandshake {
    config: Arc<ClientConfig>,
    described: Arc<str>,
    host: Result<ServerName<'static>, String>,
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsHandshake;
    type Error = io::Error;

    fn make_tls_connect(&mut self, host: &str) -> Result<RustlsHandshake, io::Error> {
        // An invalid name fails the handshake, not here: a Unix socket asks with "" and never
        // gets to the handshake.
        let host = ServerName::try_from(host.to_string()).map_err(|e| format!("host name \"{host}\" for TLS: {e}"));
        Ok(RustlsHandshake { config: Arc::clone(&self.config), described: Arc::clone(&self.described), host })
    }
}

impl<S> TlsConnect<S> for RustlsHandshake
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<RustlsStream<S>, io::Error>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let host = self.host.map_err(io::Error::other)?;
            let connector = tokio_rustls::TlsConnector::from(self.config);
            match connector.connect(host, stream).await {
                Ok(stream) => Ok(RustlsStream(stream)),
                Err(error) => {
                    let certificate = error
                        .get_ref()
                        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                        .is_some_and(|inner| matches!(inner, rustls::Error::InvalidCertificate(_)));
                    Err(io::Error::new(
                        error.kind(),
                        if certificate {
                            format!("the server's certificate was rejected ({}): {error}", self.described)
                        } else {
                            format!("TLS handshake failed ({}): {error}", self.described)
                        },
                    ))
                }
            }
        })
    }
}

/// A TLS connection to the server.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn url_tls_parameters_are_taken_out() {
        let (rest, tls) = split(
            "postgresql://app:pw@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
            no_env,
        )
        .unwrap();
        assert_eq!(rest, "postgresql://app:pw@db:5432/app?application_name=x");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert.as_deref(), Some("/etc/ca.pem"));
        let (rest, tls) = split("postgres://db/app?sslmode=require", no_env).unwrap();
        assert_eq!((rest.as_str(), tls.mode), ("postgres://db/app", SslMode::Require));
        let (rest, tls) = split("postgresql:///app", no_env).unwrap();
        assert_eq!((rest.as_str(), tls.mode), ("postgresql:///app", SslMode::Prefer));
    }

    #[test]
    fn key_value_tls_parameters_are_taken_out() {
        let (rest, tls) = split(
            "host=db sslmode = verify-ca password='a b\\'c' sslrootcert='/etc/my ca.pem' sslcert=/c sslkey=/k",
            no_env,
        )
        .unwrap();
        assert_eq!(rest, "host=db password='a b\\'c'");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.root_cert.as_deref(), Some("/etc/my ca.pem"));
        assert_eq!((tls.cert.unwrap(), tls.key.unwrap()), (PathBuf::from("/c"), PathBuf::from("/k")));
        assert!(split("host=db sslmode='x", no_env).is_err());
    }

    #[test]
    fn environment_fills_what_the_string_does_not_set() {
        let env = |name: &str| match name {
            "PGSSLMODE" => Some("verify-full".to_string()),
            "PGSSLROOTCERT" => Some("/env/ca".to_string()),
            _ => None,
        };
        let tls = split("host=db sslmode=disable", env).unwrap().1;
        assert_eq!((tls.mode, tls.root_cert.as_deref()), (SslMode::Disable, Some("/env/ca")));
        assert_eq!(split("host=db", env).unwrap().1.mode, SslMode::VerifyFull);
    }

    #[test]
    fn bad_settings_are_refused_with_their_value() {
        let error = split("host=db sslmode=verify", no_env).unwrap_err();
        assert!(error.contains("\"verify\"") && error.contains("verify-full"), "{error}");
        assert!(split("host=db sslcert=/c", no_env).unwrap_err().contains("sslkey"));
        let tls = split("host=db sslmode=verify-full sslrootcert=/nonexistent/ca.pem", no_env).unwrap().1;
        let error = tls.connector().err().unwrap();
        assert!(error.contains("sslrootcert /nonexistent/ca.pem"), "{error}");
        assert_eq!(tls.postgres_mode(), PostgresSslMode::Require);
    }
}
