//! The change-data-capture peer (issue 39): a relay built the way Debezium's and Sequin's are. The
//! application inserts into the seeds' outbox table (`bench_seed_outbox`, as for the polling peer);
//! the relay reads those inserts from the WAL through a logical replication slot (`pgoutput`, over
//! a replication connection speaking the streaming replication protocol), XADDs each one with the
//! same fields as the other peers in pipelined MULTI/EXEC batches, confirms the slot's position
//! (the flush LSN of a standby status update) only after Redis acknowledged the batch, and trims
//! the table by deleting the rows it published.
//!
//! `outbox-bench cdc-relay --pg CONNINFO --redis URL --batch N [--events N] [--no-trim]` runs it
//! as a process of its own: with `--events`, until it has published that many events (a drain);
//! without, until its standard input closes. It prints what it published and the CPU ticks of the
//! walsender decoding for it, of the backend that trims, and of itself.
//!
//! Three threads, so that decoding, publishing and trimming overlap: the reader parses the
//! walsender's stream into chunks (one per transaction, or per `--batch` events of a large one);
//! the publisher gathers what has arrived, up to `--batch` events, into one MULTI/EXEC, and after
//! Redis's reply confirms the end LSN of the last whole transaction in it; the trimmer deletes the
//! published rows, several batches in one statement when it falls behind.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{cpu_ticks, pg, Args, Result};

/// The slot and the publication (`FOR TABLE bench_seed_outbox WITH (publish = 'insert')`: the
/// relay needs the inserts only, and the trimming DELETEs are then filtered out in the walsender).
pub const SLOT: &str = "bench_cdc";
pub const PUBLICATION: &str = "bench_cdc";

/// The fields of an entry, in the order the reader stores them.
const ID: usize = 0;
const EVENT_ID: usize = 1;
const AGGREGATE_TYPE: usize = 2;
const AGGREGATE_ID: usize = 3;
const EVENT_TYPE: usize = 4;
const PAYLOAD: usize = 5;
const HEADERS: usize = 6;
const CREATED_AT: usize = 7;
const FIELDS: usize = 8;
const COLUMN_NAMES: [&str; FIELDS] =
    ["id", "event_id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "created_at"];

/// A NULL column.
const NULL: (u32, u32) = (0, u32::MAX);

/// One inserted row: its id, and where each field's text lies in its chunk's `data`.
struct Event {
    id: i64,
    fields: [(u32, u32); FIELDS],
}

/// What the reader hands the publisher: a transaction's events (or part of a large one's), their
/// texts in one buffer, and the end LSN of the transaction when the chunk completes it.
#[derive(Default)]
struct Chunk {
    data: Vec<u8>,
    events: Vec<Event>,
    commit_end: Option<u64>,
}

impl Chunk {
    fn field(&self, event: &Event, field: usize) -> Option<&[u8]> {
        let (start, len) = event.fields[field];
        (len != u32::MAX).then(|| &self.data[start as usize..start as usize + len as usize])
    }
}

/// State the three threads share.
struct Shared {
    /// The socket's write half (status updates from the publisher, replies to keepalives from the
    /// reader), and whether our CopyDone has gone: after it the server takes no more CopyData.
    writer: Mutex<(TcpStream, bool)>,
    /// The LSN confirmed to the server (every transaction ending at or before it is in Redis).
    flushed: AtomicU64,
    /// Events the reader has handed over, and events Redis has acknowledged: when equal (and the
    /// reader is between transactions), a keepalive's WAL end may be confirmed too, as PostgreSQL's
    /// own subscriber does, so that WAL of other tables does not stay retained.
    forwarded: AtomicU64,
    acknowledged: AtomicU64,
    /// Set when the relay should finish: its input closed, or `--events` were published.
    stop: AtomicBool,
}

impl Shared {
    /// Sends a standby status update: written, flushed and applied up to `lsn`.
    fn confirm(&self, lsn: u64) -> std::io::Result<()> {
        let micros = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0);
        // The protocol's clock counts from 2000-01-01.
        let clock = micros - 946_684_800_000_000;
        let mut message = Vec::with_capacity(39);
        message.push(b'd');
        message.extend_from_slice(&38u32.to_be_bytes());
        message.push(b'r');
        for position in [lsn, lsn, lsn] {
            message.extend_from_slice(&position.to_be_bytes());
        }
        message.extend_from_slice(&clock.to_be_bytes());
        message.push(0);
        let mut writer = self.writer.lock().map_err(|_| std::io::Error::other("poisoned"))?;
        if writer.1 {
            return Ok(());
        }
        writer.0.write_all(&message)
    }

    /// Ends the COPY (CopyDone) after a last status update.
    fn finish(&self) -> std::io::Result<()> {
        self.confirm(self.flushed.load(Ordering::SeqCst))?;
        let mut writer = self.writer.lock().map_err(|_| std::io::Error::other("poisoned"))?;
        writer.1 = true;
        writer.0.write_all(&[b'c', 0, 0, 0, 4])
    }
}

