//! The publishing step of a round: its publish list (the failure path's due events, then the
//! log's, less those that must wait behind an earlier event of their aggregate), cut into
//! MULTI/EXEC pipelines, and the count of what Redis did with each entry (the tally and the
//! settlement the finish writes). Pure: no PostgreSQL, no Redis; src/relay/round.rs calls the sink.

use outbox_sink::event::OutboxEvent;
use outbox_sink::redis::{BrokerError, EntryOutcome};

use crate::read::Batch;
use crate::settle::Settlement;
use crate::tick_settings::{Map, Set, TickSettings};

/// Where an event of the publish list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Log,
    Held,
}

/// What a round publishes, and what it already knows about how it is finished.
pub struct PublishList {
    pub sources: Vec<Source>,
    pub events: Vec<OutboxEvent>,
    pub settlement: Settlement,
}

/// What a round's publishing added up to.
#[derive(Default)]
pub struct Tally {
    pub published: usize,
    pub rejected: usize,
    pub last_rejection: Option<String>,
    /// Aggregates with an event Redis rejected or that was not sent: in order, their later events
    /// wait behind it.
    pub broken: Set<(String, String)>,
}

/// The round's publish list: the failure path's due events first (they are older), then the
/// log's, but those whose aggregate waits on the failure path, and, in order, those bound for
/// another stream than their aggregate's earlier events in the round (they go to the failure path
/// without being sent). The events are moved, not copied (the relay's CPU per event is mostly
/// allocation and copying: docs/performance.md).
pub fn publish_list(batch: &mut Batch, settings: &TickSettings) -> PublishList {
    let claimed = batch.events.len() + batch.held_due.len();
    let mut settlement = Settlement::default();
    let mut sources: Vec<Source> = Vec::with_capacity(claimed);
    let mut events: Vec<OutboxEvent> = Vec::with_capacity(claimed);
    for event in std::mem::take(&mut batch.held_due) {
        sources.push(Source::Held);
        events.push(event);
    }
    for event in std::mem::take(&mut batch.events) {
        if batch.diverted.contains(&event.id) {
            settlement.hold.push((event.event_id, event.aggregate_seq, None));
        } else {
            sources.push(Source::Log);
            events.push(event);
        }
    }
    if settings.in_order {
        let deferred = deferred_by_stream_change(&events, &settings.entries.stream_template);
        if !deferred.is_empty() {
            let mut kept_sources = Vec::with_capacity(sources.len());
            let mut kept = Vec::with_capacity(events.len());
            for (source, event) in sources.into_iter().zip(events) {
                if !deferred.contains(&event.id) {
                    kept_sources.push(source);
                    kept.push(event);
                } else if source == Source::Log {
                    settlement.hold.push((event.event_id, event.aggregate_seq, None));
                }
            }
            (sources, events) = (kept_sources, kept);
        }
    }
    PublishList { sources, events, settlement }
}

impl Tally {
    /// Counts one pipeline's outcomes into the tally and the settlement. `Err` when Redis refused
    /// part of it as a whole: nothing is finished, and all of it is read again later.
    pub fn count(
        &mut self,
        sources: &[Source],
        events: &[OutboxEvent],
        outcomes: Vec<EntryOutcome>,
        settings: &TickSettings,
        settlement: &mut Settlement,
    ) -> Result<(), BrokerError> {
        for ((source, event), outcome) in sources.iter().zip(events).zip(outcomes) {
            if let EntryOutcome::BrokerRefused(error) = outcome {
                return Err(BrokerError(error));
            }
            let aggregate = || (event.aggregate_type.clone(), event.aggregate_id.clone());
            match (source, outcome) {
                (Source::Held, EntryOutcome::Published(_)) => {
                    self.published += 1;
                    settlement.held_published.push(event.id);
                    settlement.journal(event, &settings.entries.stream_template);
                }
                (Source::Held, EntryOutcome::Rejected(error)) => {
                    self.rejected += 1;
                    self.last_rejection = Some(error.clone());
                    settlement.held_rejected.push((event.id, error));
                }
                (Source::Held, _) => {}
                (Source::Log, EntryOutcome::Published(_))
                    if !(settings.in_order && !self.broken.is_empty() && self.broken.contains(&aggregate())) =>
                {
                    self.published += 1;
                    settlement.journal(event, &settings.entries.stream_template);
                }
                (Source::Log, EntryOutcome::Rejected(error)) => {
                    self.rejected += 1;
                    self.last_rejection = Some(error.clone());
                    settlement.hold.push((event.event_id.clone(), event.aggregate_seq, Some(error)));
                    self.broken.insert(aggregate());
                }
                // Not sent, or (in order) published after an earlier event of its aggregate failed
                // in this same pipeline (an oversize entry is rejected alone): it waits on the
                // failure path, behind the failed one.
                (Source::Log, _) => {
                    settlement.hold.push((event.event_id.clone(), event.aggregate_seq, None));
                    self.broken.insert(aggregate());
                }
            }
        }
        Ok(())
    }
}

