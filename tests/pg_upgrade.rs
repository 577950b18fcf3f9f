//! `pg_upgrade` of a cluster with outbox_pg from PostgreSQL `PG_UPGRADE_FROM` (default 15) to the
//! major under test (`PG_MAJOR`, `PG_CONFIG`), the way docs/install.md tells a DBA to do it: the old
//! cluster preloads the extension and holds published, failed (dead-lettered) and pending events,
//! its relays are paused (`outbox.enabled = off`) and the server stopped; both majors have the
//! extension's files installed; `pg_upgrade` copies the cluster into a new one, which then starts
//! and delivers every pending event exactly once, in order per aggregate, `aggregate_seq`
//! continuing; failed events stay failed, published ones are not sent again, and retention and
//! the cursors go on working.
//!
//! What the log relies on: its `txid` column and the cursors (`pg_snapshot`) are 64-bit
//! transaction ids of the cluster that wrote them. pg_upgrade is not a dump and restore (no
//! rebase runs, src/sql/restore.sql): it keeps the data files and sets the new cluster's next
//! transaction id, epoch included, to the old one's. The test proves it on a cluster whose epoch
//! is 7 (pg_resetwal), which a fresh initdb never has: after the upgrade the log's txids and the
//! cursors are the old ones, byte for byte, every one of them lies below the new cluster's first
//! snapshot, and the new cluster's own transactions continue above them (a counter started afresh
//! would make every new event look consumed already, and it would never be published).
//!
//! `PG_UPGRADE_FROM_CONFIG` names the old installation's pg_config; by default it is
//! scripts/pg-config.sh's for `PG_UPGRADE_FROM` (PyPI's 15.19.0: Debian's 15.20 could not be
//! upgraded to the 16-18 builds here, whatever the cluster held; docs/install.md).
//!
//! When `PG_UPGRADE_FROM` is another major than the one under test, the test builds the extension
//! for it (`cargo pgrx package`, kept under target/pg_upgrade/) and installs it into that
//! server's directories for the duration of the test, putting back what was there when it ends.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    enqueue_to, free_port, publish_and_fail, run, seqs_of, status_counts, status_of, wait_for, Cluster, PgInstall,
    PublishedAndFailed, Redis, SwappedExtension, DEADLINE,
};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const CURRENT: &str = env!("CARGO_PKG_VERSION");
/// The old cluster's transaction-id epoch: txids above 2^32 that only a kept counter explains.
const EPOCH: i64 = 7;

fn major_under_test() -> String {
    std::env::var("PG_MAJOR").unwrap_or_else(|_| "15".into())
}

/// The pg_config of `major`: $PG_CONFIG for the major under test, else scripts/pg-config.sh's.
fn pg_config_of(major: &str) -> PathBuf {
    if major == major_under_test() {
        if let Ok(path) = std::env::var("PG_CONFIG") {
            return PathBuf::from(path);
        }
    }
    let mut cmd = Command::new("bash");
    cmd.arg(format!("{ROOT}/scripts/pg-config.sh")).arg(major);
    PathBuf::from(run(cmd, "scripts/pg-config.sh").trim())
}

/// One PostgreSQL installation of a known major.
struct Installation {
    pg: PgInstall,
    major: String,
}

impl Installation {
    fn of(major: &str) -> Installation {
        Installation::checked(PgInstall::at(pg_config_of(major)), major, "its pg_config")
    }

    /// The old cluster's installation: `PG_UPGRADE_FROM_CONFIG` when set (scripts/test.sh: PyPI's
    /// 15.19.0 for an upgrade into another major), else `PG_UPGRADE_FROM`'s (default 15).
    fn upgrade_source() -> Installation {
        let major = std::env::var("PG_UPGRADE_FROM").unwrap_or_else(|_| "15".into());
        match std::env::var("PG_UPGRADE_FROM_CONFIG") {
            Ok(pg_config) => Installation::checked(PgInstall::at(pg_config), &major, "PG_UPGRADE_FROM_CONFIG"),
            Err(_) => Installation::of(&major),
        }
    }

