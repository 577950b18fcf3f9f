//! The relay's round, written once for the background worker (over SPI) and for `outbox-relay`
//! outside the server (over a client connection): docs/outside-relay.md. For now the database
//! interface the round runs its statements through (`db`); the round's decisions follow.

pub mod db;
