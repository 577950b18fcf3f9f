//! A `pg_snapshot` as the log's cursors store it: which transactions it sees. The batch rule
//! (src/log/window.rs) is stated in these terms.

/// A `pg_snapshot` as its text form spells it (`xmin:xmax:xip,...`): which transactions it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmin: u64,
    pub xmax: u64,
    /// Running when the snapshot was taken, ascending.
    pub xip: Vec<u64>,
}

impl Snapshot {
    /// Parses the text form of a `pg_snapshot`; `None` when it is not one.
    pub fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.trim().splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let list = parts.next()?;
        let mut xip = if list.is_empty() {
            Vec::new()
        } else {
            list.split(',').map(|x| x.parse().ok()).collect::<Option<Vec<u64>>>()?
        };
        if xmin > xmax || xip.iter().any(|&x| x < xmin || x >= xmax) {
            return None;
        }
        xip.sort_unstable();
        xip.dedup();
        Some(Snapshot { xmin, xmax, xip })
    }

    /// Whether a transaction is visible in (had completed before) this snapshot, as
    /// `pg_visible_in_snapshot` answers it.
    pub fn sees(&self, txid: u64) -> bool {
        txid < self.xmin || (txid < self.xmax && self.xip.binary_search(&txid).is_err())
    }
}

#[cfg(test)]
mod tests {
    use super::Snapshot;

    #[test]
    fn a_snapshot_sees_what_completed_before_it() {
        let snapshot = Snapshot::parse("10:20:15,12").unwrap();
        assert!(snapshot.sees(9));
        assert!(snapshot.sees(10) && snapshot.sees(14) && snapshot.sees(19));
        assert!(!snapshot.sees(12) && !snapshot.sees(15));
        assert!(!snapshot.sees(20) && !snapshot.sees(21));
        assert_eq!(Snapshot::parse("5:5:").unwrap(), Snapshot { xmin: 5, xmax: 5, xip: vec![] });
    }

    #[test]
    fn what_is_not_a_snapshot_is_refused() {
        for text in ["", "1", "1:2", "2:1:", "1:5:7", "1:5:0", "a:b:", "1:5:2,x"] {
            assert_eq!(Snapshot::parse(text), None, "{text:?}");
        }
    }
}
