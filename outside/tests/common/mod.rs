//! What outbox-relay's integration tests share: a private PostgreSQL without the library (the
//! testkit's), a database with the SQL-only install made by its owner, a role with CREATEROLE and
//! no superuser (docs/sql-only.md, "No superuser needed"), and connections as any role; the relay
//! as a process; the workload, and the check every relay test ends with (every committed event in
//! Redis, each aggregate's in order).
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

// Each test binary names a few of them.
#[allow(unused_imports)]
pub use outbox_testkit::{run, wait_for, Cluster, PgInstall, Redis, TempDir, DEADLINE};

use outbox_protocol::entry as fields;

pub const OWNER: &str = "app_owner";
pub const DATABASE: &str = "app";

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("outside/ is in the repository").to_path_buf()
}

/// The installation under test: `$PG_CONFIG`, else testkit's default, else Debian's PostgreSQL 15.
pub fn install() -> &'static PgInstall {
    static INSTALL: OnceLock<PgInstall> = OnceLock::new();
    INSTALL.get_or_init(|| {
        let pg_config = std::env::var_os("PG_CONFIG").map(PathBuf::from).unwrap_or_else(|| {
            let default = outbox_testkit::default_pg_config();
            if default.exists() {
                default
            } else {
                PathBuf::from("/usr/lib/postgresql/15/bin/pg_config")
            }
        });
        PgInstall::at(pg_config)
    })
}

/// A started server that preloads nothing.
pub fn server() -> Cluster {
    let pg = Cluster::builder(install()).for_tests().start();
    let preloaded: String = pg.connect().query_one("SHOW shared_preload_libraries", &[]).unwrap().get(0);
    assert!(!preloaded.contains("outbox_pg"), "{preloaded}");
    pg
}

/// A URL for `user` to `database` on `pg`.
pub fn url(pg: &Cluster, user: &str, database: &str) -> String {
    format!("postgresql://{user}@127.0.0.1:{}/{database}", pg.port)
}

pub fn connect_as(pg: &Cluster, database: &str, user: &str) -> postgres::Client {
    postgres::Client::connect(&format!("{}?connect_timeout=10", url(pg, user, database)), postgres::NoTls)
        .unwrap_or_else(|e| panic!("connect as {user} to {database}: {e}"))
}

/// Database `DATABASE` owned by `OWNER`, a role with CREATEROLE only; no schema yet.
pub fn owned_database(pg: &Cluster) {
    let mut admin = pg.connect();
    admin.batch_execute(&format!("CREATE ROLE {OWNER} LOGIN CREATEROLE")).unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {DATABASE} OWNER {OWNER}")).unwrap();
}

/// Runs `bash scripts/sql-only.sh`'s output in `DATABASE` as `OWNER` with psql, as the docs say.
pub fn install_sql_only(pg: &Cluster) {
    let files = TempDir::new("relay-sqlonly");
    let script = files.path().join("outbox_pg.sql");
    let out = Command::new("bash").arg(root().join("scripts/sql-only.sh")).output().expect("bash runs sql-only.sh");
    assert!(out.status.success(), "scripts/sql-only.sh: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(&script, out.stdout).unwrap();
    let mut psql = install().command("psql");
    psql.args(["-X", "-q", "-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", OWNER, "-d", DATABASE, "-f"])
        .arg(&script);
    let output = run(psql, "psql -f outbox_pg.sql");
    assert!(!output.contains("ERROR"), "{output}");
}

/// A server with `DATABASE` and the SQL-only install made there by `OWNER`.
pub fn sql_only_server() -> Cluster {
    let pg = server();
    owned_database(&pg);
    install_sql_only(&pg);
    pg
}

/// The relay, its standard error collected line by line.
pub struct RelayProcess {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The thread reading standard error; joined once the process exited, so that its last lines
    /// are in `lines`.
    reader: Option<std::thread::JoinHandle<()>>,
}

impl RelayProcess {
    pub fn start(args: &[&str]) -> RelayProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OUTBOX_") {
                command.env_remove(name);
            }
        }
        let mut child =
            command.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("outbox-relay starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        RelayProcess { child, lines, reader: Some(reader) }
    }

    /// The process's id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, ...).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the child this test started, which has not been waited for.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill -{signal}: {}", std::io::Error::last_os_error());
    }

    /// How many lines contain `text`.
    pub fn count_lines(&self, text: &str) -> usize {
        self.lines().iter().filter(|line| line.contains(text)).count()
    }

    /// Waits until `count` lines contain `text`.
    pub fn wait_for_lines(&self, text: &str, count: usize) {
        wait_for(DEADLINE, &format!("{count} lines with {text:?}"), || (self.count_lines(text) >= count).then_some(()));
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits for a line containing `text`.
    pub fn wait_for_line(&self, text: &str) -> String {
        wait_for(DEADLINE, &format!("a line with {text:?}"), || {
            self.lines().into_iter().find(|line| line.contains(text))
        })
    }

    /// Kills it with SIGKILL (a crash: nothing of the round in flight is finished).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let status = wait_for(DEADLINE, "outbox-relay to exit after SIGTERM", || self.child.try_wait().unwrap());
        // Its standard error is closed: the reader ends once it has read the last line.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        status
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- outbox-relay's stderr ---\n{}", self.lines().join("\n"));
        }
    }
}