    fn checked(pg: PgInstall, major: &str, named_by: &str) -> Installation {
        assert!(
            pg.version().starts_with(&format!("PostgreSQL {major}.")),
            "{named_by} ({}) is {}, not PostgreSQL {major}",
            pg.pg_config().display(),
            pg.version()
        );
        Installation { pg, major: major.to_string() }
    }
}

/// This checkout's extension, built for `old` into target/pg_upgrade/ (cargo builds it again only
/// when the source changed).
fn build_for(old: &Installation) -> PathBuf {
    let work = Path::new(ROOT).join("target/pg_upgrade");
    let package = work.join(format!("package-pg{}", old.major));
    let _ = fs::remove_dir_all(&package);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(ROOT)
        .args(["pgrx", "package", "--debug", "--no-default-features", "--features"])
        .arg(format!("pg{}", old.major))
        .arg("--pg-config")
        .arg(old.pg.pg_config())
        .arg("--out-dir")
        .arg(&package)
        // Not the suite's own target directory: its test build is what the other major runs.
        .env("CARGO_TARGET_DIR", work.join("target"))
        .env_remove("RUSTFLAGS");
    run(build, &format!("cargo pgrx package for PostgreSQL {}", old.major));
    package
}

/// The old major's extension files, installed for the test and taken away after it.
fn install_for(old: &Installation, package: &Path) -> SwappedExtension {
    let backup = Path::new(ROOT).join(format!("target/pg_upgrade/installed-before-pg{}", old.major));
    let swapped = SwappedExtension::save(&old.pg, backup);
    swapped.install(package);
    swapped
}

/// A cluster of `installation` relaying to the Redis on `redis_port`, not started: UTF-8, C
/// locale, and no data checksums on any major, so that both clusters of an upgrade match.
fn cluster_of(installation: &Installation, redis_port: u16, extra: &[&str]) -> Cluster {
    let mut cluster = Cluster::builder(&installation.pg)
        .for_tests()
        .outbox_relaying_to(&format!("redis://127.0.0.1:{redis_port}"))
        .settings(&["outbox.redis_timeout = '2s'", "outbox.poll_interval = '50ms'", "outbox.max_attempts = 1"])
        .settings(extra);
    // PostgreSQL 18's initdb enables data checksums by default; pg_upgrade needs both clusters alike.
    if installation.pg.major() >= 18 {
        cluster = cluster.initdb_args(&["--no-data-checksums"]);
    }
    cluster.create()
}

/// `Latest checkpoint's NextXID` of a stopped cluster, as (epoch, xid).
fn next_xid(cluster: &Cluster) -> (i64, i64) {
    let mut cmd = cluster.install().server_command("pg_controldata");
    cmd.arg("-D").arg(&cluster.data).env("LC_ALL", "C");
    let out = run(cmd, "pg_controldata");
    let line = out.lines().find(|l| l.starts_with("Latest checkpoint's NextXID:")).expect("NextXID line");
    let (epoch, xid) = line.rsplit(' ').next().unwrap().split_once(':').unwrap();
    (epoch.parse().unwrap(), xid.parse().unwrap())
}

/// What pg_upgrade must carry over untouched: the log with its txids, the cursors (whole rows but
/// for which relay holds the shard), the counters, the tables' turns with their txid bounds, the
/// failure path.
#[derive(Debug, PartialEq)]
struct State {
    log: Vec<(i64, String, String, String)>,
    shards: Vec<String>,
    counters: Vec<String>,
    generations: Vec<String>,
    held: Vec<String>,
}

