//! The `outbox-consume` binary against a real redis-server, a TLS-only one with client
//! certificates and an ACL user, and a Redis Cluster.

mod common;

use std::process::{Child, Command, Output, Stdio};

use common::{
    event_fields, event_id, least_privileges, output_within, pending_count, set_user_command, wait_until, write_secret,
    xadd, RedisCluster, RedisServer, TempDir, TlsFiles, DEADLINE,
};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-consume");
const STREAM: &str = "outbox:order";
const GROUP: &str = "cli";

fn spawn(args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run outbox-consume")
}

/// Waits for the child to exit (failing the test after the deadline) and collects its output.
fn finish(child: Child) -> Output {
    output_within(child, DEADLINE, "outbox-consume")
}

fn run(args: &[&str]) -> Output {
    finish(spawn(args))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn prints_events_as_json_lines_and_a_summary() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    let first = xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    xadd(&mut conn, STREAM, &event_fields(&event_id(2), 2));
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1)); // redelivered copy
    let mut with_headers = event_fields(&event_id(3), 3);
    with_headers.push(("headers".into(), r#"{"trace":"abc"}"#.into()));
    xadd(&mut conn, STREAM, &with_headers);

    let url = server.url();
    let output = run(&[
        "--redis",
        &url,
        "--stream",
        STREAM,
        "--group",
        GROUP,
        "--consumer",
        "cli-1",
        "--block-ms",
        "100",
        "--max-events",
        "3",
    ]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);

    let lines: Vec<serde_json::Value> = text(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    assert_eq!(lines.len(), 3);
    let ids: Vec<&str> = lines.iter().filter_map(|l| l["event_id"].as_str()).collect();
    assert_eq!(ids, vec![event_id(1), event_id(2), event_id(3)]);
    let e = &lines[0];
    assert_eq!(e["outbox_id"], 1001);
    assert_eq!(e["aggregate_type"], "order");
    assert_eq!(e["aggregate_id"], "o-1");
    assert_eq!(e["aggregate_seq"], 1);
    assert_eq!(e["event_type"], "order.updated");
    assert_eq!(e["payload"], serde_json::json!({"seq": 1}));
    assert_eq!(e["headers"], serde_json::Value::Null);
    assert_eq!(e["created_at"], "2026-11-29T20:00:00.123456Z");
    assert_eq!(e["stream"], STREAM);
    assert_eq!(e["entry_id"], first.as_str());
    assert_eq!(lines[2]["headers"], serde_json::json!({"trace": "abc"}));

    assert!(stderr.contains("processed 3, duplicates skipped 1, dead-lettered 0"), "stderr: {stderr}");
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);
}

#[test]
fn idle_exit_reports_dead_letters_in_the_summary() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    xadd(&mut conn, STREAM, &[("event_id".to_string(), "nope".to_string())]);
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));

    let url = server.url();
    let output =
        run(&["--redis", &url, "--stream", STREAM, "--group", GROUP, "--block-ms", "50", "--idle-exit-ms", "200"]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);
    assert_eq!(text(&output.stdout).lines().count(), 1);
    assert!(stderr.contains("processed 1, duplicates skipped 0, dead-lettered 1, malformed 1"), "stderr: {stderr}");
}

#[test]
fn gaps_and_reorderings_of_an_aggregate_are_warned_of() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for seq in [1, 3, 2] {
        xadd(&mut conn, STREAM, &event_fields(&event_id(seq as u64), seq));
    }
    // A replay of event 1 under another event id (past the dedup): its number repeats, no warning.
    let mut replayed = event_fields(&event_id(9), 1);
    replayed.push(("replay".into(), "7".into()));
    xadd(&mut conn, STREAM, &replayed);

    let url = server.url();
    let output = run(&["--redis", &url, "--stream", STREAM, "--group", GROUP, "--block-ms", "50", "--max-events", "4"]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);
    assert_eq!(text(&output.stdout).lines().count(), 4);
    let warnings: Vec<&str> = stderr.lines().filter(|line| line.contains("warning:")).collect();
    assert_eq!(
        warnings,
        [
            format!("outbox-consume: warning: order/o-1 #3 (event {}): gap: aggregate_seq 2 not seen", event_id(3)),
            format!("outbox-consume: warning: order/o-1 #2 (event {}): reordered: after aggregate_seq 3", event_id(2)),
        ],
        "stderr: {stderr}"
    );
    assert!(stderr.contains("processed 4, duplicates skipped 0") && stderr.contains("order warnings 2"), "{stderr}");
}

#[test]
fn sigterm_stops_cleanly_with_a_summary() {
    let server = RedisServer::start();
    let mut conn = server.conn();
    for n in 1..=2 {
        xadd(&mut conn, STREAM, &event_fields(&event_id(n), n as i64));
    }
    let url = server.url();
    let child = spawn(&["--redis", &url, "--stream", STREAM, "--group", GROUP, "--block-ms", "100"]);
    wait_until("both events marked done", || {
        (1..=2).all(|n| {
            let state: Option<String> =
                redis::cmd("GET").arg(format!("outbox:dedup:{GROUP}:{}", event_id(n))).query(&mut conn).expect("GET");
            state.as_deref() == Some("done")
        })
    });
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("run kill");
    assert!(status.success());
    let output = finish(child);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);
    assert_eq!(text(&output.stdout).lines().count(), 2);
    assert!(stderr.contains("processed 2, duplicates skipped 0, dead-lettered 0"), "stderr: {stderr}");
}