/// A client connection's parameters from a `key=value ...` conninfo.
fn conninfo_of(conninfo: &str) -> HashMap<String, String> {
    conninfo.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
}

/// Reads one backend message into `body`; returns its type.
fn read_message(reader: &mut impl Read, body: &mut Vec<u8>) -> Result<u8> {
    let mut header = [0u8; 5];
    reader.read_exact(&mut header)?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    body.clear();
    body.resize(len.saturating_sub(4), 0);
    reader.read_exact(body)?;
    if header[0] == b'E' {
        // Fields: a type byte then a C string each; 'M' is the message.
        let text = body
            .split(|&b| b == 0)
            .find_map(|field| field.strip_prefix(b"M"))
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_default();
        return Err(format!("server error: {text}").into());
    }
    Ok(header[0])
}

/// Sends a simple query.
fn send_query(mut writer: &TcpStream, sql: &str) -> Result<()> {
    let mut message = vec![b'Q'];
    message.extend_from_slice(&(sql.len() as u32 + 5).to_be_bytes());
    message.extend_from_slice(sql.as_bytes());
    message.push(0);
    writer.write_all(&message)?;
    Ok(())
}

/// Opens a `replication=database` connection (trust authentication: the bench's cluster) whose
/// output functions write timestamps in UTC, ISO style, and returns its reader, its writer and the
/// walsender's pid.
fn connect(conninfo: &str) -> Result<(BufReader<TcpStream>, TcpStream, i32)> {
    let params = conninfo_of(conninfo);
    let get = |key: &str, default: &str| params.get(key).cloned().unwrap_or_else(|| default.to_string());
    let stream = TcpStream::connect((get("host", "127.0.0.1").as_str(), get("port", "5432").parse::<u16>()?))?;
    stream.set_nodelay(true)?;
    let writer = stream.try_clone()?;
    // Large reads: the walsender sends one CopyData per change.
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let mut startup = Vec::new();
    startup.extend_from_slice(&196_608u32.to_be_bytes());
    for (key, value) in [
        ("user", get("user", "postgres")),
        ("database", get("dbname", "postgres")),
        ("replication", "database".into()),
        ("TimeZone", "UTC".into()),
        ("DateStyle", "ISO".into()),
        ("application_name", "outbox-bench cdc-relay".into()),
    ] {
        startup.extend_from_slice(key.as_bytes());
        startup.push(0);
        startup.extend_from_slice(value.as_bytes());
        startup.push(0);
    }
    startup.push(0);
    let mut message = (startup.len() as u32 + 4).to_be_bytes().to_vec();
    message.extend_from_slice(&startup);
    (&writer).write_all(&message)?;
    let mut body = Vec::new();
    loop {
        match read_message(&mut reader, &mut body)? {
            b'R' if body.get(..4) == Some(&[0, 0, 0, 0]) => {}
            b'R' => return Err("the CDC peer speaks trust authentication only (the bench's cluster)".into()),
            b'Z' => break,
            _ => {}
        }
    }
    send_query(&writer, "SELECT pg_backend_pid()")?;
    let mut pid = 0;
    loop {
        match read_message(&mut reader, &mut body)? {
            // DataRow: column count, then length and text of the one column.
            b'D' if body.len() > 6 => pid = std::str::from_utf8(&body[6..])?.parse()?,
            b'Z' => break,
            _ => {}
        }
    }
    Ok((reader, writer, pid))
}

