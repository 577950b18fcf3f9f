//! `outbox-servers`: the demo's and the bench's private servers, started by the same code as the
//! tests' and left running for a shell script.
//!
//! ```text
//! outbox-servers up --dir D [--pg-config PATH] [--setting LINE]... [--redis-cluster MASTERS] [--sql-only]
//! outbox-servers down --dir D
//! ```
//!
//! `up` stops what an earlier `up` left in D, starts a redis-server and a PostgreSQL cluster that
//! preloads outbox_pg and relays to it (as the `postgres` OS user when root; `--setting` lines
//! appended to postgresql.conf), creates the extension in database `postgres`, optionally starts a
//! Redis Cluster of MASTERS masters without replicas, and prints shell assignments for `eval`:
//! `PG_PORT`, `PG_BIN`, `PG_LOG`, `REDIS_PORT`, `REDIS_LOG` and `CLUSTER_URL`. The same lines
//! are kept in D/servers.env, which `down` reads to stop every server; the logs stay in D.
//! `--sql-only`: a server that does not preload the library and has no extension, for the SQL-only
//! install (docs/sql-only.md).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use outbox_testkit::{as_server_user, Cluster, ClusterOptions, PgInstall, Redis, RedisCluster, RedisOptions};

const USAGE: &str =
    "usage: outbox-servers up --dir D [--pg-config PATH] [--setting LINE]... [--redis-cluster MASTERS] [--sql-only]
       outbox-servers down --dir D";

/// What `up` was asked for.
struct Up {
    dir: PathBuf,
    pg_config: PathBuf,
    settings: Vec<String>,
    cluster_masters: Option<usize>,
    sql_only: bool,
}

fn parse(args: &[String]) -> Result<(String, Up), String> {
    let (command, rest) = args.split_first().ok_or("no command")?;
    let mut up = Up {
        dir: PathBuf::new(),
        pg_config: std::env::var_os("PG_CONFIG").map_or_else(outbox_testkit::default_pg_config, PathBuf::from),
        settings: Vec::new(),
        cluster_masters: None,
        sql_only: false,
    };
    let mut rest = rest.iter();
    while let Some(flag) = rest.next() {
        let mut value = || rest.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => up.dir = PathBuf::from(value()?),
            "--pg-config" => up.pg_config = PathBuf::from(value()?),
            "--setting" => up.settings.push(value()?.clone()),
            "--redis-cluster" => {
                let masters = value()?;
                up.cluster_masters =
                    Some(masters.parse().map_err(|_| format!("--redis-cluster: {masters:?} is not a number"))?);
            }
            "--sql-only" => up.sql_only = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if up.dir.as_os_str().is_empty() {
        return Err("--dir is required".into());
    }
    Ok((command.clone(), up))
}

/// A value quoted for the shell, so that `eval` takes it as one word whatever it holds.
fn quoted(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

fn up(up: &Up) -> String {
    down(&up.dir);
    // Nothing of an earlier run may stay: a cluster node would rejoin the cluster its old
    // nodes.conf names.
    let _ = fs::remove_dir_all(&up.dir);
    fs::create_dir_all(&up.dir).unwrap_or_else(|e| panic!("create {}: {e}", up.dir.display()));
    let keep =
        |name: &str| RedisOptions { dir: Some(up.dir.join(name)), own_process_group: true, ..Default::default() };
    let redis = Redis::start_options(keep("redis"));
    let install = PgInstall::at(&up.pg_config);
    let builder = Cluster::builder(&install).dir(up.dir.join("pg"));
    let builder = if up.sql_only { builder } else { builder.outbox_relaying_to(&redis.url()) };
    let pg = builder.settings(&up.settings).start();
    if !up.sql_only {
        pg.connect()
            .batch_execute("CREATE EXTENSION outbox_pg")
            .unwrap_or_else(|e| panic!("CREATE EXTENSION outbox_pg: {e}"));
    }
    let cluster = up.cluster_masters.map(|masters| {
        RedisCluster::start_with(ClusterOptions {
            masters,
            replicas_per_master: 0,
            // Under the bench's load a node may be slow to answer the bus; the tests' 1 s would
            // mark it failing.
            node_timeout: Duration::from_secs(5),
            dir: Some(up.dir.join("cluster")),
            own_process_group: true,
            ..Default::default()
        })
    });
    let mut env = vec![
        ("PG_PORT", pg.port.to_string()),
        ("PG_BIN", install.bindir().display().to_string()),
        ("PG_LOG", pg.log_path().display().to_string()),
        ("PG_DATA", pg.data.display().to_string()),
        ("REDIS_PORT", redis.port.to_string()),
        ("REDIS_LOG", redis.log_path().display().to_string()),
    ];
    if let Some(cluster) = &cluster {
        env.push(("CLUSTER_URL", cluster.url()));
        let ports: Vec<String> = cluster.nodes.iter().map(|node| node.port.to_string()).collect();
        env.push(("CLUSTER_PORTS", ports.join(" ")));
    }
    let text: String = env.iter().map(|(name, value)| format!("{name}={}\n", quoted(value))).collect();
    let state = state_file(&up.dir);
    fs::write(&state, &text).unwrap_or_else(|e| panic!("write {}: {e}", state.display()));
    // Only now that everything runs: a failure above stops what had started.
    pg.detach();
    redis.detach();
    if let Some(cluster) = cluster {
        cluster.detach();
    }
    text
}

fn state_file(dir: &Path) -> PathBuf {
    dir.join("servers.env")
}

/// Stops what `up` started in `dir`, if anything; what is already gone is no error.
fn down(dir: &Path) {
    let Ok(text) = fs::read_to_string(state_file(dir)) else { return };
    let value = |name: &str| -> Option<String> {
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}=")))
            .map(|v| v.trim_matches('\'').replace(r"'\''", "'"))
    };
    if let (Some(bin), Some(data)) = (value("PG_BIN"), value("PG_DATA")) {
        let mut stop = as_server_user(&Path::new(&bin).join("pg_ctl"));
        stop.arg("-D").arg(data).args(["-w", "-t", "60", "-m", "fast", "stop"]);
        let _ = stop.output();
    }
    let ports = [value("REDIS_PORT"), value("CLUSTER_PORTS")].into_iter().flatten().collect::<Vec<_>>().join(" ");
    for port in ports.split_whitespace() {
        if let Ok(mut connection) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(2)))
        {
            // The server closes the connection instead of answering.
            let _ = redis::cmd("SHUTDOWN").arg("NOSAVE").exec(&mut connection);
        }
    }
    let _ = fs::remove_file(state_file(dir));
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, request) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("outbox-servers: {error}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match command.as_str() {
        "up" => print!("{}", up(&request)),
        "down" => down(&request.dir),
        other => {
            eprintln!("outbox-servers: unknown command {other:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
