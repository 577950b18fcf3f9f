//! Files that hold secrets (a Redis password, a TLS client key): refused when their group or
//! others may access them, as libpq refuses such a `.pgpass`, since such a file may already have
//! leaked and refusing it makes the operator notice. Errors name the setting and the path, never
//! the contents.

use std::fs;
use std::path::Path;

/// Refuses `path` (named by `setting` in the error) unless only its owner may access it.
pub fn check_private(setting: &str, path: &Path) -> Result<(), String> {
    let metadata = fs::metadata(path).map_err(|e| format!("cannot read {setting} \"{}\": {e}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if metadata.permissions().mode() & 0o077 != 0 {
            return Err(format!(
                "{setting} \"{}\" has group or world access; it must be accessible by its owner only (chmod 600)",
                path.display()
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = metadata;
    Ok(())
}

/// A file's bytes, the error naming `setting`.
pub fn read(setting: &str, path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("cannot read {setting} \"{}\": {e}", path.display()))
}

/// The password in an owner-only file; trailing newlines (an editor's, or `echo`'s) are not part
/// of it, and an empty one is refused.
pub fn read_password(setting: &str, path: &Path) -> Result<String, String> {
    check_private(setting, path)?;
    let contents =
        fs::read_to_string(path).map_err(|e| format!("cannot read {setting} \"{}\": {e}", path.display()))?;
    let password = contents.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        return Err(format!("{setting} \"{}\" is empty", path.display()));
    }
    Ok(password.to_string())
}

/// The TLS files a Redis client may be given, read: the CA certificates the server's certificate
/// must chain to, and a client certificate with its (owner-only) key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsMaterial {
    pub ca: Option<Vec<u8>>,
    /// (certificate, key), both PEM.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

/// The names of the three settings, for the errors (`outbox.redis_tls_ca_file`, or the consumer's
/// `tls_ca_file`).
pub struct TlsSettings<'a> {
    pub ca_file: &'a str,
    pub cert_file: &'a str,
    pub key_file: &'a str,
}

/// Reads the TLS files: a CA file that holds no PEM certificate is refused (every handshake would
/// fail with an unhelpful "unknown issuer"), the key must be owner-only, and a certificate without
/// its key (or the reverse) is refused.
pub fn read_tls(
    names: &TlsSettings<'_>,
    ca_file: Option<&Path>,
    cert_file: Option<&Path>,
    key_file: Option<&Path>,
) -> Result<TlsMaterial, String> {
    let ca = match ca_file {
        Some(path) => {
            let pem = read(names.ca_file, path)?;
            if !contains_pem_certificate(&pem) {
                return Err(format!("{} \"{}\" contains no PEM certificate", names.ca_file, path.display()));
            }
            Some(pem)
        }
        None => None,
    };
    let client = match (cert_file, key_file) {
        (Some(cert), Some(key)) => {
            check_private(names.key_file, key)?;
            Some((read(names.cert_file, cert)?, read(names.key_file, key)?))
        }
        (None, None) => None,
        _ => {
            return Err(format!(
                "{} and {} must be set together (mutual TLS needs both)",
                names.cert_file, names.key_file
            ))
        }
    };
    Ok(TlsMaterial { ca, client })
}

fn contains_pem_certificate(pem: &[u8]) -> bool {
    const BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----";
    pem.windows(BEGIN.len()).any(|window| window == BEGIN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("outbox_protocol_{name}_{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_password_file_must_be_private_and_not_empty() {
        let dir = scratch("pw");
        let path = dir.join("pw");
        fs::write(&path, "hunter2\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let error = read_password("password_file", &path).unwrap_err();
        assert!(error.contains("chmod 600") && !error.contains("hunter2"), "{error}");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password("password_file", &path).unwrap(), "hunter2");
        fs::write(&path, "\n").unwrap();
        assert!(read_password("password_file", &path).unwrap_err().contains("is empty"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tls_files_are_checked_before_use() {
        let dir = scratch("tls");
        let names = TlsSettings { ca_file: "ca", cert_file: "cert", key_file: "key" };
        let (ca, cert, key) = (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"));
        fs::write(&ca, "not a certificate").unwrap();
        assert!(read_tls(&names, Some(&ca), None, None).unwrap_err().contains("no PEM certificate"));
        fs::write(&ca, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").unwrap();
        assert!(read_tls(&names, Some(&ca), None, None).unwrap().ca.is_some());
        fs::write(&cert, "c").unwrap();
        fs::write(&key, "k").unwrap();
        assert!(read_tls(&names, None, Some(&cert), None).unwrap_err().contains("must be set together"));
        fs::set_permissions(&key, fs::Permissions::from_mode(0o640)).unwrap();
        assert!(read_tls(&names, None, Some(&cert), Some(&key)).unwrap_err().contains("owner only"));
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        let material = read_tls(&names, None, Some(&cert), Some(&key)).unwrap();
        assert_eq!(material.client, Some((b"c".to_vec(), b"k".to_vec())));
        assert_eq!(read_tls(&names, None, None, None).unwrap(), TlsMaterial::default());
        fs::remove_dir_all(&dir).unwrap();
    }
}
