//! `outbox-consume`: consume an outbox_pg stream through a consumer group and print each event
//! as one JSON line, deduplicated, with retries and dead-lettering as in the library.
//!
//! Exit codes: 0 after a clean stop (signal, `--max-events`, `--idle-exit-ms`), 1 when Redis or
//! stdout fails, 2 for bad arguments or unusable files (password, certificates). A summary goes to
//! stderr on every exit but the usage ones.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_consumer::{AggregateSeqs, Consumer, ConsumerConfig, ConsumerError, Event, RedisMode, Stats};

const USAGE: &str = "\
usage: outbox-consume --redis URL --stream STREAM --group GROUP [options]

Reads outbox_pg events from STREAM as a member of consumer group GROUP and prints each new event
as one JSON object per line on stdout. Duplicates (same event_id) are acknowledged and skipped.
A gap, a reordering or a repeat of an aggregate's aggregate_seq among the printed events is
reported on stderr (not for replayed entries). A summary is printed on stderr at exit. Ctrl-C or SIGTERM stops after the current event.

URL: redis://[user:password@]host:port[/db] (rediss:// for TLS). With --redis-mode cluster, seed
nodes: redis://[user:password@]host1:port1,host2:port2,... or comma-separated full URLs.

connection:
  --redis-mode MODE      standalone (default) or cluster
  --password-file PATH   read the password from PATH (owner-only file), overriding the URL's
  --tls-ca-file PATH     CA certificates (PEM) to verify the server with (default: system roots);
                         the server's certificate is always verified; needs a rediss:// URL
  --tls-cert-file PATH   client certificate (PEM) for mutual TLS; needs --tls-key-file
  --tls-key-file PATH    client private key (PEM, owner-only file); needs --tls-cert-file

options:
  --consumer NAME        consumer name in the group (default: <hostname>-<pid>)
  --batch N              entries per read, at least 1 (default 100)
  --block-ms N           how long one read blocks, in ms; 0 = do not block (default 1000)
  --dedup-ttl SECS       how long processed event_ids are remembered (default 86400)
  --dedup-prefix PREFIX  dedup key prefix (default outbox:dedup:<group>); keys are
                         PREFIX:<event_id>, in cluster mode PREFIX:{<stream>}:<event_id>
  --claim-idle-ms N      reclaim entries pending longer than this, in ms (default 30000)
  --max-deliveries N     dead-letter an entry after N failed deliveries (default 5)
  --dead-letter STREAM   dead-letter stream (default <stream>:dead)
  --start-id ID          where a newly created group starts: 0 = whole stream, $ = new only (default 0)
  --max-events N         exit after printing N events
  --idle-exit-ms N       exit once no entry has arrived for N ms
  --delete-acked         acknowledge with XACKDEL ... ACKED where Redis has it (8.2+), deleting
                         entries every group acknowledged (outbox.stream_trim = 'acked')
  -h, --help             show this help
";

/// What the command line asks for.
struct Args {
    config: ConsumerConfig,
    max_events: Option<u64>,
    idle_exit: Option<Duration>,
}

/// Why the command line was not accepted.
enum ArgsError {
    Help,
    Invalid(String),
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(ArgsError::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(ArgsError::Invalid(message)) => {
            eprintln!("outbox-consume: {message}\nTry 'outbox-consume --help' for usage.");
            return ExitCode::from(2);
        }
    };

    let stop = Arc::new(AtomicBool::new(false));
    if let Err(e) = install_signal_handlers(&stop) {
        eprintln!("outbox-consume: cannot install signal handlers: {e}");
        return ExitCode::from(1);
    }

    let mut consumer = match Consumer::connect(args.config) {
        Ok(consumer) => consumer,
        Err(ConsumerError::InvalidConfig(message)) => {
            eprintln!("outbox-consume: {message}\nTry 'outbox-consume --help' for usage.");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("outbox-consume: {e}");
            return ExitCode::from(1);
        }
    };