/// A cursor over a message's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let slice = self.bytes.get(self.at..self.at + n).ok_or("truncated message")?;
        self.at += n;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    }
    fn cstr(&mut self) -> Result<&'a [u8]> {
        let rest = self.bytes.get(self.at..).ok_or("truncated message")?;
        let end = rest.iter().position(|&b| b == 0).ok_or("unterminated string")?;
        self.at += end + 1;
        Ok(&rest[..end])
    }
}

/// `YYYY-MM-DD HH:MM:SS[.f]+00` (timestamptz's text in UTC, ISO style) as the other peers write
/// `created_at`: `YYYY-MM-DDTHH:MM:SS.ffffffZ`. Anything else is copied as it is.
fn push_created_at(out: &mut Vec<u8>, text: &[u8]) {
    let (Some(date_time), Some(rest)) = (text.get(..19), text.get(19..)) else {
        out.extend_from_slice(text);
        return;
    };
    let (fraction, zone) = match rest.strip_prefix(b".") {
        Some(rest) => {
            let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            (&rest[..digits], &rest[digits..])
        }
        None => (&rest[..0], rest),
    };
    if zone != b"+00" || fraction.len() > 6 || date_time[10] != b' ' {
        out.extend_from_slice(text);
        return;
    }
    out.extend_from_slice(&date_time[..10]);
    out.push(b'T');
    out.extend_from_slice(&date_time[11..]);
    out.push(b'.');
    out.extend_from_slice(fraction);
    out.extend(std::iter::repeat_n(b'0', 6 - fraction.len()));
    out.push(b'Z');
}

/// A column in binary form (pgoutput's `binary` option: the types' send functions, cheaper in the
/// walsender than their text output) written as its text, the way the other peers write it;
/// returns a bigint's value.
fn push_binary(out: &mut Vec<u8>, type_oid: u32, value: &[u8]) -> Result<Option<i64>> {
    const INT8: u32 = 20;
    const TEXT: u32 = 25;
    const VARCHAR: u32 = 1043;
    const TIMESTAMPTZ: u32 = 1184;
    const UUID: u32 = 2950;
    const JSONB: u32 = 3802;
    let be64 = |v: &[u8]| -> Result<i64> { Ok(i64::from_be_bytes(v.try_into().map_err(|_| "not 8 bytes")?)) };
    match type_oid {
        INT8 => {
            let n = be64(value)?;
            if n < 0 {
                out.push(b'-');
            }
            push_decimal(out, n.unsigned_abs() as usize);
            return Ok(Some(n));
        }
        TEXT | VARCHAR => out.extend_from_slice(value),
        // A version byte (1), then the text.
        JSONB => out.extend_from_slice(value.get(1..).ok_or("empty jsonb")?),
        UUID => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            for (i, byte) in value.iter().enumerate() {
                if matches!(i, 4 | 6 | 8 | 10) {
                    out.push(b'-');
                }
                out.push(HEX[(byte >> 4) as usize]);
                out.push(HEX[(byte & 15) as usize]);
            }
        }
        // Microseconds since 2000-01-01 UTC, as YYYY-MM-DDTHH:MM:SS.ffffffZ.
        TIMESTAMPTZ => {
            let micros = be64(value)? + 946_684_800_000_000;
            let (days, of_day) = (micros.div_euclid(86_400_000_000), micros.rem_euclid(86_400_000_000));
            // Howard Hinnant's days-to-civil.
            let z = days + 719_468;
            let era = z.div_euclid(146_097);
            let doe = z - era * 146_097;
            let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
            let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
            let mp = (5 * doy + 2) / 153;
            let day = doy - (153 * mp + 2) / 5 + 1;
            let month = if mp < 10 { mp + 3 } else { mp - 9 };
            let year = yoe + era * 400 + i64::from(month <= 2);
            let seconds = of_day / 1_000_000;
            let pad = |out: &mut Vec<u8>, n: i64, width: usize| {
                let mut digits = Vec::with_capacity(width);
                push_decimal(&mut digits, n as usize);
                out.extend(std::iter::repeat_n(b'0', width.saturating_sub(digits.len())));
                out.extend_from_slice(&digits);
            };
            pad(out, year, 4);
            out.push(b'-');
            pad(out, month, 2);
            out.push(b'-');
            pad(out, day, 2);
            out.push(b'T');
            pad(out, seconds / 3600, 2);
            out.push(b':');
            pad(out, seconds / 60 % 60, 2);
            out.push(b':');
            pad(out, seconds % 60, 2);
            out.push(b'.');
            pad(out, of_day % 1_000_000, 6);
            out.push(b'Z');
        }
        other => return Err(format!("no binary decoding for the type of oid {other}").into()),
    }
    Ok(None)
}

