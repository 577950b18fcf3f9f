//! Races between sessions, each driven in the one order that used to break a promise (issue 23),
//! the way PostgreSQL's isolation tester steps its sessions: every step runs to completion or is
//! seen waiting for a lock before the next one is sent (tests/common/steps.rs). Each test failed
//! on 0.3.0 as it was before the fix it names, and passes now.

mod common;

use common::steps::{Session, Step};
use common::{status_of, wait_for, Env, DEADLINE};

/// One aggregate id of `aggregate_type` in each of the 16 shards.
fn one_per_shard(client: &mut postgres::Client, aggregate_type: &str) -> Vec<String> {
    client
        .query(
            "SELECT DISTINCT ON (tests.shard_of($1, i::text)) i::text
               FROM generate_series(1, 1000) i ORDER BY tests.shard_of($1, i::text), i",
            &[&aggregate_type],
        )
        .unwrap()
        .into_iter()
        .map(|row| row.get(0))
        .collect()
}

fn pause_relays(env: &Env, client: &mut postgres::Client) {
    let paused_before = env.pg.log().matches("outbox.enabled is off").count();
    env.pg.set(client, &[("outbox.enabled", "off")]);
    wait_for(DEADLINE, "the relay to pause", || {
        (env.pg.log().matches("outbox.enabled is off").count() > paused_before).then_some(())
    });
}

/// Item 1. A writer takes its transaction id after a purge switched the log to its next table but
/// before that switch committed, so it still writes into the old table; a second purge closes the
/// old table while the writer runs. The bound retention used to close with was the xmax of a
/// snapshot (one above the latest *completed* id), which was not above the writer's id: once every
/// cursor had passed everything but the running writer, the table passed the truncate test, and
/// the writer's event, committed a moment later, was truncated without ever being published.
#[test]
fn retention_never_truncates_a_table_a_writer_still_running_when_it_closed_wrote_to() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut admin = env.pg.connect();
    // The current table holds an event, so that purge switches away from it.
    admin.batch_execute("SELECT outbox_enqueue('seed', '0', 'e', '{}')").unwrap();
    env.redis.wait_for_entries("outbox:seed", 1);

    let mut switcher = Session::open(&env.pg, "postgres", "switcher");
    let mut writer = Session::open(&env.pg, "postgres", "writer");
    switcher.run("BEGIN");
    switcher.run("SELECT outbox.purge('0')");
    writer.run("BEGIN");
    let event = writer.value("SELECT outbox_enqueue('late', '1', 'e', '{}')::text").unwrap();
    let writer_xid: i64 = writer.value("SELECT pg_current_xact_id()::text").unwrap().parse().unwrap();
    switcher.run("COMMIT");
    // The writer's row went into the table the switch left: it read the generations before the
    // switch committed.
    let table = writer.value(&format!("SELECT generation FROM outbox.events WHERE event_id = '{event}'"));
    assert_eq!(table.as_deref(), Some("0"));

    // Close it while the writer runs.
    admin.batch_execute("SELECT outbox.purge('0')").unwrap();
    let (state, closed_below): (String, i64) = {
        let row = admin
            .query_one("SELECT state, closed_below::text::bigint FROM outbox.generations WHERE generation = 0", &[])
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(state, "closed");
    assert!(
        closed_below > writer_xid,
        "the closed table's bound ({closed_below}) must be above its running writer ({writer_xid})"
    );

    // Every shard's cursor moves past everything but the running writer.
    let ids = one_per_shard(&mut admin, "spread");
    for id in &ids {
        admin.execute("SELECT outbox_enqueue('spread', $1, 'e', '{}')", &[id]).unwrap();
    }
    env.redis.wait_for_entries("outbox:spread", 16);
    wait_for(DEADLINE, "every shard's cursor to have moved past the spread events", || {
        let moved: bool = admin
            .query_one(
                "SELECT bool_and(status = 'published') FROM outbox.messages WHERE aggregate_type = 'spread'",
                &[],
            )
            .unwrap()
            .get(0);
        moved.then_some(())
    });

    // With the relays paused, the writer commits and retention runs: the event stays.
    pause_relays(&env, &mut admin);
    writer.run("COMMIT");
    for _ in 0..3 {
        admin.batch_execute("SELECT outbox.purge('0')").unwrap();
    }
    assert_eq!(status_of(&mut admin, &event), "pending", "the committed event is still there, undelivered");
    env.pg.set(&mut admin, &[("outbox.enabled", "on")]);
    let entries = env.redis.wait_for_entries("outbox:late", 1);
    assert_eq!(entries[0]["event_id"], event);
}

