//! Decoding of the raw stream replies this crate uses.
//!
//! Done by hand rather than through the redis crate's typed stream replies because those map
//! fields into a `HashMap<String, _>`, which would lose field order, duplicate fields and
//! non-UTF-8 names: all things a dead-letter copy should preserve and the parser should judge.
//! Both RESP2 (arrays) and RESP3 (maps) shapes are accepted.

use redis::Value;

/// An entry's field/value pairs, in stream order, as raw bytes.
pub(crate) type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// One stream entry as stored: its ID and its field/value pairs in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawEntry {
    pub id: String,
    pub fields: Fields,
}

impl RawEntry {
    /// The pairs as borrowed byte slices, the form [`crate::Event::from_fields`] takes.
    pub fn field_slices(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}

/// An XAUTOCLAIM reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AutoClaim {
    /// Where the next scan page starts; `0-0` when the scan is complete.
    pub cursor: String,
    /// Entries now owned by this consumer.
    pub entries: Vec<RawEntry>,
    /// IDs of pending entries whose stream entry no longer exists (deleted or trimmed). Redis 7
    /// lists them separately (and drops them from the PEL itself); Redis 6.2 returns them among
    /// the entries with nil fields, which we move here.
    pub deleted: Vec<String>,
}

/// One row of an extended XPENDING reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingInfo {
    pub id: String,
    pub consumer: String,
    pub deliveries: u64,
}

fn text(value: &Value, what: &str) -> Result<String, String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).map_err(|_| format!("{what} is not UTF-8")),
        Value::SimpleString(s) => Ok(s.clone()),
        Value::VerbatimString { text, .. } => Ok(text.clone()),
        Value::Int(n) => Ok(n.to_string()),
        other => Err(format!("{what}: expected a string, got {other:?}")),
    }
}

fn bytes(value: Value, what: &str) -> Result<Vec<u8>, String> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::VerbatimString { text, .. } => Ok(text.into_bytes()),
        Value::Int(n) => Ok(n.to_string().into_bytes()),
        other => Err(format!("{what}: expected a string, got {other:?}")),
    }
}

fn array(value: Value, what: &str) -> Result<Vec<Value>, String> {
    match value {
        Value::Array(items) | Value::Set(items) => Ok(items),
        other => Err(format!("{what}: expected an array, got {other:?}")),
    }
}

/// The fields of an entry: a flat `[f1, v1, f2, v2, ...]` array or a RESP3 map. `None` for a nil
/// (deleted entry).
fn fields(value: Value) -> Result<Option<Fields>, String> {
    match value {
        Value::Nil => Ok(None),
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Ok((bytes(k, "field name")?, bytes(v, "field value")?)))
            .collect::<Result<Vec<_>, String>>()
            .map(Some),
        other => {
            let items = array(other, "entry fields")?;
            if items.len() % 2 != 0 {
                return Err(format!("entry fields: odd number of items ({})", items.len()));
            }
            let mut pairs = Vec::with_capacity(items.len() / 2);
            let mut iter = items.into_iter();
            while let (Some(k), Some(v)) = (iter.next(), iter.next()) {
                pairs.push((bytes(k, "field name")?, bytes(v, "field value")?));
            }
            Ok(Some(pairs))
        }
    }
}

/// A list of `[id, fields]` entries. Entries with nil fields are returned as `Err(id)`.
fn entries(value: Value) -> Result<Vec<Result<RawEntry, String>>, String> {
    let mut out = Vec::new();
    for item in array(value, "entry list")? {
        let mut parts = array(item, "entry")?.into_iter();
        let (Some(id), fields_value) = (parts.next(), parts.next()) else {
            return Err("entry: empty array".to_string());
        };
        let id = text(&id, "entry id")?;
        match fields(fields_value.unwrap_or(Value::Nil))? {
            Some(fields) => out.push(Ok(RawEntry { id, fields })),
            None => out.push(Err(id)),
        }
    }
    Ok(out)
}

/// Decodes an XREADGROUP reply for a single stream: nil (timeout) or `[[stream, entries]]`.
/// Entries with nil fields (possible only when re-reading history) are dropped.
pub(crate) fn read_group(value: Value) -> Result<Vec<RawEntry>, String> {
    let streams: Vec<(Value, Value)> = match value {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(pairs) => pairs,
        other => {
            let mut pairs = Vec::new();
            for item in array(other, "XREADGROUP reply")? {
                let mut parts = array(item, "stream reply")?.into_iter();
                match (parts.next(), parts.next()) {
                    (Some(key), Some(list)) => pairs.push((key, list)),
                    _ => return Err("stream reply: expected [key, entries]".to_string()),
                }
            }
            pairs
        }
    };
    let mut out = Vec::new();
    for (_key, list) in streams {
        out.extend(entries(list)?.into_iter().filter_map(Result::ok));
    }
    Ok(out)
}