/// The reader: parses the walsender's CopyData into chunks until the server ends the COPY.
fn read_stream(
    mut reader: BufReader<TcpStream>,
    shared: &Shared,
    chunks: mpsc::SyncSender<Chunk>,
    batch: usize,
) -> Result<()> {
    // Relation id -> the column of each field, and its type.
    let mut relations: HashMap<u32, [Option<(usize, u32)>; FIELDS]> = HashMap::new();
    let mut chunk = Chunk::default();
    let mut in_transaction = false;
    let mut forwarded = 0u64;
    let mut body = Vec::new();
    let mut spans: Vec<(u32, u32, bool)> = Vec::new();
    loop {
        match read_message(&mut reader, &mut body)? {
            b'd' => {}
            // CopyDone (the server's answer to ours), CommandComplete, ReadyForQuery: the end.
            b'c' | b'C' | b'Z' => return Ok(()),
            _ => continue,
        }
        let mut message = Cursor { bytes: &body, at: 0 };
        match message.u8()? {
            // XLogData: start, end, clock, then one pgoutput message.
            b'w' => {
                message.take(24)?;
            }
            // Keepalive: WAL end, clock, whether a reply is asked for.
            b'k' => {
                let wal_end = message.u64()?;
                message.take(8)?;
                let reply = message.u8()? == 1;
                let idle = !in_transaction && shared.acknowledged.load(Ordering::SeqCst) == forwarded;
                if idle {
                    shared.flushed.fetch_max(wal_end, Ordering::SeqCst);
                }
                if reply || idle {
                    shared.confirm(shared.flushed.load(Ordering::SeqCst))?;
                }
                continue;
            }
            _ => continue,
        }
        match message.u8()? {
            b'B' => in_transaction = true,
            b'C' => {
                message.take(9)?;
                let end = message.u64()?;
                chunk.commit_end = Some(end);
                in_transaction = false;
                forwarded += chunk.events.len() as u64;
                shared.forwarded.store(forwarded, Ordering::SeqCst);
                if chunks.send(std::mem::take(&mut chunk)).is_err() {
                    return Ok(());
                }
            }
            b'R' => {
                let relation = message.u32()?;
                message.cstr()?;
                message.cstr()?;
                message.u8()?;
                let mut columns = [None; FIELDS];
                for column in 0..message.u16()? as usize {
                    message.u8()?;
                    let name = message.cstr()?;
                    let type_oid = message.u32()?;
                    message.u32()?;
                    if let Some(field) = COLUMN_NAMES.iter().position(|n| n.as_bytes() == name) {
                        columns[field] = Some((column, type_oid));
                    }
                }
                relations.insert(relation, columns);
            }
            b'I' => {
                let relation = message.u32()?;
                let columns = relations.get(&relation).ok_or("insert into a relation never described")?;
                message.u8()?;
                spans.clear();
                for _ in 0..message.u16()? {
                    spans.push(match message.u8()? {
                        kind @ (b't' | b'b') => {
                            let len = message.u32()?;
                            (message.at as u32, message.take(len as usize).map(|s| s.len() as u32)?, kind == b'b')
                        }
                        _ => (NULL.0, NULL.1, false),
                    });
                }
                let mut event = Event { id: 0, fields: [NULL; FIELDS] };
                for (field, column) in columns.iter().enumerate() {
                    let Some((column, type_oid)) = *column else { continue };
                    let Some(&(start, len, binary)) = spans.get(column) else { continue };
                    if len == u32::MAX {
                        continue;
                    }
                    let value = &body[start as usize..(start + len) as usize];
                    let at = chunk.data.len() as u32;
                    if binary {
                        let id = push_binary(&mut chunk.data, type_oid, value)?;
                        if field == ID {
                            event.id = id.ok_or("id is not a bigint")?;
                        }
                    } else {
                        if field == CREATED_AT {
                            push_created_at(&mut chunk.data, value);
                        } else {
                            chunk.data.extend_from_slice(value);
                        }
                        if field == ID {
                            event.id = std::str::from_utf8(value)?.parse()?;
                        }
                    }
                    event.fields[field] = (at, chunk.data.len() as u32 - at);
                }
                chunk.events.push(event);
                // A large transaction goes over in parts; its end LSN comes with the last.
                if chunk.events.len() >= batch {
                    forwarded += chunk.events.len() as u64;
                    shared.forwarded.store(forwarded, Ordering::SeqCst);
                    if chunks.send(std::mem::take(&mut chunk)).is_err() {
                        return Ok(());
                    }
                }
            }
            _ => {}
        }
    }
}

fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// Redis spoken directly (RESP): a batch's commands encoded into one reused buffer and written
/// at once, the replies read and checked without building values. The polling relay's
/// per-command allocations in redis-rs were a fifth of this process's CPU (perf).
struct RedisWire {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
    out: Vec<u8>,
    line: Vec<u8>,
}

impl RedisWire {
    /// `redis://HOST:PORT` (what the bench's Redis is).
    fn connect(url: &str) -> Result<RedisWire> {
        let address = url.strip_prefix("redis://").ok_or("the CDC relay takes a redis://HOST:PORT URL")?;
        let writer = TcpStream::connect(address.trim_end_matches('/'))?;
        writer.set_nodelay(true)?;
        let reader = BufReader::with_capacity(1 << 16, writer.try_clone()?);
        Ok(RedisWire { writer, reader, out: Vec::with_capacity(1 << 20), line: Vec::new() })
    }

    fn decimal(&mut self, n: usize) {
        push_decimal(&mut self.out, n);
    }

    fn array(&mut self, len: usize) {
        self.out.push(b'*');
        self.decimal(len);
        self.out.extend_from_slice(b"\r\n");
    }

    fn bulk(&mut self, bytes: &[u8]) {
        self.out.push(b'$');
        self.decimal(bytes.len());
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(bytes);
        self.out.extend_from_slice(b"\r\n");
    }

    /// Reads one reply, fails on an error reply (at any depth).
    fn reply(&mut self) -> Result<()> {
        self.line.clear();
        self.reader.read_until(b'\n', &mut self.line)?;
        let number = |line: &[u8]| -> Result<i64> {
            Ok(std::str::from_utf8(line.get(1..line.len().saturating_sub(2)).unwrap_or(b""))?.parse()?)
        };
        match self.line.first() {
            Some(b'+' | b':') => Ok(()),
            Some(b'-') => Err(format!("Redis: {}", String::from_utf8_lossy(&self.line).trim_end()).into()),
            Some(b'$') => {
                let len = number(&self.line)?;
                if len >= 0 {
                    std::io::copy(&mut (&mut self.reader).take(len as u64 + 2), &mut std::io::sink())?;
                }
                Ok(())
            }
            Some(b'*') => {
                for _ in 0..number(&self.line)?.max(0) {
                    self.reply()?;
                }
                Ok(())
            }
            _ => Err(format!("unexpected Redis reply {:?}", String::from_utf8_lossy(&self.line)).into()),
        }
    }

    /// XADDs `chunks`' events in one MULTI/EXEC, each to `outbox:<aggregate_type>` with the
    /// fields the other peers write; returns how many once Redis has executed them.
    fn publish(&mut self, chunks: &[Chunk]) -> Result<usize> {
        self.out.clear();
        self.array(1);
        self.bulk(b"MULTI");
        let mut position = 0usize;
        let mut seq = Vec::with_capacity(20);
        for chunk in chunks {
            for event in &chunk.events {
                position += 1;
                let field = |f| chunk.field(event, f).unwrap_or(b"");
                let headers = chunk.field(event, HEADERS);
                self.array(3 + 2 * (7 + usize::from(headers.is_some()) + 1));
                self.bulk(b"XADD");
                self.out.push(b'$');
                self.decimal(7 + field(AGGREGATE_TYPE).len());
                self.out.extend_from_slice(b"\r\noutbox:");
                self.out.extend_from_slice(field(AGGREGATE_TYPE));
                self.out.extend_from_slice(b"\r\n");
                self.bulk(b"*");
                self.bulk(b"event_id");
                self.bulk(field(EVENT_ID));
                self.bulk(b"outbox_id");
                self.bulk(field(ID));
                self.bulk(b"aggregate_type");
                self.bulk(field(AGGREGATE_TYPE));
                self.bulk(b"aggregate_id");
                self.bulk(field(AGGREGATE_ID));
                // As in the polling peer: the seeds' table has no sequence number, the place in
                // the batch fills the field so that entries are as large as outbox_pg's.
                self.bulk(b"aggregate_seq");
                seq.clear();
                push_decimal(&mut seq, position);
                self.bulk(&seq);
                self.bulk(b"event_type");
                self.bulk(field(EVENT_TYPE));
                self.bulk(b"payload");
                self.bulk(field(PAYLOAD));
                if let Some(headers) = headers {
                    self.bulk(b"headers");
                    self.bulk(headers);
                }
                self.bulk(b"created_at");
                self.bulk(field(CREATED_AT));
            }
        }
        if position == 0 {
            return Ok(0);
        }
        self.array(1);
        self.bulk(b"EXEC");
        self.writer.write_all(&self.out)?;
        // +OK, +QUEUED per command, then EXEC's array of entry ids.
        for _ in 0..position + 2 {
            self.reply()?;
        }
        Ok(position)
    }
}