/// Item 6. `outbox.purge(older_than)` removed what was younger than `older_than`: run twice a few
/// seconds apart, `purge('1 day')` removed an event published seconds before.
#[test]
fn purge_removes_only_what_is_older_than_it_is_asked() {
    let env = Env::start(&["outbox.poll_interval = '100ms'"]);
    let mut admin = env.pg.connect();
    let event = common::enqueue_to(&mut admin, "young", "1", None);
    env.redis.wait_for_entries("outbox:young", 1);
    wait_for(DEADLINE, "the event to show published", || (status_of(&mut admin, &event) == "published").then_some(()));
    let ids = one_per_shard(&mut admin, "spread");
    for round in 0..2 {
        let removed: i64 = admin.query_one("SELECT outbox.purge('1 day')", &[]).unwrap().get(0);
        assert_eq!(removed, 0, "purge('1 day') #{round} removed a seconds-old event");
        // Every shard's cursor moves on, so that nothing but age keeps the table.
        for id in &ids {
            admin.execute("SELECT outbox_enqueue('spread', $1, 'e', '{}')", &[id]).unwrap();
        }
        env.redis.wait_for_entries("outbox:spread", 16 * (round + 1));
    }
    assert_eq!(status_of(&mut admin, &event), "published", "still kept: it is seconds old");
    let states: String = admin
        .query_one("SELECT string_agg(state, ',' ORDER BY generation) FROM outbox.generations", &[])
        .unwrap()
        .get(0);
    assert_eq!(states, "current,empty,empty", "nothing older than a day: nothing to switch away from");

    // purge('0') removes every published event, once the relays have consumed its table.
    admin.batch_execute("SELECT outbox.purge('0')").unwrap();
    for id in &ids {
        admin.execute("SELECT outbox_enqueue('spread', $1, 'e', '{}')", &[id]).unwrap();
    }
    env.redis.wait_for_entries("outbox:spread", 48);
    wait_for(DEADLINE, "purge('0') to remove the published events", || {
        admin.batch_execute("SELECT outbox.purge('0')").unwrap();
        let left: i64 = admin
            .query_one("SELECT count(*) FROM outbox.messages WHERE event_id = $1::text::uuid", &[&event])
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    });
}

/// Item 4. A transaction that enqueued for 256 aggregates in a savepoint and rolled it back still
/// counted those order locks: its next enqueue, for aggregate X, took no lock, so a second
/// transaction enqueued for X without waiting, committed first, and Redis got the later commit with
/// the lower aggregate_seq.
#[test]
fn a_rolled_back_savepoint_leaves_the_order_lock_of_the_next_aggregate_to_be_taken() {
    let env = Env::start(&[]);
    let mut first = Session::open(&env.pg, "postgres", "first");
    let mut second = Session::open(&env.pg, "postgres", "second");
    first.run("BEGIN");
    first.run("SAVEPOINT bulk");
    first.run("SELECT outbox_enqueue('undone', i::text, 'e', '{}') FROM generate_series(1, 256) i");
    first.run("ROLLBACK TO SAVEPOINT bulk");
    let first_event = first.value("SELECT outbox_enqueue('acct', 'X', 'first', '{}')::text").unwrap();
    second.run("BEGIN");
    second.blocks("SELECT outbox_enqueue('acct', 'X', 'second', '{}')::text");
    first.run("COMMIT");
    let second_event = second.finish().unwrap()[0][0].clone().unwrap();
    second.run("COMMIT");
    let entries = env.redis.wait_for_entries("outbox:acct", 2);
    let order: Vec<(&str, &str)> =
        entries.iter().map(|e| (e["event_id"].as_str(), e["aggregate_seq"].as_str())).collect();
    assert_eq!(order, [(first_event.as_str(), "1"), (second_event.as_str(), "2")]);
    assert_eq!(env.redis.xlen("outbox:undone"), 0, "the rolled-back events never existed");
}