/// Decodes an XAUTOCLAIM reply: `[cursor, entries]` (Redis 6.2) or `[cursor, entries, deleted]`
/// (Redis 7+).
pub(crate) fn auto_claim(value: Value) -> Result<AutoClaim, String> {
    let mut parts = array(value, "XAUTOCLAIM reply")?.into_iter();
    let (Some(cursor), Some(list)) = (parts.next(), parts.next()) else {
        return Err("XAUTOCLAIM reply: expected [cursor, entries, ...]".to_string());
    };
    let cursor = text(&cursor, "cursor")?;
    let mut claim = AutoClaim { cursor, entries: Vec::new(), deleted: Vec::new() };
    for entry in entries(list)? {
        match entry {
            Ok(entry) => claim.entries.push(entry),
            Err(id) => claim.deleted.push(id),
        }
    }
    if let Some(deleted) = parts.next() {
        for id in array(deleted, "deleted ids")? {
            claim.deleted.push(text(&id, "deleted id")?);
        }
    }
    Ok(claim)
}

/// Decodes an extended XPENDING reply: `[[id, consumer, idle_ms, deliveries], ...]`.
pub(crate) fn pending(value: Value) -> Result<Vec<PendingInfo>, String> {
    let mut out = Vec::new();
    for row in array(value, "XPENDING reply")? {
        let row = array(row, "XPENDING row")?;
        let [id, consumer, _idle, deliveries] = row.as_slice() else {
            return Err(format!("XPENDING row: expected 4 items, got {}", row.len()));
        };
        let deliveries = match deliveries {
            Value::Int(n) => u64::try_from(*n).map_err(|_| format!("negative delivery count {n}"))?,
            other => {
                text(other, "delivery count")?.parse().map_err(|_| "delivery count is not a number".to_string())?
            }
        };
        out.push(PendingInfo { id: text(id, "pending id")?, consumer: text(consumer, "consumer")?, deliveries });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn entry(id: &str, kv: &[&str]) -> Value {
        Value::Array(vec![bulk(id), Value::Array(kv.iter().map(|s| bulk(s)).collect())])
    }

    #[test]
    fn read_group_resp2_and_timeout() {
        assert_eq!(read_group(Value::Nil), Ok(vec![]));
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("s"),
            Value::Array(vec![entry("1-0", &["a", "1", "b", "2"]), entry("2-0", &[])]),
        ])]);
        let got = read_group(reply).expect("valid reply");
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].id, "1-0");
        assert_eq!(got[0].fields, vec![(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), b"2".to_vec())]);
        assert!(got[1].fields.is_empty());
    }

    #[test]
    fn read_group_resp3_map() {
        let reply = Value::Map(vec![(
            bulk("s"),
            Value::Array(vec![Value::Array(vec![bulk("1-0"), Value::Map(vec![(bulk("a"), bulk("1"))])])]),
        )]);
        let got = read_group(reply).expect("valid reply");
        assert_eq!(got, vec![RawEntry { id: "1-0".into(), fields: vec![(b"a".to_vec(), b"1".to_vec())] }]);
    }

    #[test]
    fn auto_claim_both_versions() {
        // Redis 6.2: deleted entries come back with nil fields.
        let v62 = Value::Array(vec![
            bulk("0-0"),
            Value::Array(vec![entry("1-0", &["a", "1"]), Value::Array(vec![bulk("2-0"), Value::Nil])]),
        ]);
        let got = auto_claim(v62).expect("valid reply");
        assert_eq!(got.cursor, "0-0");
        assert_eq!(got.entries.len(), 1);
        assert_eq!(got.deleted, vec!["2-0".to_string()]);

        let v7 = Value::Array(vec![
            bulk("5-0"),
            Value::Array(vec![entry("3-0", &["a", "1"])]),
            Value::Array(vec![bulk("4-0")]),
        ]);
        let got = auto_claim(v7).expect("valid reply");
        assert_eq!(got.cursor, "5-0");
        assert_eq!(got.entries[0].id, "3-0");
        assert_eq!(got.deleted, vec!["4-0".to_string()]);
    }

    #[test]
    fn pending_rows() {
        let reply = Value::Array(vec![Value::Array(vec![bulk("1-0"), bulk("c1"), Value::Int(1200), Value::Int(3)])]);
        assert_eq!(pending(reply), Ok(vec![PendingInfo { id: "1-0".into(), consumer: "c1".into(), deliveries: 3 }]));
        assert_eq!(pending(Value::Array(vec![])), Ok(vec![]));
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        assert!(read_group(Value::Int(3)).is_err());
        assert!(read_group(Value::Array(vec![Value::Array(vec![bulk("s")])])).is_err());
        assert!(read_group(Value::Array(vec![Value::Array(vec![
            bulk("s"),
            Value::Array(vec![entry("1-0", &["odd"])])
        ])]))
        .is_err());
        assert!(auto_claim(Value::Array(vec![bulk("0-0")])).is_err());
        assert!(pending(Value::Array(vec![Value::Array(vec![bulk("1-0")])])).is_err());
    }
}
