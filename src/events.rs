//! Pin and failover history: an append-only log with monotonic ids, capped
//! in memory (oldest dropped) and mirrored to the store behind the requests.
//!
//! Why a backlog: events are recorded from the request path (failovers, pin
//! moves); a synchronous store write there put disk latency into a client's
//! response. `record` only appends to the ring and to the backlog of events
//! not yet written, which the store's `EventWriter` writes in batches with
//! the pins (and shutdown last), so history is as durable as pins are.
//!
//! The backlog is bounded (`history.max_unwritten`): while a shared store
//! is down for long, the oldest unwritten events are dropped and counted
//! (`prefixgate_events_unwritten_dropped_total`), instead of a queue that
//! grows with the outage. The in-memory history keeps them all (its own cap).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Failover,
    ReplicaDown,
    ReplicaUp,
    PinMoved,
    DrainStarted,
    DrainCompleted,
    Resumed,
    Disabled,
    Enabled,
    ReplicaAdded,
    ReplicaRemoved,
    ReplicaUpdated,
    PolicyChanged,
    /// An operator deleted pins (one, or all of a replica's).
    PinsDeleted,
    CapacityWarning,
    CapacityCleared,
    /// The (shared) store stopped answering; routing goes on from memory.
    StoreUnreachable,
    /// The store answers again; queued writes went through.
    StoreReachable,
    /// A discovery source listed a new replica.
    ReplicaDiscovered,
    /// A discovered replica left its source: it drains, then is removed.
    ReplicaLeftSource,
    /// A discovered replica came back to its source under the same name.
    ReplicaReturned,
    /// A discovery source failed (DNS down, unreadable or malformed file):
    /// the last good answer stands.
    DiscoveryFailed,
    /// A discovery source answers again.
    DiscoveryRecovered,
    /// An answer that would remove too many of a source's replicas at once
    /// was held until seen twice.
    DiscoveryHeld,
    /// A new session waited for room at the KV wall, then was placed.
    SessionHeld,
    /// A new session waited `sessions.max_wait_ms` without room and was
    /// admitted anyway, over capacity (or was larger than any replica).
    SessionOverCapacity,
    /// A resident session's turn waited at its boundary: its replica's
    /// sessions outgrew its KV and it was the first to give way there (the
    /// lowest class, the client with the most sessions, the youngest), or a
    /// higher class had taken its room.
    SessionPaused,
    /// A resident session's room went, between its turns, to a waiting
    /// session of a higher class (`priority.preempt`): its next turn waits
    /// for room.
    SessionPreempted,
    /// A pinned turn's receipt showed its replica lost the session's prefix:
    /// the replica takes no new session above the load it was lost at.
    KvWallSeen,
    /// No lost prefix confirmed a replica's wall for ten minutes: it was
    /// forgotten, and new sessions are admitted up to its capacity again.
    KvWallForgotten,
    /// A stream broke after its first byte (its replica died, stalled or
    /// was drained with hand-over) and went on on another replica: from,
    /// to, the seam's token count, exact or not, why.
    StreamContinued,
    /// A stream broke after its first byte and could not go on (the
    /// detail says why): the client's stream ended broken.
    StreamNotContinued,
}

