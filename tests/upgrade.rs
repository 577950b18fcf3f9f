//! `ALTER EXTENSION outbox_pg UPDATE` from the previous release, the way a DBA does it: the previous
//! release (built from its git tag, sql/releases) is installed and running with published, failed
//! and undelivered events and its relays up; then this version's library and scripts are
//! installed, the server restarts, the relays wait for the update (nothing is published by a
//! library whose statements the old schema may not have), and after the update every undelivered
//! event is delivered once, in order, `aggregate_seq` continuing, failed events stay failed and the
//! settings hold. Finally the upgraded schema must equal a fresh install of this version, object
//! by object: an upgrade script that forgets something fails here.
//!
//! The test swaps the files in PostgreSQL's directories (by rename, so running servers keep theirs)
//! and puts this version's files back when it ends, however it ends.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    enqueue_to, pg_config, publish_and_fail, run, seqs_of, status_counts, status_of, wait_for, Cluster, PgInstall,
    PublishedAndFailed, Redis, SwappedExtension, DEADLINE,
};

const CURRENT: &str = env!("CARGO_PKG_VERSION");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The release before this version: the last line of sql/releases whose version differs.
fn previous_release() -> (String, String) {
    let releases = fs::read_to_string(Path::new(ROOT).join("sql/releases")).expect("sql/releases");
    releases
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.to_string()))
        })
        .rfind(|(version, _)| version != CURRENT)
        .expect("sql/releases names no earlier release")
}

fn git(args: &[&str]) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C").arg(ROOT).args(args);
    cmd
}

/// Builds `version` from its tag (or, in a clone without tags, the commit sql/releases names) with
/// `cargo pgrx package` for the PostgreSQL under test, once: the package directory is kept under
/// target/upgrade/ for later runs, one per major (their builds share one target directory).
fn build_release(version: &str, commit: &str) -> PathBuf {
    let work = Path::new(ROOT).join("target/upgrade").join(version);
    let major = std::env::var("PG_MAJOR").unwrap_or_else(|_| "15".into());
    let package = work.join(format!("package-pg{major}"));
    let stamp = work.join(format!("built-from-pg{major}"));
    if fs::read_to_string(&stamp).ok().as_deref() == Some(commit) && package.exists() {
        return package;
    }
    let tag = format!("v{version}^{{commit}}");
    let resolved = git(&["rev-parse", "--verify", "--quiet", &tag]).output().expect("git rev-parse");
    let rev = if resolved.status.success() {
        let tagged = String::from_utf8_lossy(&resolved.stdout).trim().to_string();
        assert!(tagged.starts_with(commit), "tag v{version} is {tagged}, but sql/releases says {commit}");
        tagged
    } else {
        commit.to_string()
    };
    let source = work.join("source");
    let _ = fs::remove_dir_all(&source);
    let _ = fs::remove_dir_all(&package);
    fs::create_dir_all(&source).unwrap();
    // The release's tree, without touching this checkout.
    let archive = work.join("source.tar");
    let mut archive_cmd = git(&["archive", "--format=tar", "-o"]);
    archive_cmd.arg(&archive).arg(&rev);
    run(archive_cmd, &format!("git archive {rev} (is release {version} in this clone's history?)"));
    let mut untar = Command::new("tar");
    untar.arg("-xf").arg(&archive).arg("-C").arg(&source);
    run(untar, "tar -x");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let feature = format!("pg{major}");
    let mut build = Command::new(cargo);
    build
        .current_dir(&source)
        .args(["pgrx", "package", "--debug", "--no-default-features", "--features", &feature, "--pg-config"])
        .arg(pg_config("--bindir").join("pg_config"))
        .arg("--out-dir")
        .arg(&package)
        .env("CARGO_TARGET_DIR", work.join("target"))
        .env_remove("RUSTFLAGS");
    run(build, &format!("cargo pgrx package of release {version}"));
    fs::write(&stamp, commit).unwrap();
    package
}

fn relays(client: &mut postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_pg relay'", &[])
        .unwrap()
        .get(0)
}

fn extension_version(client: &mut postgres::Client) -> String {
    client.query_one("SELECT extversion::text FROM pg_extension WHERE extname = 'outbox_pg'", &[]).unwrap().get(0)
}

