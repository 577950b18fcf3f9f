//! Redis Cluster's key space: which of the 16,384 hash slots a stream key is in (CRC16 of the key,
//! or of its `{hash tag}`), and which master serves each slot, as `CLUSTER SLOTS` reports it. Pure
//! data: the sink (sink/src/redis.rs) decides when to read the map again (at the first publish,
//! after MOVED, after a node failed).

/// A cluster node's client endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

pub const SLOTS: u16 = 16_384;

/// The hash slot of `key`: CRC16 (XMODEM) of the key modulo 16,384, or of the part between the
/// first `{` and the next `}` when that part is not empty, so that `{orders}:created` and
/// `{orders}:paid` share a slot (and a node).
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster hashes keys with.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= (byte as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// Which master serves each slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    /// One entry per slot; `None` for a slot no node serves (the cluster is not fully covered).
    masters: Vec<Option<NodeAddr>>,
}

impl SlotMap {
    /// Reads a `CLUSTER SLOTS` reply, asked of the node at `asked_host`: an array of
    /// `[first slot, last slot, [master host, port, id, ...], replicas...]`. An empty or `?` host
    /// means the node that answered.
    pub fn from_cluster_slots(reply: &redis::Value, asked_host: &str) -> Result<SlotMap, String> {
        let redis::Value::Array(ranges) = reply else {
            return Err(format!("unexpected CLUSTER SLOTS reply: {reply:?}"));
        };
        let mut masters = vec![None; SLOTS as usize];
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                return Err(format!("unexpected CLUSTER SLOTS range: {range:?}"));
            };
            let (Some(first), Some(last), Some(redis::Value::Array(master))) =
                (fields.first().and_then(int), fields.get(1).and_then(int), fields.get(2))
            else {
                return Err(format!("unexpected CLUSTER SLOTS range: {range:?}"));
            };
            let host = master.first().and_then(text).unwrap_or_default();
            let host = if host.is_empty() || host == "?" { asked_host.to_string() } else { host };
            let port = master.get(1).and_then(int).filter(|port| (1..=65535).contains(port));
            let (Some(port), true) = (port, first <= last && last < SLOTS as i64) else {
                return Err(format!("unexpected CLUSTER SLOTS range: {range:?}"));
            };
            let node = NodeAddr { host, port: port as u16 };
            for slot in first..=last {
                masters[slot as usize] = Some(node.clone());
            }
        }
        Ok(SlotMap { masters })
    }

    /// The master serving `slot`, if any.
    pub fn master_of(&self, slot: u16) -> Option<&NodeAddr> {
        self.masters.get(slot as usize).and_then(Option::as_ref)
    }

    /// Records that `slot` moved to `node` (a MOVED reply), until the next full read.
    pub fn moved(&mut self, slot: u16, node: NodeAddr) {
        if let Some(entry) = self.masters.get_mut(slot as usize) {
            *entry = Some(node);
        }
    }

    /// Every master the map names, each once.
    pub fn masters(&self) -> Vec<NodeAddr> {
        let mut nodes: Vec<NodeAddr> = self.masters.iter().flatten().cloned().collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }
}

fn int(value: &redis::Value) -> Option<i64> {
    match value {
        redis::Value::Int(n) => Some(*n),
        _ => None,
    }
}

fn text(value: &redis::Value) -> Option<String> {
    match value {
        redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    #[test]
    fn key_slots_match_redis_cluster() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.0.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"outbox:payment"), key_slot(b"outbox:payment"));
        assert_eq!(key_slot(b"123456789"), 0x31C3 % SLOTS);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"{user1000}.followers"));
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // An empty tag, or an unclosed one, hashes the whole key.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"foo{bar"), crc16(b"foo{bar") % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), crc16(b"{bar") % SLOTS);
    }

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn the_slot_map_names_each_slots_master() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000), bulk("id1")]),
                Value::Array(vec![bulk("10.0.0.4"), Value::Int(7003), bulk("id4")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![bulk(""), Value::Int(7001), bulk("id2")]),
            ]),
        ]);
        let mut map = SlotMap::from_cluster_slots(&reply, "seed").unwrap();
        assert_eq!(map.master_of(0), Some(&NodeAddr { host: "10.0.0.1".into(), port: 7000 }));
        assert_eq!(map.master_of(16383), Some(&NodeAddr { host: "seed".into(), port: 7001 }));
        assert_eq!(map.masters().len(), 2);
        map.moved(3, NodeAddr { host: "10.0.0.9".into(), port: 7009 });
        assert_eq!(map.master_of(3).map(|n| n.port), Some(7009));
        let partial = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(10),
            Value::Array(vec![bulk("h"), Value::Int(1)]),
        ])]);
        assert_eq!(SlotMap::from_cluster_slots(&partial, "x").unwrap().master_of(11), None);
        assert!(SlotMap::from_cluster_slots(&Value::Nil, "x").is_err());
    }
}