impl std::str::FromStr for EventKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        serde_json::from_value(serde_json::Value::String(s.to_string()))
            .map_err(|_| format!("unknown event kind '{s}'"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// Monotonic: later events have larger ids, also across restarts.
    pub id: u64,
    /// RFC 3339 timestamp.
    pub at: String,
    pub at_ms: u64,
    pub kind: EventKind,
    /// The replica concerned (for failovers and pin moves: where from).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// For failovers and pin moves: where to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_replica: Option<String>,
    pub detail: String,
    /// The gateway instance that recorded it (several instances sharing a store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The trace of the request or admin action that caused it (32 hex
    /// digits), when tracing is on: the UI links the event to its trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl EventKind {
    /// Every kind, in the order the API documents them.
    pub const ALL: [EventKind; 18] = [
        EventKind::Failover,
        EventKind::ReplicaDown,
        EventKind::ReplicaUp,
        EventKind::PinMoved,
        EventKind::DrainStarted,
        EventKind::DrainCompleted,
        EventKind::Resumed,
        EventKind::Disabled,
        EventKind::Enabled,
        EventKind::ReplicaAdded,
        EventKind::ReplicaRemoved,
        EventKind::ReplicaUpdated,
        EventKind::PolicyChanged,
        EventKind::PinsDeleted,
        EventKind::CapacityWarning,
        EventKind::CapacityCleared,
        EventKind::StoreUnreachable,
        EventKind::StoreReachable,
    ];
}

/// An event as the history keeps it: 48 bytes and one allocation holding
/// its strings (instance, replica, to-replica, trace id, detail), its
/// timestamp text made again from `at_ms` when read. Why: replica churn
/// fills the history (two events per name a pod comes back under), and a
/// full `Event` with its five strings took ~300 bytes; at the default 100,000
/// events that was 30 MB held by history alone (docs/reliability.md).
#[derive(Debug, Clone)]
struct Kept {
    id: u64,
    at_ms: u64,
    text: Box<str>,
    /// Byte lengths of instance, replica, to-replica and trace id in
    /// `text`; the detail is the rest. `u16::MAX`: absent.
    lens: [u16; 4],
    kind: EventKind,
}

const ABSENT: u16 = u16::MAX;

impl Kept {
    fn of(e: &Event) -> Kept {
        // Names are slugs of at most 64 bytes and instance names short: a
        // longer one (never seen) is cut to what the length can say.
        let parts = [e.instance.as_deref(), e.replica.as_deref(), e.to_replica.as_deref(), e.trace_id.as_deref()]
            .map(|p| p.map(|s| &s[..s.floor_char_boundary(usize::from(ABSENT - 1))]));
        let mut text = String::with_capacity(parts.iter().flatten().map(|s| s.len()).sum::<usize>() + e.detail.len());
        let lens = parts.map(|p| match p {
            Some(s) => {
                text.push_str(s);
                s.len() as u16
            }
            None => ABSENT,
        });
        text.push_str(&e.detail);
        Kept { id: e.id, at_ms: e.at_ms, text: text.into_boxed_str(), lens, kind: e.kind }
    }

    /// The strings: instance, replica, to-replica, trace id, detail.
    fn parts(&self) -> ([Option<&str>; 4], &str) {
        let mut at = 0;
        let parts = self.lens.map(|len| {
            if len == ABSENT {
                return None;
            }
            let s = &self.text[at..at + usize::from(len)];
            at += usize::from(len);
            Some(s)
        });
        (parts, &self.text[at..])
    }

    fn names(&self, replica: &str) -> bool {
        let ([_, from, to, _], _) = self.parts();
        from == Some(replica) || to == Some(replica)
    }

    fn event(&self) -> Event {
        let ([instance, replica, to_replica, trace_id], detail) = self.parts();
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.at_ms);
        Event {
            id: self.id,
            at: humantime::format_rfc3339_millis(at).to_string(),
            at_ms: self.at_ms,
            kind: self.kind,
            replica: replica.map(str::to_owned),
            to_replica: to_replica.map(str::to_owned),
            detail: detail.to_owned(),
            instance: instance.map(str::to_owned),
            trace_id: trace_id.map(str::to_owned),
        }
    }
}

/// An event on its way to the store.
#[derive(Debug, Clone)]
pub struct Pending {
    pub event: Event,
    /// The id up to which older persisted events fell out of the ring (the
    /// store trims them with this write).
    pub dropped_upto: Option<u64>,
}

pub struct EventLog {
    next_id: AtomicU64,
    ring: RwLock<VecDeque<Kept>>,
    cap: usize,
    unwritten: Arc<Backlog>,
    /// With a shared store: this instance's name (on each event) and its
    /// share of the id space (see `next_id`).
    instance: Option<(String, u64)>,
}

/// Events recorded and not yet written, oldest first, at most `cap`.
struct Backlog {
    queue: Mutex<VecDeque<Pending>>,
    cap: usize,
    /// Events dropped unwritten (the backlog was full), over the process's life.
    dropped: AtomicU64,
}