/// The relay on `DATABASE` as its owner, publishing to `redis`, with more `args`; started and
/// ready.
pub fn start_relay(pg: &Cluster, redis: &Redis, args: &[&str]) -> RelayProcess {
    start_relay_at(&url(pg, OWNER, DATABASE), redis, args)
}

/// The relay on database URL `database_url`, publishing to `redis`; started and ready.
pub fn start_relay_at(database_url: &str, redis: &Redis, args: &[&str]) -> RelayProcess {
    let redis_url = redis.url();
    let mut all = vec!["--database-url", database_url, "--redis-url", &redis_url];
    all.extend_from_slice(args);
    let relay = RelayProcess::start(&all);
    relay.wait_for_line("ready: relaying database");
    relay
}

/// Enqueues `transactions` transactions of `per_transaction` events each, spread over
/// `aggregates` orders, as the database's owner.
pub fn enqueue(pg: &Cluster, transactions: usize, per_transaction: usize, aggregates: usize) -> usize {
    let mut app = connect_as(pg, DATABASE, OWNER);
    for t in 0..transactions {
        enqueue_one(&mut app, t as i64, per_transaction, aggregates);
    }
    transactions * per_transaction
}

/// One transaction of `count` events over `aggregates` orders; `t` tells transactions apart in the
/// payload.
pub fn enqueue_one(app: &mut postgres::Client, t: i64, count: usize, aggregates: usize) {
    let mut tx = app.transaction().unwrap();
    tx.execute(
        "SELECT outbox_enqueue('order', (($1::int8 + n) % $2::int8)::text, 'order.created', \
                jsonb_build_object('t', $1::int8, 'n', n)) FROM generate_series(1, $3::int8) AS n",
        &[&t, &(aggregates as i64), &(count as i64)],
    )
    .unwrap();
    tx.commit().unwrap();
}

/// The entries of stream `outbox:order`, grouped by aggregate, in stream order: (seq, event_id).
pub fn by_aggregate(redis: &Redis) -> HashMap<String, Vec<(i64, String)>> {
    let mut grouped: HashMap<String, Vec<(i64, String)>> = HashMap::new();
    for entry in redis.entries("outbox:order") {
        grouped
            .entry(entry[fields::AGGREGATE_ID].clone())
            .or_default()
            .push((entry[fields::AGGREGATE_SEQ].parse().unwrap(), entry[fields::EVENT_ID].clone()));
    }
    grouped
}

/// Waits until Redis holds `count` distinct events.
pub fn wait_for_distinct(redis: &Redis, count: usize) {
    wait_for(DEADLINE, &format!("{count} distinct events in Redis"), || {
        if redis.xlen("outbox:order") < count {
            return None;
        }
        let distinct: HashSet<String> =
            redis.entries("outbox:order").into_iter().map(|entry| entry[fields::EVENT_ID].clone()).collect();
        (distinct.len() >= count).then_some(())
    });
}

/// Each aggregate's entries, duplicates aside, are numbered 1, 2, 3, ... in stream order; a
/// duplicate (at least once) only repeats an event already there.
pub fn assert_in_order(redis: &Redis, total: usize) {
    let mut events = 0;
    for (aggregate, entries) in by_aggregate(redis) {
        let mut next = 1;
        let mut seen = HashMap::new();
        for (seq, event_id) in entries {
            match seen.get(&seq) {
                Some(first) => assert_eq!(first, &event_id, "aggregate {aggregate}: seq {seq} names two events"),
                None => {
                    assert_eq!(seq, next, "aggregate {aggregate}: seq {seq} where {next} was due");
                    seen.insert(seq, event_id);
                    next += 1;
                }
            }
        }
        events += seen.len();
    }
    assert_eq!(events, total, "every event once, duplicates aside");
}

/// Waits until `outbox.stats` shows nothing pending in `DATABASE`.
pub fn wait_for_nothing_pending(pg: &Cluster) {
    let mut app = connect_as(pg, DATABASE, OWNER);
    wait_for(DEADLINE, "nothing pending", || {
        let pending: i64 = app.query_one("SELECT pending FROM outbox.stats", &[]).unwrap().get(0);
        (pending == 0).then_some(())
    });
}

/// Which backends hold shards in `outbox.shards`, each with how many, by pid.
pub fn shard_holders(app: &mut postgres::Client) -> Vec<(i32, i64)> {
    app.query("SELECT claimed_by, count(*) FROM outbox.shards WHERE claimed_by IS NOT NULL GROUP BY 1 ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// The pids of the relays' backends in `DATABASE`.
pub fn relay_backends(pg: &Cluster) -> Vec<i32> {
    pg.connect()
        .query(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = 'outbox-relay' ORDER BY pid",
            &[&DATABASE],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}