/// One line per object of the extension, with everything that defines it: function bodies and
/// settings, columns, constraints, indexes, triggers, view definitions, storage options, comments,
/// privileges, and what pg_dump keeps.
const SCHEMA_SIGNATURE: &str = r#"
WITH ext AS (SELECT oid, extconfig, extcondition FROM pg_extension WHERE extname = 'outbox_pg'),
members AS (
    SELECT d.classid, d.objid FROM pg_depend d, ext
     WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = ext.oid AND d.deptype = 'e'
)
SELECT pg_describe_object(m.classid, m.objid, 0) || ' :: ' ||
       coalesce(obj_description(m.objid, (SELECT relname FROM pg_class WHERE oid = m.classid)), '') || ' :: ' ||
       CASE m.classid
       WHEN 'pg_proc'::regclass THEN
           pg_get_functiondef(m.objid) || coalesce((SELECT proacl::text FROM pg_proc WHERE oid = m.objid), '')
       WHEN 'pg_class'::regclass THEN (
           SELECT c.relkind::text || ' ' || coalesce(array_to_string(c.reloptions, ','), '') || ' ' || coalesce(c.relacl::text, '')
                  || ' | ' || coalesce((SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                                          || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                                                          || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), '')
                                                          || coalesce(' collate ' || co.collname, '')
                                                          || coalesce(' -- ' || col_description(c.oid, a.attnum), ''),
                                                          ', ' ORDER BY a.attnum)
                                          FROM pg_attribute a
                                          LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
                                          LEFT JOIN pg_collation co ON co.oid = a.attcollation AND co.collname <> 'default'
                                         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '')
                  || ' | ' || coalesce((SELECT string_agg(pg_get_indexdef(i.indexrelid), '; ' ORDER BY pg_get_indexdef(i.indexrelid))
                                          FROM pg_index i WHERE i.indrelid = c.oid), '')
                  || ' | ' || coalesce((SELECT string_agg(k.conname || ' ' || pg_get_constraintdef(k.oid), '; ' ORDER BY k.conname)
                                          FROM pg_constraint k WHERE k.conrelid = c.oid), '')
                  || ' | ' || coalesce((SELECT string_agg(pg_get_triggerdef(t.oid), '; ' ORDER BY t.tgname)
                                          FROM pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal), '')
                  || ' | ' || CASE WHEN c.relkind = 'v' THEN pg_get_viewdef(c.oid) ELSE '' END
                  || ' | ' || CASE WHEN c.oid = ANY (coalesce((SELECT extconfig FROM ext), '{}'::oid[])) THEN 'dumped' ELSE '' END
             FROM pg_class c WHERE c.oid = m.objid)
       WHEN 'pg_type'::regclass THEN format_type(m.objid, NULL)
       ELSE ''
       END
  FROM members m
"#;

fn schema_signature(client: &mut postgres::Client) -> BTreeSet<String> {
    client
        .query(SCHEMA_SIGNATURE, &[])
        .unwrap()
        .into_iter()
        .map(|row| row.get::<_, String>(0))
        // The test build (scripts/test.sh installs it) adds schema `tests` with the #[pg_test]
        // functions and the helpers of src/sql/test_helpers.sql; no release has them.
        .filter(|line| !["schema tests ", "function tests.", "type tests."].iter().any(|test| line.starts_with(test)))
        .collect()
}