/// The most bytes of events one pipeline sends. Redis closes the connection of a client whose
/// unread input passes `client-query-buffer-limit` (1 GB by default); a pipeline above it would fail
/// as a whole, round after round, and stall the outbox. 64 MB keeps well below it and still
/// carries thousands of ordinary events.
pub const PIPELINE_BYTES: usize = 64 * 1024 * 1024;

/// How much one MULTI/EXEC pipeline carries.
#[derive(Debug, Clone, Copy)]
pub struct PipelineLimits {
    pub entries: usize,
    pub bytes: usize,
}

/// Takes the next pipeline from `pending` (in order): up to `limits.entries` events and
/// `limits.bytes` bytes (at least one event, so one larger than the budget still goes, alone).
/// Events for which `waits` holds are taken out without being sent and returned last. Returns the
/// pipeline's sources, its events, and the waiting events.
pub fn next_pipeline(
    pending: &mut std::iter::Peekable<impl Iterator<Item = (Source, OutboxEvent)>>,
    limits: PipelineLimits,
    waits: impl Fn(&Source, &OutboxEvent) -> bool,
) -> (Vec<Source>, Vec<OutboxEvent>, Vec<OutboxEvent>) {
    let mut sources = Vec::with_capacity(limits.entries.min(1024));
    let mut events: Vec<OutboxEvent> = Vec::with_capacity(limits.entries.min(1024));
    let mut waiting = Vec::new();
    let mut bytes = 0usize;
    while events.len() < limits.entries {
        let Some((source, event)) = pending.peek() else { break };
        let held_back = waits(source, event);
        let size = event.approximate_size();
        if !held_back && !events.is_empty() && bytes.saturating_add(size) > limits.bytes {
            break;
        }
        let Some((source, event)) = pending.next() else { break };
        if held_back {
            waiting.push(event);
            continue;
        }
        bytes = bytes.saturating_add(size);
        sources.push(source);
        events.push(event);
    }
    (sources, events, waiting)
}

/// In per-aggregate order, a round may carry several consecutive events of one aggregate. Redis
/// rejects an entry because of its stream key (e.g. WRONGTYPE), so events to the same key share
/// their fate: if the first is rejected, so are the later ones, and order holds. An event bound for
/// a *different* key than its aggregate's earlier events in the round could succeed where they
/// fail, so it and every later event of its aggregate wait: their ids are returned. `events` are in
/// per-aggregate order.
pub fn deferred_by_stream_change(events: &[OutboxEvent], stream_template: &str) -> Set<i64> {
    let mut run_key: Map<(&str, &str), Option<String>> = Map::default();
    let mut deferred = Set::default();
    for event in events {
        let key = event.stream_key(stream_template);
        let slot = run_key
            .entry((event.aggregate_type.as_str(), event.aggregate_id.as_str()))
            .or_insert_with(|| Some(key.clone()));
        if slot.as_deref() != Some(key.as_str()) {
            // Once a run is cut, every later event of the aggregate waits too.
            *slot = None;
            deferred.insert(event.id);
        }
    }
    deferred
}

#[cfg(test)]
mod tests {
    use super::{deferred_by_stream_change, next_pipeline, PipelineLimits, Source};
    use crate::read::{allowance_order, distinct_aggregates, shards_to_read, AfterRead, ShardClaim, ShardRead};
    use outbox_sink::event::OutboxEvent;