fn state(client: &mut postgres::Client) -> State {
    let rows = |client: &mut postgres::Client, sql: &str| -> Vec<String> {
        client.query(sql, &[]).unwrap().iter().map(|r| r.get(0)).collect()
    };
    State {
        log: client
            .query("SELECT id, event_id::text, txid::text, status FROM outbox.messages ORDER BY id", &[])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect(),
        shards: rows(
            client,
            "SELECT (to_jsonb(s) - 'claimed_by' - 'claimed_at')::text FROM outbox.shards s ORDER BY shard",
        ),
        counters: rows(client, "SELECT to_jsonb(a)::text FROM outbox.aggregates a ORDER BY 1"),
        generations: rows(client, "SELECT to_jsonb(g)::text FROM outbox.generations g ORDER BY generation"),
        held: rows(client, "SELECT to_jsonb(h)::text FROM outbox.held h ORDER BY id"),
    }
}

fn one_i64(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

#[test]
fn pg_upgrade_keeps_every_event_its_order_and_the_transaction_counter() {
    let old = Installation::upgrade_source();
    let new = Installation::of(&major_under_test());
    assert!(old.pg.major() <= new.pg.major(), "pg_upgrade only goes up");
    // Both majors need the extension's files: the one under test has the suite's install.
    let _old_files = (old.pg.pg_config() != new.pg.pg_config()).then(|| install_for(&old, &build_for(&old)));
    new.pg.require_outbox();
    let redis = Redis::start();

    // The old cluster, its transaction counter moved to epoch 7 before it ever ran.
    let source = cluster_of(&old, redis.port, &[]);
    let mut resetwal = old.pg.server_command("pg_resetwal");
    resetwal.args(["-e", &EPOCH.to_string(), "-D"]).arg(&source.data);
    run(resetwal, "pg_resetwal -e");
    source.pg_ctl_start();
    let mut client = source.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();

    // Published: three events of payment 1. Failed: refund 7's event, with its next one behind it.
    let PublishedAndFailed { published, poison, behind_poison } = publish_and_fail(&mut client, &redis);
    // Pending: the relays are paused, then two aggregates get events, one and several per transaction.
    source.set(&mut client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the relay to report it is off", || {
        source.log().contains("outbox.enabled is off").then_some(())
    });
    let mut pending: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for round in 0..4 {
        let mut txn = client.transaction().unwrap();
        for aggregate in ["1", "2"] {
            for _ in 0..=round % 2 {
                let id: String = txn
                    .query_one("SELECT outbox_enqueue('payment', $1, 'test.event', '{}'::jsonb)::text", &[&aggregate])
                    .unwrap()
                    .get(0);
                pending.entry(aggregate).or_default().push(id);
            }
        }
        txn.commit().unwrap();
    }
    let pending_count: usize = pending.values().map(Vec::len).sum();
    let counts = status_counts(&mut client);
    assert_eq!(counts.get("pending"), Some(&(pending_count as i64 + 1)), "{counts:?}"); // + the one behind the poison
    assert_eq!(counts.get("failed"), Some(&1), "{counts:?}");
    let before = state(&mut client);
    let old_txid = one_i64(&mut client, "SELECT pg_current_xact_id()::text::bigint");
    assert!(
        before.log.iter().all(|(_, _, txid, _)| txid.parse::<i64>().unwrap() >> 32 == EPOCH),
        "the log's txids carry epoch {EPOCH}: {:?}",
        before.log
    );
    drop(client);
    source.pg_ctl_stop("fast");

    // The new cluster: a fresh initdb counts from epoch 0.
    let target = cluster_of(&new, redis.port, &["outbox.enabled = off"]);
    assert_eq!(next_xid(&target).0, 0, "a fresh cluster's epoch");
    let mut upgrade = new.pg.server_command("pg_upgrade");
    upgrade
        .current_dir(&target.dir)
        .arg("-b")
        .arg(old.pg.bindir())
        .arg("-B")
        .arg(new.pg.bindir())
        .arg("-d")
        .arg(&source.data)
        .arg("-D")
        .arg(&target.data)
        .args(["-p", &free_port().to_string(), "-P", &free_port().to_string(), "-U", "postgres", "-s"])
        .arg(&target.dir)
        .env("LC_ALL", "C");
    let report = run(upgrade, "pg_upgrade");
    assert!(report.contains("Upgrade Complete"), "{report}");
    let (epoch, xid) = next_xid(&target);
    assert!(
        epoch == EPOCH && ((epoch << 32) | xid) > old_txid,
        "pg_upgrade set NextXID {epoch}:{xid}, the old cluster was at {old_txid}"
    );

    target.pg_ctl_start();
    let mut client = target.connect();
    assert_eq!(
        client
            .query_one("SELECT extversion::text FROM pg_extension WHERE extname = 'outbox_pg'", &[])
            .unwrap()
            .get::<_, String>(0),
        CURRENT
    );
    // The documented step; a no-op here, since both majors run this version.
    client.batch_execute("ALTER EXTENSION outbox_pg UPDATE").unwrap();
    // Nothing was rebased (a restore would have), nothing moved: same txids, cursors, counters.
    assert_eq!(state(&mut client), before, "pg_upgrade changed the outbox's state");
    assert_eq!(one_i64(&mut client, "SELECT count(*) FROM outbox.restored_shards"), 0);
    // Every txid in the log is in the new cluster's past, and its own transactions come after them.
    let max_logged = before.log.iter().map(|(_, _, txid, _)| txid.parse::<i64>().unwrap()).max().unwrap();
    assert!(one_i64(&mut client, "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint") > max_logged);
    assert!(one_i64(&mut client, "SELECT pg_current_xact_id()::text::bigint") > old_txid);

    // Resumed, with a short retention: the pending events go out once, in order, numbered on.
    target.set(&mut client, &[("outbox.enabled", "on"), ("outbox.retention", "1s")]);
    let after_upgrade = enqueue_to(&mut client, "payment", "1", None);
    let total = 3 + pending_count + 1;
    let entries = redis.wait_for_entries("outbox:payment", total);
    let of = |aggregate: &str| seqs_of(&entries, aggregate);
    let mut expect_1: Vec<String> = published.clone();
    expect_1.extend(pending["1"].iter().cloned());
    expect_1.push(after_upgrade.clone());
    let numbered = |ids: &[String]| -> Vec<(String, String)> {
        ids.iter().enumerate().map(|(n, id)| (id.clone(), (n + 1).to_string())).collect()
    };
    assert_eq!(of("1"), numbered(&expect_1), "payment 1: published before, pending, enqueued after the upgrade");
    assert_eq!(of("2"), numbered(&pending["2"]), "payment 2");
    assert_eq!(status_of(&mut client, &poison), "failed");
    assert_eq!(status_of(&mut client, &behind_poison), "pending");

    // Retention removes the published events (of both clusters) and keeps the failed and the pending.
    wait_for(DEADLINE, "retention to remove the published events", || {
        let counts = status_counts(&mut client);
        (!counts.contains_key("published")).then_some(counts)
    });
    let counts = status_counts(&mut client);
    assert_eq!((counts.get("failed"), counts.get("pending")), (Some(&1), Some(&1)), "{counts:?}");
    // The dead letter and the event behind it go once retried.
    redis::cmd("DEL").arg("poisoned").query::<()>(&mut redis.connection()).unwrap();
    assert_eq!(one_i64(&mut client, "SELECT outbox.retry_failed()"), 1);
    assert_eq!(redis.wait_for_entries("poisoned", 1)[0]["event_id"], poison);
    let refund = redis.wait_for_entries("outbox:refund", 1);
    assert_eq!((refund[0]["event_id"].as_str(), refund[0]["aggregate_seq"].as_str()), (behind_poison.as_str(), "2"));
    assert_eq!(redis.xlen("outbox:payment"), total, "an event was published twice");
    drop(client);
    target.pg_ctl_stop("fast");
}
