//! Pin and failover history: an append-only log with monotonic ids, capped
//! in memory (oldest dropped) and mirrored to the store when there is one.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::store::Store;

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
    CapacityWarning,
    CapacityCleared,
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
}

pub struct EventLog {
    next_id: AtomicU64,
    ring: RwLock<VecDeque<Event>>,
    cap: usize,
    store: Option<Arc<dyn Store>>,
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
    pub fn new(cap: usize, store: Option<Arc<dyn Store>>, restored: Vec<Event>) -> EventLog {
        let next = restored.iter().map(|e| e.id + 1).max().unwrap_or(1);
        let mut ring: VecDeque<Event> = restored.into();
        while ring.len() > cap {
            ring.pop_front();
        }
        EventLog { next_id: AtomicU64::new(next), ring: RwLock::new(ring), cap: cap.max(1), store }
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
            id: self.next_id.fetch_add(1, Ordering::AcqRel),
            at: humantime::format_rfc3339_millis(now).to_string(),
            at_ms: crate::clock::unix_ms(now),
            kind,
            replica: replica.map(str::to_owned),
            to_replica: to_replica.map(str::to_owned),
            detail: detail.into(),
        };
        tracing::info!(target: "prefixgate::events", id = event.id, kind = ?kind, replica, to_replica, detail = %event.detail, "event");
        let mut ring = self.ring.write().expect("events lock");
        ring.push_back(event.clone());
        let mut dropped = None;
        while ring.len() > self.cap {
            dropped = ring.pop_front().map(|e| e.id);
        }
        drop(ring);
        if let Some(store) = &self.store {
            if let Err(e) = store.append_event(&event, dropped) {
                tracing::warn!("could not persist event {}: {e}", event.id);
            }
        }
        event
    }

    /// Newest first.
    pub fn query(&self, f: &EventFilter) -> Vec<Event> {
        let ring = self.ring.read().expect("events lock");
        ring.iter()
            .rev()
            .filter(|e| f.before_id.is_none_or(|b| e.id < b))
            .filter(|e| f.kind.is_none_or(|k| e.kind == k))
            .filter(|e| {
                f.replica
                    .as_deref()
                    .is_none_or(|r| e.replica.as_deref() == Some(r) || e.to_replica.as_deref() == Some(r))
            })
            .take_while(|e| f.since_ms.is_none_or(|s| e.at_ms >= s))
            .take(f.limit)
            .cloned()
            .collect()
    }

    pub fn count(&self, kind: EventKind) -> usize {
        self.ring.read().expect("events lock").iter().filter(|e| e.kind == kind).count()
    }
}