#[test]
fn bad_arguments_exit_with_code_2_and_name_the_value() {
    let base = ["--redis", "redis://127.0.0.1:1/", "--stream", STREAM, "--group", GROUP];
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (vec!["--batch", "abc"], &["--batch", "\"abc\""]),
        (vec!["--batch=-3"], &["--batch", "\"-3\""]),
        (vec!["--max-deliveries", "0"], &["--max-deliveries", "\"0\""]),
        (vec!["--block-ms", "1.5"], &["--block-ms", "\"1.5\""]),
        (vec!["--bogus"], &["\"--bogus\""]),
        (vec!["--max-events"], &["--max-events needs a value"]),
        (vec!["--dead-letter", STREAM], &["dead_letter_stream"]),
        (vec!["--redis-mode", "sentinel"], &["--redis-mode", "\"sentinel\""]),
        (vec!["--tls-cert-file", "/tmp/c.crt"], &["--tls-cert-file and --tls-key-file"]),
        (vec!["--tls-ca-file", "/tmp/ca.crt"], &["not a rediss:// URL"]),
        (vec!["--password-file="], &["--password-file must not be empty"]),
        (vec!["--redis", "redis://127.0.0.1:1,127.0.0.1:2"], &["--redis-mode cluster"]),
    ];
    for (extra, expected) in cases {
        let mut args = base.to_vec();
        args.extend(&extra);
        let output = run(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: stderr {stderr}");
        for needle in expected {
            assert!(stderr.contains(needle), "{extra:?}: expected {needle:?} in stderr: {stderr}");
        }
    }
    let output = run(&["--stream", STREAM, "--group", GROUP]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("--redis"));

    let output = run(&["--help"]);
    assert!(output.status.success());
    assert!(text(&output.stdout).contains("usage: outbox-consume"));
}

/// Stdout lines parsed as JSON events' `event_id`s.
fn printed_ids(output: &Output) -> Vec<String> {
    text(&output.stdout)
        .lines()
        .map(|line| {
            let event: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            event["event_id"].as_str().expect("event_id").to_string()
        })
        .collect()
}

#[test]
fn consumes_over_mutual_tls_as_an_acl_user_with_a_password_file() {
    let files = TlsFiles::generate();
    let server = RedisServer::start_tls(&files, &files.server_cert, &files.server_key, files.client());
    let mut conn = server.conn();
    set_user_command("cli-user", "cli-pw", &least_privileges(STREAM, GROUP, false)).exec(&mut conn).expect("ACL");
    let secrets = TempDir::new("secrets");
    let password_file = secrets.path().join("password");
    write_secret(&password_file, "cli-pw\n");
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    xadd(&mut conn, STREAM, &event_fields(&event_id(1), 1));
    xadd(&mut conn, STREAM, &event_fields(&event_id(2), 2));

    // The password is in neither the URL nor argv.
    let url = format!("rediss://cli-user@127.0.0.1:{}/", server.port);
    let (ca, cert, key, pw) = (
        files.ca.display().to_string(),
        files.client_cert.display().to_string(),
        files.client_key.display().to_string(),
        password_file.display().to_string(),
    );
    let tls_args = ["--tls-ca-file", &ca, "--tls-cert-file", &cert, "--tls-key-file", &key];
    let mut args = vec!["--redis", &url, "--password-file", &pw, "--stream", STREAM, "--group", GROUP];
    args.extend(tls_args);
    args.extend(["--block-ms", "50", "--idle-exit-ms", "300"]);
    let output = run(&args);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);
    assert_eq!(printed_ids(&output), vec![event_id(1), event_id(2)]);
    assert!(stderr.contains("processed 2, duplicates skipped 1"), "stderr: {stderr}");
    assert_eq!(pending_count(&mut conn, STREAM, GROUP), 0);

    // A server certificate the CA does not vouch for: exit 1 with a TLS error naming the cause.
    let other_ca = files.other_ca.display().to_string();
    let mut args = vec!["--redis", &url, "--password-file", &pw, "--stream", STREAM, "--group", GROUP];
    args.extend(["--tls-ca-file", &other_ca, "--tls-cert-file", &cert, "--tls-key-file", &key]);
    let output = run(&args);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("TLS error") && stderr.contains("UnknownIssuer"), "stderr: {stderr}");
}

#[test]
fn consumes_from_a_cluster() {
    let cluster = RedisCluster::start();
    let mut conn = cluster.conn();
    let stream = "outbox:order";
    xadd(&mut conn, stream, &event_fields(&event_id(1), 1));
    xadd(&mut conn, stream, &event_fields(&event_id(2), 2));
    xadd(&mut conn, stream, &event_fields(&event_id(1), 1));
    xadd(&mut conn, stream, &[("event_id".to_string(), "nope".to_string())]);

    // The seed list as comma-separated full URLs.
    let url = cluster.full_urls("");
    let output = run(&[
        "--redis-mode",
        "cluster",
        "--redis",
        &url,
        "--stream",
        stream,
        "--group",
        GROUP,
        "--block-ms",
        "50",
        "--idle-exit-ms",
        "300",
    ]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "status {:?}, stderr: {stderr}", output.status);
    assert_eq!(printed_ids(&output), vec![event_id(1), event_id(2)]);
    assert!(stderr.contains("processed 2, duplicates skipped 1, dead-lettered 1, malformed 1"), "stderr: {stderr}");
    assert_eq!(pending_count(&mut conn, stream, GROUP), 0);
    // Cluster mode's dedup key: hash-tagged with the stream.
    let state: String = redis::cmd("GET")
        .arg(format!("outbox:dedup:{GROUP}:{{{stream}}}:{}", event_id(2)))
        .query(&mut conn)
        .expect("GET");
    assert_eq!(state, "done");
}