    let mut printed: u64 = 0;
    // It may join a stream anywhere (a group at `$`, a restart): each aggregate's first event
    // seen is where its check starts.
    let mut seqs = AggregateSeqs::joining();
    let mut order_warnings: u64 = 0;
    let mut output_error: Option<std::io::Error> = None;
    let stdout = std::io::stdout();
    let handler = |event: &Event| -> Result<(), String> {
        let mut out = stdout.lock();
        // Flushed per line so that a pipe reader sees events as they come.
        if let Err(e) = writeln!(out, "{}", event.to_json()).and_then(|()| out.flush()) {
            // Not acknowledged: the event stays pending for another consumer. Stop, since every
            // further event would fail the same way.
            let message = format!("cannot write to stdout: {e}");
            output_error = Some(e);
            stop.store(true, Ordering::SeqCst);
            return Err(message);
        }
        printed += 1;
        let order = seqs.observe(&event.aggregate_type, &event.aggregate_id, event.aggregate_seq);
        // A replay carries its event's original number: out of order by design.
        if order.is_anomaly() && event.replay.is_none() {
            order_warnings += 1;
            eprintln!(
                "outbox-consume: warning: {}/{} #{} (event {}): {order}",
                event.aggregate_type, event.aggregate_id, event.aggregate_seq, event.event_id
            );
        }
        if args.max_events.is_some_and(|max| printed >= max) {
            // The loop finishes (acknowledges) this event, then returns.
            stop.store(true, Ordering::SeqCst);
        }
        Ok(())
    };
    let result = match args.idle_exit {
        Some(idle) => consumer.run_with_idle_exit(handler, &stop, idle),
        None => consumer.run(handler, &stop),
    };

    eprintln!("{}", summary(&consumer.stats(), order_warnings));
    if let Some(e) = output_error {
        eprintln!("outbox-consume: cannot write to stdout: {e}");
        return ExitCode::from(1);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-consume: {e}");
            ExitCode::from(1)
        }
    }
}

fn summary(stats: &Stats, order_warnings: u64) -> String {
    format!(
        "processed {}, duplicates skipped {}, dead-lettered {}, malformed {}, handler errors {}, reclaimed {}, \
         order warnings {order_warnings}",
        stats.processed, stats.duplicates, stats.dead_lettered, stats.malformed, stats.handler_errors, stats.reclaimed
    )
}

/// The first SIGINT/SIGTERM asks for a clean stop; a second one (while still stopping) exits at
/// once, the usual behaviour for an impatient Ctrl-C.
fn install_signal_handlers(stop: &Arc<AtomicBool>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    for (signal, status) in [(SIGINT, 130), (SIGTERM, 143)] {
        // Registered first so that it sees the flag as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(signal, status, Arc::clone(stop))?;
        signal_hook::flag::register(signal, Arc::clone(stop))?;
    }
    Ok(())
}