    fn event(id: i64, aggregate_id: &str, stream: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            id,
            event_id: format!("e{id}"),
            aggregate_type: "acct".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: id,
            event_type: "t".into(),
            payload: "{}".into(),
            headers: None,
            trace: None,
            stream: stream.map(str::to_string),
            created_at: String::new(),
            replay: None,
        }
    }

    #[test]
    fn a_run_is_cut_where_its_stream_key_changes() {
        let events = vec![
            event(1, "a", None),
            event(2, "b", Some("other")),
            event(3, "a", None),
            event(4, "a", Some("elsewhere")),
            event(5, "a", None),
            event(6, "b", Some("other")),
        ];
        let deferred = deferred_by_stream_change(&events, "outbox:{aggregate_type}");
        let mut deferred: Vec<i64> = deferred.into_iter().collect();
        deferred.sort_unstable();
        // Event 5 goes to the run's key again, but after a cut its aggregate waits.
        assert_eq!(deferred, [4, 5]);
    }

    #[test]
    fn a_round_reads_the_flagged_shards_it_kept_and_every_shard_it_took() {
        // Held 0-3, of which 0 and 1 were flagged (only held shards' flags are taken). Now 2-5.
        let held_before = 0b0000_1111;
        let flagged_before = 0b0000_0011;
        let mine = 0b0011_1100;
        let (read, given_back) = shards_to_read(held_before, flagged_before, mine);
        // Kept and flagged: none (1 was given up); newly taken: 4 and 5.
        assert_eq!(read, 0b0011_0000);
        // Shards 0 and 1 were given up: their flags (0 and 1) go back for their new holder.
        assert_eq!(given_back, 0b0000_0011);
        // Kept and flagged: read; kept and not flagged: not read.
        assert_eq!(shards_to_read(0b0110, 0b0100, 0b0110), (0b0100, 0));
    }

    #[test]
    fn the_last_part_of_a_window_in_parts_sends_the_relay_straight_back() {
        let going_on = ShardClaim { bounded: false, in_parts: true, idle_long: false };
        // The last part: the window's end is stored, and more may have been committed after it
        // (a window begun at a recorded snapshot), which a kept claim would not read.
        let last = AfterRead::of(&going_on, &ShardRead { events: true, complete: true, reached: false });
        assert_eq!(last, AfterRead { advance: true, more: true });
        // A part before the last stores its position and says more.
        let middle = AfterRead::of(&going_on, &ShardRead { events: true, complete: false, reached: true });
        assert_eq!(middle, AfterRead { advance: true, more: true });
        // A window that fits, read whole: nothing more from this shard.
        let whole = ShardClaim { bounded: false, in_parts: false, idle_long: false };
        let read = AfterRead::of(&whole, &ShardRead { events: true, complete: true, reached: false });
        assert_eq!(read, AfterRead { advance: true, more: false });
        // A lagging shard steps over an empty window to its recorded snapshot.
        let lagging = ShardClaim { bounded: true, in_parts: false, idle_long: false };
        let empty = AfterRead::of(&lagging, &ShardRead { events: false, complete: true, reached: false });
        assert_eq!(empty, AfterRead { advance: true, more: false });
        // An idle shard's cursor moves only now and then.
        let idle = AfterRead::of(&whole, &ShardRead { events: false, complete: true, reached: false });
        assert_eq!(idle, AfterRead { advance: false, more: false });
    }

    #[test]
    fn lagging_shards_take_turns_at_the_rounds_allowance() {
        // Windows of shards 0-15, those of 2 and 9 published in parts; the last round's allowance
        // did not reach shard 12.
        let mut shards: Vec<(i16, bool)> = (0..16).map(|shard| (shard, shard == 2 || shard == 9)).collect();
        shards.sort_by_key(|&(shard, in_parts)| allowance_order(shard, in_parts, 12));
        let order: Vec<i16> = shards.iter().map(|&(shard, _)| shard).collect();
        assert_eq!(order, [12, 13, 14, 15, 0, 1, 3, 4, 5, 6, 7, 8, 10, 11, 2, 9]);
        // A relay's first round starts from shard 0.
        shards.sort_by_key(|&(shard, in_parts)| allowance_order(shard, in_parts, 0));
        assert_eq!(shards[0], (0, false));
        assert_eq!(shards[14], (2, true));
    }

    #[test]
    fn aggregates_are_listed_once_in_order_of_appearance() {
        let events = vec![event(1, "b", None), event(2, "a", None), event(3, "b", None)];
        assert_eq!(distinct_aggregates(&events), [("acct".to_string(), "b".to_string()), ("acct".into(), "a".into())]);
    }

    #[test]
    fn a_pipeline_stops_at_its_entry_and_byte_limits_and_sets_waiting_events_aside() {
        let mut big = event(2, "b", None);
        big.payload = "x".repeat(5000);
        let events = vec![event(1, "a", None), big, event(3, "c", None), event(4, "a", None), event(5, "d", None)];
        let mut pending = events.into_iter().map(|e| (Source::Log, e)).peekable();
        let ids = |events: &[OutboxEvent]| events.iter().map(|e| e.id).collect::<Vec<_>>();
        // 4000 bytes: the big event does not fit behind the first one.
        let limits = PipelineLimits { entries: 10, bytes: 4000 };
        let (_, first, waiting) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!((ids(&first), ids(&waiting)), (vec![1], vec![]));
        // Alone, it goes anyway.
        let (_, second, _) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!(ids(&second), [2]);
        // Events of a waiting aggregate are set aside; the entry limit counts sent events only.
        let limits = PipelineLimits { entries: 1, bytes: 4000 };
        let (_, third, waiting) = next_pipeline(&mut pending, limits, |_, e| e.aggregate_id == "c");
        assert_eq!((ids(&third), ids(&waiting)), (vec![4], vec![3]));
        let (_, fourth, _) = next_pipeline(&mut pending, limits, |_, _| false);
        assert_eq!(ids(&fourth), [5]);
        assert!(next_pipeline(&mut pending, limits, |_, _| false).1.is_empty());
    }
}
