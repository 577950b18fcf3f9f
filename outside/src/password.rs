//! `OUTBOX_REDIS_PASSWORD` handed to outbox-sink, which reads the Redis password from a file at
//! each connect: an anonymous in-memory file (`memfd_create`), readable by its owner only and
//! named by `/proc/self/fd/N`, so the password never touches a disk or a directory another process
//! can list.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};

/// The password in an anonymous file, open for the life of this value.
pub struct PasswordFile {
    file: File,
}

impl PasswordFile {
    pub fn new(password: &str) -> std::io::Result<PasswordFile> {
        // SAFETY: a valid NUL-terminated name and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"outbox-redis-password".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let mut file = unsafe { File::from_raw_fd(fd) };
        // SAFETY: fchmod on an open descriptor; a memfd is created 0777, which the sink refuses
        // for a password file, as libpq refuses a readable .pgpass.
        if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        file.write_all(password.as_bytes())?;
        Ok(PasswordFile { file })
    }

    /// The path the sink reads the password from.
    pub fn path(&self) -> String {
        format!("/proc/self/fd/{}", self.file.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sink_reads_the_password_back() {
        let file = PasswordFile::new("hunter2\n").unwrap();
        assert_eq!(outbox_sink::address::read_password_file(&file.path()).unwrap(), "hunter2");
        // Read at every connect: the second read sees it too.
        assert_eq!(outbox_sink::address::read_password_file(&file.path()).unwrap(), "hunter2");
    }
}
