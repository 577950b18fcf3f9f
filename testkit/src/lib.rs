//! Private servers for outbox_pg's tests, demo and benchmark: PostgreSQL clusters of any
//! installation (`pg_config`), `redis-server`s (plain, TLS, password), a Sentinel set and a Redis
//! Cluster, each on free loopback ports and in a directory of its own, plus the certificates,
//! waits and commands they need.
//!
//! One crate, so that every caller starts servers the same way: the extension's integration tests
//! (through `tests/common`, which adds the workload and the invariant checker), the consumer
//! crate's tests, and the demo and the bench (through the `outbox-servers` binary). What a server
//! needs in order to start reliably is written once: PostgreSQL run as the `postgres` OS user when
//! the caller is root, ports that may be lost to another process between choosing and binding
//! (Redis is started again on others), and waits that poll against a deadline, never fixed
//! sleeps.
//!
//! Why a binary for the shell scripts rather than a shell copy of this crate: the demo and the
//! bench then run the very code the tests run (initdb as `postgres`, settings, the cluster's
//! health check), and a fix to one is a fix to all. `outbox-servers up --dir D` prints the ports
//! as shell assignments for `eval`, leaves the servers running, and `down --dir D` stops them.
//!
//! Every server is stopped when its handle is dropped, also when a test fails; a failed test's
//! PostgreSQL keeps its directory and prints its log.

mod cluster;
mod dirs;
mod memory;
mod os;
mod postgres;
mod redis_server;
mod sentinel;
mod tls;
mod wait;

pub use cluster::{ClusterNode, ClusterOptions, RedisCluster};
pub use dirs::{scratch_root, TempDir};
pub use memory::{rss_kb, vm_size_kb, PeakMemory};
pub use os::{as_server_user, chown_to_server_user, free_port, output_within, run, running_as_root};
pub use postgres::{default_pg_config, try_connect, Cluster, ClusterBuilder, PgInstall};
pub use redis_server::{redis_client, redis_server_binary, stream_keys_on, Redis, RedisOptions, StreamStore};
pub use sentinel::{SentinelSet, SENTINEL_MASTER};
pub use tls::{Certificates, ClientTls};
pub use wait::{wait_for, DEADLINE};
