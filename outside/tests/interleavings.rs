//! Races between relays outside the server, stepped in a fixed order as PostgreSQL's isolation
//! tester steps sessions: two relays joining together with different stream templates
//! (`outbox._join_relays`). Joins take turns: the second waits for the first's commit, then finds
//! it and refuses; without the turn both would find the other absent and both would publish.

mod common;

use common::*;

/// The backend pids `pid` waits for.
fn blocked_by(admin: &mut postgres::Client, pid: i32) -> Vec<i32> {
    admin.query_one("SELECT pg_blocking_pids($1)", &[&pid]).unwrap().get(0)
}

#[test]
fn two_relays_joining_together_with_different_templates_cannot_both_join() {
    let pg = sql_only_server();
    let mut first = connect_as(&pg, DATABASE, OWNER);
    let second_url = url(&pg, OWNER, DATABASE);
    let mut admin = pg.connect();
    let first_pid: i32 = first.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);

    // Step 1: the first relay joins, not yet committed.
    let mut tx = first.transaction().unwrap();
    tx.execute("SELECT outbox._join_relays($1, 'a', '0.4.0', 'outbox:{aggregate_type}', 'native')", &[&first_pid])
        .unwrap();

    // Step 2: the second relay joins with another template: it waits for the first.
    let second = std::thread::spawn(move || {
        let mut second = postgres::Client::connect(&second_url, postgres::NoTls).unwrap();
        let pid: i32 = second.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
        let joined =
            second.execute("SELECT outbox._join_relays($1, 'b', '0.4.0', 'other:{aggregate_type}', 'native')", &[&pid]);
        let refused = |error: postgres::Error| {
            let message = error.as_db_error().map_or_else(|| error.to_string(), |db| db.message().to_string());
            (error.code().map(|c| c.code().to_string()), message)
        };
        (pid, joined.map_err(refused))
    });
    wait_for(DEADLINE, "the second join to wait for the first", || {
        let waiting: Vec<i32> = admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> $2 AND wait_event_type = 'Lock'",
                &[&DATABASE, &first_pid],
            )
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        waiting.into_iter().find(|pid| blocked_by(&mut admin, *pid).contains(&first_pid))
    });

    // Step 3: the first commits; the second then finds it and refuses, naming both templates.
    tx.commit().unwrap();
    let (_, joined) = second.join().unwrap();
    let (code, message) = joined.expect_err("the second relay must refuse");
    assert_eq!(code.as_deref(), Some("55000"), "{message}");
    assert!(
        message.contains("\"other:{aggregate_type}\"") && message.contains("\"outbox:{aggregate_type}\""),
        "{message}"
    );
    let mut owner = connect_as(&pg, DATABASE, OWNER);
    let joined: Vec<String> = owner
        .query("SELECT stream_template FROM outbox.outside_relays", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(joined, vec!["outbox:{aggregate_type}".to_string()]);
}