/// Item 9. Past the order-lock cap a transaction enqueues without the aggregate's lock, so
/// `outbox.forget_aggregates` could not see its uncommitted event and dropped the aggregate's
/// counter: the event then went out numbered 1 after a 5.
#[test]
fn forget_aggregates_forgets_nothing_while_a_transaction_past_the_lock_cap_runs() {
    let env = Env::start(&[]);
    let mut admin = env.pg.connect();
    // An aggregate whose events retention has removed: only its counter is left.
    admin.batch_execute("INSERT INTO outbox.aggregates VALUES ('old', 'Z', 5), ('old', 'idle', 3)").unwrap();
    let mut bulk = Session::open(&env.pg, "postgres", "bulk");
    bulk.run("BEGIN");
    bulk.run("SELECT outbox_enqueue('bulk', i::text, 'e', '{}') FROM generate_series(1, 256) i");
    let event = bulk.value("SELECT outbox_enqueue('old', 'Z', 'e', '{}')::text").unwrap();
    let forgotten: i64 = admin.query_one("SELECT outbox.forget_aggregates()", &[]).unwrap().get(0);
    assert_eq!(forgotten, 0);
    let counters: i64 =
        admin.query_one("SELECT count(*) FROM outbox.aggregates WHERE aggregate_type = 'old'", &[]).unwrap().get(0);
    assert_eq!(counters, 2, "nothing forgotten while the bulk transaction runs");
    bulk.run("COMMIT");
    let entries = env.redis.wait_for_entries("outbox:old", 1);
    assert_eq!((entries[0]["event_id"].as_str(), entries[0]["aggregate_seq"].as_str()), (event.as_str(), "6"));
    // Once it has ended, the idle aggregate's counter is forgotten (Z has an event in the log).
    let forgotten: i64 = admin.query_one("SELECT outbox.forget_aggregates()", &[]).unwrap().get(0);
    assert_eq!(forgotten, 1);
}

/// Item 9. A prepared transaction commits in whichever session runs COMMIT PREPARED, which had
/// enqueued nothing: its events waited for the poll interval. Here that is ten minutes, so only the
/// wake-up of COMMIT PREPARED's own commit delivers them within the deadline.
#[test]
fn commit_prepared_wakes_the_relay() {
    let env = Env::start(&["outbox.poll_interval = '10min'", "max_prepared_transactions = 2"]);
    let mut writer = Session::open(&env.pg, "postgres", "writer");
    let mut committer = Session::open(&env.pg, "postgres", "committer");
    writer.run("BEGIN");
    let event = writer.value("SELECT outbox_enqueue('prepared', '1', 'e', '{}')::text").unwrap();
    writer.run("PREPARE TRANSACTION 'outbox-test'");
    committer.run("COMMIT PREPARED 'outbox-test'");
    let entries = env.redis.wait_for_entries("outbox:prepared", 1);
    assert_eq!(entries[0]["event_id"], event);
}

/// Item 9. A writer that commits with `synchronous_commit = off` is answered before its commit is
/// on disk. Published at once, its event could reach Redis and the transaction then be lost in an
/// OS crash. The relay flushes the WAL up to such commits before it publishes them. Here nothing
/// else flushes (the WAL writer is stopped, autovacuum and the background writer are off), so the
/// WAL being flushed past the commit when the entry is in Redis is the relay's doing.
#[test]
fn an_asynchronous_commit_is_on_disk_before_its_event_is_published() {
    let env = Env::start(&["autovacuum = off", "bgwriter_lru_maxpages = 0", "wal_writer_delay = '10s'"]);
    let mut admin = env.pg.connect();
    env.pg.relay_pid(&mut admin);
    let walwriter = env.pg.backend_pids(&mut admin, "walwriter")[0];
    // SAFETY: kill(2) on the cluster's WAL writer, resumed below (and by the guard on a panic).
    assert_eq!(unsafe { libc::kill(walwriter, libc::SIGSTOP) }, 0);
    struct Resume(i32);
    impl Drop for Resume {
        fn drop(&mut self) {
            // SAFETY: as above.
            unsafe { libc::kill(self.0, libc::SIGCONT) };
        }
    }
    let _resume = Resume(walwriter);
    // pg_walinspect finds the writer's commit record; created now, since its own (synchronous)
    // commit flushes the WAL, and nothing may flush it once the writer has committed.
    admin.batch_execute("CREATE EXTENSION pg_walinspect").unwrap();
    let mut writer = env.pg.connect();
    writer.batch_execute("SET synchronous_commit = off").unwrap();
    let mut transaction = writer.transaction().unwrap();
    let row = transaction
        .query_one(
            "SELECT outbox_enqueue('async', '1', 'e', '{}')::text, (pg_current_xact_id()::text::bigint % 4294967296)::text,
                    pg_current_wal_insert_lsn()::text",
            &[],
        )
        .unwrap();
    let (event, xid, before_commit): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    transaction.commit().unwrap();
    let entries = env.redis.wait_for_entries("outbox:async", 1);
    assert_eq!(entries[0]["event_id"], event);
    // Its commit record lies in the WAL flushed so far (the WAL writer is stopped and nothing
    // else flushes: the relay did). Comparing with the insert position read after the commit
    // instead would also count what the relay's own asynchronous commits wrote since.
    let flushed: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn())
              WHERE xid::text = $2 AND resource_manager = 'Transaction' AND record_type LIKE 'COMMIT%'",
            &[&before_commit, &xid],
        )
        .unwrap()
        .get(0);
    assert_eq!(flushed, 1, "the event reached Redis before its commit was on disk");
}

