//! `outbox-relay`: outbox_pg's relay outside the server, for databases where the library cannot
//! be loaded (docs/outside-relay.md). One module per concern: `config` (flags, environment, file),
//! `log` (stderr lines, redaction), `pg` (the round's database interface over a client
//! connection), `readiness` (what is missing before relaying), `wake` (the commit wake-up),
//! `rounds` (the round), `run` (the process: signals, connect and reconnect, the loop), `tls`
//! (libpq's sslmode over rustls).

pub mod config;
pub mod log;
pub mod password;
pub mod pg;
pub mod readiness;
pub mod reads;
pub mod rounds;
pub mod run;
pub mod tls;
pub mod wake;