impl Backlog {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Pending>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the oldest past the cap, counted.
    fn trim(&self, queue: &mut VecDeque<Pending>) {
        while queue.len() > self.cap {
            queue.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The writer's end of the backlog: taken by the store's `EventWriter`
/// (`store/event_writer.rs`), which this module knows nothing of.
pub struct RecordedEvents(Arc<Backlog>);

impl RecordedEvents {
    /// Takes up to `max` of the oldest unwritten events, in order.
    pub fn take(&self, max: usize) -> Vec<Pending> {
        let mut queue = self.0.lock();
        let n = queue.len().min(max);
        queue.drain(..n).collect()
    }

    /// Puts back a batch whose write failed, ahead of what came since; past
    /// the cap, the oldest go (counted).
    pub fn put_back(&self, batch: Vec<Pending>) {
        let mut queue = self.0.lock();
        for p in batch.into_iter().rev() {
            queue.push_front(p);
        }
        self.0.trim(&mut queue);
    }

    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Filters for `query`.
#[derive(Debug, Default, Clone)]
pub struct EventFilter {
    pub kind: Option<EventKind>,
    pub replica: Option<String>,
    pub since_ms: Option<u64>,
    /// Only events with an id below this (paging backwards from newest).
    pub before_id: Option<u64>,
    pub limit: usize,
}

impl EventLog {
    /// `instance`: this gateway's name in a shared store (None: the only one).
    /// `max_unwritten`: the backlog's bound (see the module's comment).
    pub fn new(
        cap: usize,
        max_unwritten: usize,
        instance: Option<&str>,
        restored: Vec<Event>,
    ) -> (EventLog, RecordedEvents) {
        let next = restored.iter().map(|e| e.id + 1).max().unwrap_or(1);
        let mut ring: VecDeque<Kept> = restored.iter().map(Kept::of).collect();
        while ring.len() > cap {
            ring.pop_front();
        }
        let unwritten =
            Arc::new(Backlog { queue: Mutex::default(), cap: max_unwritten.max(1), dropped: AtomicU64::new(0) });
        let instance = instance.map(|name| (name.to_string(), xxhash_rust::xxh3::xxh3_64(name.as_bytes()) & 31));
        let log = EventLog {
            next_id: AtomicU64::new(next),
            ring: RwLock::new(ring),
            cap: cap.max(1),
            unwritten: unwritten.clone(),
            instance,
        };
        (log, RecordedEvents(unwritten))
    }

    /// Events dropped before they were written (the backlog was full).
    pub fn unwritten_dropped(&self) -> u64 {
        self.unwritten.dropped.load(Ordering::Relaxed)
    }

    /// The next event id. With one instance, a counter. With several sharing
    /// a store, ids must not collide and must still grow with time across
    /// instances: `unix_ms << 11 | instance_tag << 6 | n`, at most 64 per
    /// millisecond per instance (more borrow the next millisecond), under
    /// 2^53 so JavaScript reads them exactly. Two instances whose names
    /// hash to the same 5-bit tag could collide within one millisecond.
    fn next_id(&self, now_ms: u64) -> u64 {
        match &self.instance {
            None => self.next_id.fetch_add(1, Ordering::AcqRel),
            Some((_, tag)) => {
                let floor = (now_ms << 11) | (tag << 6);
                let mut cur = self.next_id.load(Ordering::Acquire);
                loop {
                    let ours = (cur >> 6) & 31 == *tag;
                    let next = if cur >= floor && ours && (cur & 63) < 63 {
                        cur + 1 // the next in this millisecond's run
                    } else {
                        // Our slot in this millisecond, or in the one after the last id seen.
                        floor.max((((cur >> 11) + 1) << 11) | (tag << 6))
                    };
                    match self.next_id.compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => return next,
                        Err(actual) => cur = actual,
                    }
                }
            }
        }
    }

    /// An event another instance recorded (already in the shared store).
    pub fn insert_remote(&self, event: Event) {
        let mut ring = self.ring.write().expect("events lock");
        // Keep the ring in id order: remote events may arrive a little late.
        let at = ring.iter().rposition(|e| e.id < event.id).map_or(0, |i| i + 1);
        if ring.get(at).is_some_and(|e| e.id == event.id) {
            return;
        }
        ring.insert(at, Kept::of(&event));
        while ring.len() > self.cap {
            ring.pop_front();
        }
    }

    pub fn record(
        &self,
        kind: EventKind,
        replica: Option<&str>,
        to_replica: Option<&str>,
        detail: impl Into<String>,
    ) -> Event {
        let now = std::time::SystemTime::now();
        let event = Event {
            id: self.next_id(crate::clock::unix_ms(now)),
            instance: self.instance.as_ref().map(|(name, _)| name.clone()),
            at: humantime::format_rfc3339_millis(now).to_string(),
            at_ms: crate::clock::unix_ms(now),
            kind,
            replica: replica.map(str::to_owned),
            to_replica: to_replica.map(str::to_owned),
            detail: detail.into(),
            trace_id: crate::telemetry::current_trace_id().map(|t| t.to_string()),
        };
        tracing::info!(target: "prefixgate::events", id = event.id, kind = ?kind, replica, to_replica, detail = %event.detail, "event");
        let mut ring = self.ring.write().expect("events lock");
        ring.push_back(Kept::of(&event));
        let mut dropped = None;
        while ring.len() > self.cap {
            dropped = ring.pop_front().map(|e| e.id);
        }
        drop(ring);
        let mut unwritten = self.unwritten.lock();
        unwritten.push_back(Pending { event: event.clone(), dropped_upto: dropped });
        self.unwritten.trim(&mut unwritten);
        event
    }

    /// Newest first.
    pub fn query(&self, f: &EventFilter) -> Vec<Event> {
        let ring = self.ring.read().expect("events lock");
        ring.iter()
            .rev()
            .filter(|e| f.before_id.is_none_or(|b| e.id < b))
            .filter(|e| f.kind.is_none_or(|k| e.kind == k))
            .filter(|e| f.replica.as_deref().is_none_or(|r| e.names(r)))
            .take_while(|e| f.since_ms.is_none_or(|s| e.at_ms >= s))
            .take(f.limit)
            .map(Kept::event)
            .collect()
    }

    pub fn count(&self, kind: EventKind) -> usize {
        self.ring.read().expect("events lock").iter().filter(|e| e.kind == kind).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_store_ids_grow_with_time_and_never_repeat() {
        let (mut log, _w) = EventLog::new(10, 10, None, Vec::new());
        log.instance = Some(("gw-1".into(), 5));
        let mut last = 0;
        for i in 0..200u64 {
            // 200 ids within two milliseconds: runs of 64 borrow later milliseconds.
            let id = log.next_id(1_000 + i / 100);
            assert!(id > last, "{id} after {last}");
            assert_eq!((id >> 6) & 31, 5, "the instance's tag");
            last = id;
        }
        assert!(log.next_id(5_000) >= 5_000 << 11, "a later millisecond starts a later run");
        assert!(last < 1 << 53);
    }

    #[test]
    fn the_unwritten_backlog_is_bounded_and_drops_the_oldest_counted() {
        let (log, unwritten) = EventLog::new(100, 10, None, Vec::new());
        for i in 0..15 {
            log.record(EventKind::ReplicaUp, Some("a"), None, format!("{i}"));
        }
        assert_eq!((unwritten.len(), log.unwritten_dropped()), (10, 5));
        let batch = unwritten.take(4);
        assert_eq!(batch[0].event.detail, "5", "the oldest kept");
        log.record(EventKind::ReplicaUp, Some("a"), None, "15");
        // A failed write goes back ahead of what came since; past the cap, the oldest go.
        unwritten.put_back(batch);
        assert_eq!((unwritten.len(), log.unwritten_dropped()), (10, 6));
        let all = unwritten.take(100);
        assert_eq!(all.first().unwrap().event.detail, "6");
        assert_eq!(all.last().unwrap().event.detail, "15");
        assert_eq!(log.query(&EventFilter { limit: 100, ..Default::default() }).len(), 16, "history keeps them all");
    }

    #[test]
    fn the_history_keeps_events_compactly_and_gives_them_back_whole() {
        assert_eq!(std::mem::size_of::<Kept>(), 48);
        let (log, _) = EventLog::new(10, 10, None, Vec::new());
        let local = log.record(EventKind::Failover, Some("gpu-0"), Some("gpu-1"), "connection refusé");
        let remote = Event {
            id: local.id + 1,
            at: humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_234))
                .to_string(),
            at_ms: 1_234,
            kind: EventKind::ReplicaAdded,
            replica: Some("gpu-2".into()),
            to_replica: None,
            detail: String::new(),
            instance: Some("gw-b".into()),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
        };
        log.insert_remote(remote.clone());
        let back = log.query(&EventFilter { limit: 10, ..Default::default() });
        assert_eq!(back, vec![remote, local]);
        let only = log.query(&EventFilter { limit: 10, replica: Some("gpu-1".into()), ..Default::default() });
        assert_eq!(only.len(), 1, "to_replica matches the filter");
    }
}