/// The trimmer: deletes published rows, everything that has queued up in one statement. Returns
/// the CPU ticks its backend spent.
fn trim(conninfo: &str, ids: mpsc::Receiver<Vec<i64>>) -> Result<u64> {
    let mut client = pg(conninfo)?;
    let backend: i32 = client.query_one("SELECT pg_backend_pid()", &[])?.get(0);
    let before = cpu_ticks(backend)?;
    let delete = client.prepare("DELETE FROM bench_seed_outbox WHERE id = ANY($1)")?;
    while let Ok(mut batch) = ids.recv() {
        while let Ok(more) = ids.try_recv() {
            batch.extend(more);
        }
        client.execute(&delete, &[&batch])?;
    }
    Ok(cpu_ticks(backend)? - before)
}

/// `outbox-bench cdc-relay`: see the module's header.
pub fn cdc_relay(args: &Args) -> Result<()> {
    let (reader, writer, walsender) = connect(&args.pg)?;
    let me = std::process::id() as i32;
    let (walsender_before, me_before) = (cpu_ticks(walsender)?, cpu_ticks(me)?);
    // Protocol 1, what Debezium and Sequin ask for: whole transactions, sent at their commit. The
    // columns in binary (their send functions), which cost the walsender about 10% less than their
    // text (what Debezium and Sequin ask for, `--text`) in alternated drains.
    send_query(
        &writer,
        &format!(
            "START_REPLICATION SLOT {SLOT} LOGICAL 0/0 (proto_version '1', publication_names '{PUBLICATION}', binary '{}')",
            !args.text
        ),
    )?;
    let shared = Arc::new(Shared {
        writer: Mutex::new((writer, false)),
        flushed: AtomicU64::new(0),
        forwarded: AtomicU64::new(0),
        acknowledged: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let mut reader = reader;
    let mut body = Vec::new();
    while read_message(&mut reader, &mut body)? != b'W' {}

    let batch = args.batch.max(1) as usize;
    let (chunk_tx, chunk_rx) = mpsc::sync_channel::<Chunk>(256);
    let reading = {
        let shared = shared.clone();
        std::thread::spawn(move || read_stream(reader, &shared, chunk_tx, batch))
    };
    let (trim_tx, trim_rx) = mpsc::channel::<Vec<i64>>();
    let trimming = args.trim.then(|| {
        let conninfo = args.pg.clone();
        std::thread::spawn(move || trim(&conninfo, trim_rx))
    });
    if args.events.is_none() {
        // Follow mode: run until the parent closes our standard input.
        let shared = shared.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            shared.stop.store(true, Ordering::SeqCst);
        });
    }

    let mut redis = RedisWire::connect(&args.redis)?;
    let mut published = 0u64;
    let mut gathered: Vec<Chunk> = Vec::new();
    let outcome = (|| -> Result<()> {
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            let first = match chunk_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(chunk) => chunk,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            };
            let mut events = first.events.len();
            gathered.push(first);
            while events < batch {
                match chunk_rx.try_recv() {
                    Ok(chunk) => {
                        events += chunk.events.len();
                        gathered.push(chunk);
                    }
                    Err(_) => break,
                }
            }
            let sent = redis.publish(&gathered)?;
            published += sent as u64;
            shared.acknowledged.fetch_add(sent as u64, Ordering::SeqCst);
            // Redis has the batch: confirm up to the last whole transaction in it.
            if let Some(end) = gathered.iter().rev().find_map(|chunk| chunk.commit_end) {
                shared.flushed.fetch_max(end, Ordering::SeqCst);
                shared.confirm(shared.flushed.load(Ordering::SeqCst))?;
            }
            if trimming.is_some() && sent > 0 {
                let ids = gathered.iter().flat_map(|c| c.events.iter().map(|e| e.id)).collect();
                trim_tx.send(ids).map_err(|_| "the trimmer stopped")?;
            }
            gathered.clear();
            if args.events.is_some_and(|events| published >= events as u64) {
                return Ok(());
            }
        }
    })();
    // Finish the COPY: the server answers with its own CopyDone, which ends the reader; what it
    // sent meanwhile is neither published nor confirmed, and so is sent again next time.
    let finished = shared.finish();
    drop(chunk_rx);
    let read = reading.join().map_err(|_| "the reader panicked")?;
    drop(trim_tx);
    let trimmed = trimming.map(|t| t.join().map_err(|_| "the trimmer panicked")).transpose()?.transpose();
    outcome?;
    finished?;
    read?;
    let trimmer_ticks = trimmed?.unwrap_or(0);
    let (walsender_after, me_after) = (cpu_ticks(walsender)?, cpu_ticks(me)?);
    // Terminate.
    let _ = shared.writer.lock().map_err(|_| "poisoned")?.0.write_all(&[b'X', 0, 0, 0, 4]);
    println!(
        "events={published} backend_ticks={} process_ticks={} walsender_ticks={} flushed_lsn={}",
        walsender_after - walsender_before + trimmer_ticks,
        me_after - me_before,
        walsender_after - walsender_before,
        shared.flushed.load(Ordering::SeqCst)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::push_created_at;

    fn created_at(text: &str) -> String {
        let mut out = Vec::new();
        push_created_at(&mut out, text.as_bytes());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn created_at_as_the_other_peers_write_it() {
        assert_eq!(created_at("2025-12-04 21:59:00.123456+00"), "2025-12-04T21:59:00.123456Z");
        assert_eq!(created_at("2025-12-04 21:59:00.1234+00"), "2025-12-04T21:59:00.123400Z");
        assert_eq!(created_at("2025-12-04 21:59:00+00"), "2025-12-04T21:59:00.000000Z");
        // Not UTC: left as the server wrote it.
        assert_eq!(created_at("2025-12-04 22:59:00+01"), "2025-12-04 22:59:00+01");
    }

    fn binary(type_oid: u32, value: &[u8]) -> String {
        let mut out = Vec::new();
        super::push_binary(&mut out, type_oid, value).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn binary_columns_as_their_text() {
        assert_eq!(binary(20, &(-42i64).to_be_bytes()), "-42");
        assert_eq!(binary(20, &96_679i64.to_be_bytes()), "96679");
        assert_eq!(
            binary(
                2950,
                &[0x15, 0x54, 0x58, 0xc1, 0xf3, 0xb5, 0x4c, 0x75, 0x97, 0xa1, 0x29, 0x17, 0xbb, 0x40, 0x72, 0xcf]
            ),
            "155458c1-f3b5-4c75-97a1-2917bb4072cf"
        );
        assert_eq!(binary(3802, b"\x01{\"a\": 1}"), "{\"a\": 1}");
        // 2026-12-04 22:49:14.537956 UTC and 2000-01-01 and 1999-12-31 23:59:59.999999.
        assert_eq!(binary(1184, &849_739_754_537_956i64.to_be_bytes()), "2026-12-04T22:49:14.537956Z");
        assert_eq!(binary(1184, &0i64.to_be_bytes()), "2000-01-01T00:00:00.000000Z");
        assert_eq!(binary(1184, &(-1i64).to_be_bytes()), "1999-12-31T23:59:59.999999Z");
        assert_eq!(binary(1184, &(4_107_542_400_000_000i64 - 1).to_be_bytes()), "2130-02-28T23:59:59.999999Z");
    }
}