/// Item 8. `outbox_enqueue` runs as the extension's owner (SECURITY DEFINER); a trigger a DBA put
/// on the log ran under the caller's search_path, so a writer who owns a schema shadowed a
/// function the trigger calls and ran code as the owner: here, making itself superuser.
#[test]
fn a_writer_cannot_reach_the_owners_rights_through_a_trigger_on_the_log() {
    let env = Env::start(&[]);
    let mut admin = env.pg.connect();
    admin
        .batch_execute(
            "CREATE ROLE writer LOGIN; GRANT outbox_writer TO writer;
             CREATE SCHEMA evil AUTHORIZATION writer;
             CREATE TABLE public.audit (aggregate_id text);
             CREATE FUNCTION public.audit_outbox() RETURNS trigger LANGUAGE plpgsql AS
                 $$BEGIN INSERT INTO public.audit VALUES (lower(NEW.aggregate_id)); RETURN NEW; END$$;
             CREATE TRIGGER audit AFTER INSERT ON outbox.events_0 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox();
             CREATE TRIGGER audit AFTER INSERT ON outbox.events_1 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox();
             CREATE TRIGGER audit AFTER INSERT ON outbox.events_2 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox();",
        )
        .unwrap();
    let mut writer = Session::open_as(&env.pg, "postgres", "writer", "writer");
    writer.run(
        "CREATE FUNCTION evil.lower(text) RETURNS text LANGUAGE plpgsql AS
             $$BEGIN EXECUTE 'ALTER ROLE writer SUPERUSER'; RETURN $1; END$$",
    );
    writer.run("SET search_path = evil, pg_catalog, public");
    writer.run("SELECT outbox_enqueue('acct', 'ABC', 'e', '{}')");
    let superuser: bool =
        admin.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = 'writer'", &[]).unwrap().get(0);
    assert!(!superuser, "the writer made itself superuser through the trigger");
    let audited: String = admin.query_one("SELECT aggregate_id FROM public.audit", &[]).unwrap().get(0);
    assert_eq!(audited, "abc", "the trigger ran, with pg_catalog's lower()");
    env.redis.wait_for_entries("outbox:acct", 1);
}

/// Item 9. An error PostgreSQL raised while `outbox_enqueue` waited for an order lock (here
/// lock_timeout) reached the client with a Rust backtrace in its DETAIL when the server's
/// environment had RUST_BACKTRACE set. The client gets the message, its SQLSTATE and no internals.
#[test]
fn an_error_while_waiting_for_the_order_lock_shows_no_backtrace() {
    // The cluster inherits this process's environment.
    std::env::set_var("RUST_BACKTRACE", "1");
    let env = Env::start(&[]);
    let mut holder = Session::open(&env.pg, "postgres", "holder");
    let mut waiter = Session::open(&env.pg, "postgres", "waiter");
    holder.run("BEGIN");
    holder.run("SELECT outbox_enqueue('bt', '1', 'e', '{}')");
    waiter.run("SET lock_timeout = '50ms'");
    let error = match waiter.step("SELECT outbox_enqueue('bt', '1', 'e', '{}')") {
        Step::Blocked => waiter.finish().unwrap_err(),
        Step::Done(result) => result.unwrap_err(),
    };
    assert_eq!(error.code, "55P03", "{error:?}");
    assert!(error.message.contains("lock timeout"), "{error:?}");
    let detail = error.detail.unwrap_or_default();
    assert!(
        !detail.contains("backtrace") && !detail.contains("rust_begin_unwind") && !detail.contains(".rs:"),
        "{detail}"
    );
    holder.run("ROLLBACK");
}