#[test]
fn an_update_from_the_previous_release_keeps_every_event_and_setting() {
    let (previous, commit) = previous_release();
    let old_package = build_release(&previous, &commit);
    let installed = SwappedExtension::save(PgInstall::under_test(), Path::new(ROOT).join("target/upgrade/current"));
    assert!(installed.had_library(), "outbox_pg is not installed; run scripts/test.sh");
    installed.install(&old_package);

    let mut redis = Redis::start();
    let pg =
        Cluster::start(redis.port, &["outbox.max_attempts = 1", "outbox.poll_interval = '50ms'", "outbox.workers = 2"]);
    let mut client = pg.connect();
    client.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    pg.set(&mut client, &[("outbox.batch_size", "321")]);
    assert_eq!(extension_version(&mut client), previous);

    // Published, failed (with its aggregate's next event waiting behind it), undelivered.
    let PublishedAndFailed { published, poison, behind_poison } = publish_and_fail(&mut client, &redis);
    wait_for(DEADLINE, "two relays", || (relays(&mut client) == 2).then_some(()));
    redis.kill();
    let undelivered = [
        enqueue_to(&mut client, "payment", "1", None),
        enqueue_to(&mut client, "payment", "2", None),
        enqueue_to(&mut client, "payment", "1", None),
    ];
    assert_eq!(status_counts(&mut client).get("pending"), Some(&4));
    drop(client);

    // This version's library and scripts; the server restarts onto the new library. Redis comes
    // back empty, so that every entry seen from now on was published by the new library.
    installed.restore();
    pg.pg_ctl_stop("fast");
    pg.pg_ctl_start();
    redis.restart();
    let mut client = pg.connect();
    let waiting = format!("has extension outbox_pg {previous} but the server runs library {CURRENT}");
    wait_for(DEADLINE, "the relays to wait for ALTER EXTENSION UPDATE", || pg.log().contains(&waiting).then_some(()));
    let stats_error: String =
        client.query_one("SELECT coalesce(last_error, '') FROM outbox.stats", &[]).unwrap().get(0);
    assert!(stats_error.contains(&waiting), "outbox.stats.last_error: {stats_error}");
    assert_eq!(redis.total_entries(), 0, "the new library published before the update");

    client.batch_execute("ALTER EXTENSION outbox_pg UPDATE").unwrap();
    assert_eq!(extension_version(&mut client), CURRENT);
    // Each aggregate's events in order, numbered after the old counters. (Two relays hold
    // different shards, so the two aggregates may interleave either way.)
    let entries = redis.wait_for_entries("outbox:payment", 3);
    let of = |aggregate: &str| seqs_of(&entries, aggregate);
    assert_eq!(of("1"), [(undelivered[0].clone(), "4".to_string()), (undelivered[2].clone(), "5".to_string())]);
    assert_eq!(of("2"), [(undelivered[1].clone(), "1".to_string())]);
    assert_eq!(status_of(&mut client, &poison), "failed");
    assert_eq!(status_of(&mut client, &behind_poison), "pending");
    for id in &published {
        assert_eq!(status_of(&mut client, id), "published");
    }
    // Settings and relays as before.
    let batch_size: String = client.query_one("SHOW outbox.batch_size", &[]).unwrap().get(0);
    assert_eq!(batch_size, "321");
    wait_for(DEADLINE, "two relays after the restart", || (relays(&mut client) == 2).then_some(()));
    // The failure path still works: the dead letter goes when retried (no poisoned key any more).
    assert_eq!(client.query_one("SELECT outbox.retry_failed()", &[]).unwrap().get::<_, i64>(0), 1);
    assert_eq!(redis.wait_for_entries("poisoned", 1)[0]["event_id"], poison);
    assert_eq!(redis.wait_for_entries("outbox:refund", 1)[0]["event_id"], behind_poison);
    let after = enqueue_to(&mut client, "payment", "1", None);
    assert_eq!(redis.wait_for_entries("outbox:payment", 4)[3]["aggregate_seq"], "6");
    assert_eq!(redis.entries("outbox:payment")[3]["event_id"], after);
    assert_eq!(redis.total_entries(), 6, "nothing published twice");

    // The upgraded schema is the one a fresh install makes.
    client.batch_execute("CREATE DATABASE fresh").unwrap();
    let mut fresh = pg.connect_to("fresh");
    fresh.batch_execute("CREATE EXTENSION outbox_pg").unwrap();
    let upgraded = schema_signature(&mut client);
    let expected = schema_signature(&mut fresh);
    let missing: Vec<&String> = expected.difference(&upgraded).collect();
    let extra: Vec<&String> = upgraded.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the upgrade from {previous} does not make what a fresh install of {CURRENT} makes:\n\
         --- in a fresh install only:\n{missing:#?}\n--- in the upgraded database only:\n{extra:#?}"
    );
}