fn parse_args(mut raw: impl Iterator<Item = String>) -> Result<Args, ArgsError> {
    let mut redis = None;
    let mut redis_mode = None;
    let mut password_file = None;
    let mut tls_ca_file = None;
    let mut tls_cert_file = None;
    let mut tls_key_file = None;
    let mut stream = None;
    let mut group = None;
    let mut consumer = None;
    let mut batch = None;
    let mut block_ms = None;
    let mut dedup_ttl = None;
    let mut dedup_prefix = None;
    let mut claim_idle_ms = None;
    let mut max_deliveries = None;
    let mut dead_letter = None;
    let mut start_id = None;
    let mut max_events = None;
    let mut idle_exit_ms = None;
    let mut delete_acked = false;

    while let Some(arg) = raw.next() {
        if arg == "-h" || arg == "--help" {
            return Err(ArgsError::Help);
        }
        // Both `--flag value` and `--flag=value`.
        if arg == "--delete-acked" {
            delete_acked = true;
            continue;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_string(), Some(value.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || -> Result<String, ArgsError> {
            match inline.clone().or_else(|| raw.next()) {
                Some(v) => Ok(v),
                None => Err(ArgsError::Invalid(format!("{flag} needs a value"))),
            }
        };
        match flag.as_str() {
            "--redis" => redis = Some(value()?),
            "--redis-mode" => {
                let text = value()?;
                redis_mode = Some(text.parse::<RedisMode>().map_err(|_| {
                    ArgsError::Invalid(format!("invalid value {text:?} for {flag}: expected standalone or cluster"))
                })?);
            }
            "--password-file" => password_file = Some(path(&flag, value()?)?),
            "--tls-ca-file" => tls_ca_file = Some(path(&flag, value()?)?),
            "--tls-cert-file" => tls_cert_file = Some(path(&flag, value()?)?),
            "--tls-key-file" => tls_key_file = Some(path(&flag, value()?)?),
            "--stream" => stream = Some(value()?),
            "--group" => group = Some(value()?),
            "--consumer" => consumer = Some(value()?),
            "--batch" => batch = Some(positive(&flag, &value()?)?),
            "--block-ms" => block_ms = Some(number(&flag, &value()?)?),
            "--dedup-ttl" => dedup_ttl = Some(positive(&flag, &value()?)?),
            "--dedup-prefix" => dedup_prefix = Some(value()?),
            "--claim-idle-ms" => claim_idle_ms = Some(positive(&flag, &value()?)?),
            "--max-deliveries" => max_deliveries = Some(positive(&flag, &value()?)?),
            "--dead-letter" => dead_letter = Some(value()?),
            "--start-id" => start_id = Some(value()?),
            "--max-events" => max_events = Some(positive(&flag, &value()?)?),
            "--idle-exit-ms" => idle_exit_ms = Some(number(&flag, &value()?)?),
            _ if flag.starts_with('-') => return Err(ArgsError::Invalid(format!("unknown option {flag:?}"))),
            _ => return Err(ArgsError::Invalid(format!("unexpected argument {arg:?}"))),
        }
    }

    let required = |value: Option<String>, flag: &str| -> Result<String, ArgsError> {
        match value {
            Some(v) if !v.is_empty() => Ok(v),
            Some(_) => Err(ArgsError::Invalid(format!("{flag} must not be empty"))),
            None => Err(ArgsError::Invalid(format!("missing required option {flag}"))),
        }
    };
    let mut config =
        ConsumerConfig::new(required(redis, "--redis")?, required(stream, "--stream")?, required(group, "--group")?);
    if let Some(v) = redis_mode {
        config.redis_mode = v;
    }
    config.password_file = password_file;
    config.tls_ca_file = tls_ca_file;
    config.tls_cert_file = tls_cert_file;
    config.tls_key_file = tls_key_file;
    if config.tls_cert_file.is_some() != config.tls_key_file.is_some() {
        // Named by flag here; the library's message names the config fields.
        return Err(ArgsError::Invalid("--tls-cert-file and --tls-key-file must be given together".to_string()));
    }
    if let Some(v) = consumer {
        config.consumer_name = v;
    }
    if let Some(v) = batch {
        config.batch_size = usize::try_from(v).map_err(|_| ArgsError::Invalid(format!("--batch {v} is too large")))?;
    }
    if let Some(v) = block_ms {
        config.block_timeout = Duration::from_millis(v);
    }
    if let Some(v) = dedup_ttl {
        config.dedup_ttl = Duration::from_secs(v);
    }
    if let Some(v) = dedup_prefix {
        config.dedup_prefix = v;
    }
    if let Some(v) = claim_idle_ms {
        config.claim_idle_timeout = Duration::from_millis(v);
    }
    if let Some(v) = max_deliveries {
        config.max_deliveries = v;
    }
    if let Some(v) = dead_letter {
        config.dead_letter_stream = v;
    }
    if let Some(v) = start_id {
        config.group_start_id = v;
    }
    config.delete_acked = delete_acked;
    // Checked here too (Consumer::connect would) so that a bad value is reported as a usage error
    // before any connection attempt.
    config.validate().map_err(|e| match e {
        ConsumerError::InvalidConfig(message) => ArgsError::Invalid(message),
        other => ArgsError::Invalid(other.to_string()),
    })?;
    Ok(Args { config, max_events, idle_exit: idle_exit_ms.map(Duration::from_millis) })
}

fn path(flag: &str, text: String) -> Result<PathBuf, ArgsError> {
    if text.is_empty() {
        return Err(ArgsError::Invalid(format!("{flag} must not be empty")));
    }
    Ok(PathBuf::from(text))
}

fn number(flag: &str, text: &str) -> Result<u64, ArgsError> {
    text.parse::<u64>()
        .map_err(|_| ArgsError::Invalid(format!("invalid value {text:?} for {flag}: expected a whole number")))
}

fn positive(flag: &str, text: &str) -> Result<u64, ArgsError> {
    match number(flag, text)? {
        0 => Err(ArgsError::Invalid(format!("invalid value \"0\" for {flag}: must be at least 1"))),
        n => Ok(n),
    }
}
