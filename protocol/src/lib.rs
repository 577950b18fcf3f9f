//! What the outbox_pg relay (the extension) and the consumers agree on, written once and used by
//! both: the fields of a stream entry in each format (`entry`), what a valid W3C trace context is
//! (`trace`), how a Redis URL names its nodes and how it is shown without its secrets
//! (`redis_url`), and how secret files are checked and read (`secret_files`). Pure functions, no
//! I/O but reading the files named, no dependencies: the extension builds it into a PostgreSQL
//! library, the consumer crate into a CLI.

pub mod entry;
pub mod redis_url;
pub mod secret_files;
pub mod trace;
