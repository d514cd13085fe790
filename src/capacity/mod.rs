//! The capacity wall, made visible. A running sequence and its cached prefix
//! draw on the same per-card KV pool; when the conversations a card must keep
//! warm do not fit, they evict each other and every turn re-prefills, and no
//! placement fixes that. This module keeps each replica's working set,
//! compares it with KV capacity, and says so in plain words.
//!
//! Working set of a replica = for each conversation family active within the
//! window (a family that came back for a second turn, or is running now) the
//! largest estimated context it holds there, plus running requests that
//! belong to no such family. KV capacity comes from the replica's vLLM
//! metrics (`vllm:cache_config_info`: num_gpu_blocks x block_size) when it
//! exposes them, else from the declared `kv_tokens`; the source is reported.
//!
//! Three parts, one file each: the running requests (`running.rs`, a shard
//! per worker), the working set of returning conversations
//! (`working_set.rs`, sharded by family), and the verdict (`verdict.rs`,
//! pure). This file ties them together and records transitions. Nothing here
//! takes a lock both workers share on every request.
//!
//! Why incremental: the pin table holds up to millions of one-shot pins, and
//! scanning it every second under its locks stalled the request path. The
//! families that matter are told to us as they are served (`touch_family`),
//! so a report costs O(active families), not O(pins).

mod running;
mod verdict;
mod working_set;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use running::{RunningRequest, RunningRequests, RunningTicket, RunningWorker};
use verdict::compute;
pub use verdict::{AggregateCapacity, CapacityReport, KvSource, ReplicaCapacity, ReplicaInput, SessionQueue, Verdict};
use working_set::WorkingSet;

use crate::events::{EventKind, EventLog};
use crate::pins::Pin;
use crate::policy::PrefixKey;

/// (working set tokens, KV capacity tokens) from the last evaluation.
type LastFigures = (u64, Option<u64>);

#[derive(Default)]
struct Warnings {
    replicas: HashMap<Arc<str>, bool>,
    aggregate: bool,
}

pub struct Capacity {
    pub running: Arc<RunningRequests>,
    working_set: WorkingSet,
    /// Requests other gateway instances run, per replica: (count, tokens),
    /// from their heartbeats (a shared store), so the verdict covers the fleet.
    elsewhere: Mutex<HashMap<String, (u64, u64)>>,
    window_ms: u64,
    warnings: Mutex<Warnings>,
    last: Mutex<HashMap<Arc<str>, LastFigures>>,
}

/// What the replica view needs of one replica.
pub struct ReplicaFigures {
    pub kv_tokens: Option<u64>,
    pub working_set_tokens: u64,
}

impl Capacity {
    pub fn new(window_secs: u64) -> Capacity {
        Capacity {
            running: Arc::default(),
            elsewhere: Mutex::default(),
            working_set: WorkingSet::new(window_secs.saturating_mul(1000)),
            window_ms: window_secs.saturating_mul(1000),
            warnings: Mutex::default(),
            last: Mutex::default(),
        }
    }

    pub fn window_secs(&self) -> u64 {
        self.window_ms / 1000
    }

    /// Seeds the working set from restored pins (startup only).
    pub fn seed(&self, pins: &[Pin]) {
        for p in pins {
            self.touch_family(&p.replica, p.family, p.est_tokens, p.last_used_ms);
        }
    }

    /// A returning conversation (second turn or later) was served on `replica`.
    pub fn touch_family(&self, replica: &Arc<str>, family: PrefixKey, tokens: u64, now_ms: u64) {
        self.working_set.touch(replica, family, tokens, now_ms);
    }

    /// What the other live instances run now (from their heartbeats).
    pub fn set_running_elsewhere(&self, totals: HashMap<String, (u64, u64)>) {
        *self.elsewhere.lock().expect("lock") = totals;
    }

    /// The conversation left `replica` (its pin moved): it no longer lives there.
    pub fn family_moved(&self, family: PrefixKey, from: &str) {
        self.working_set.moved(family, from);
    }

    /// Families the working set holds on `replica` (for tests).
    #[cfg(test)]
    pub fn families_on(&self, replica: &str) -> usize {
        self.working_set.families_on(replica)
    }

    /// Forgets what is kept about `replica`: its working set, its last
    /// figures and its warning state (it left the fleet, or its pins were
    /// deleted; the next evaluation starts it afresh).
    pub fn forget_replica(&self, replica: &str) {
        self.working_set.forget_replica(replica);
        self.last.lock().expect("lock").remove(replica);
        self.warnings.lock().expect("lock").replicas.remove(replica);
    }

    /// Replicas with a warning state kept (for the churn test).
    pub fn replicas_tracked(&self) -> usize {
        self.warnings.lock().expect("lock").replicas.len() + self.working_set.replicas()
    }

    /// The figures of the last evaluation (the background task runs one a second).
    pub fn replica(&self, id: &str) -> ReplicaFigures {
        let last = self.last.lock().expect("lock").get(id).copied();
        ReplicaFigures { kv_tokens: last.and_then(|l| l.1), working_set_tokens: last.map_or(0, |l| l.0) }
    }

    /// The current report. Reads only: a GET may call it.
    pub fn report(&self, replicas: &[ReplicaInput], now_ms: u64) -> CapacityReport {
        let since = now_ms.saturating_sub(self.window_ms);
        let families = self.working_set.active(since);
        let mut running = self.running.snapshot();
        for (replica, (count, tokens)) in self.elsewhere.lock().expect("lock").iter() {
            // Another instance's requests: counted, their tokens spread evenly (no families known).
            let each = tokens / (*count).max(1);
            let id: Arc<str> = Arc::from(replica.as_str());
            running.extend((0..*count).map(|_| (id.clone(), RunningRequest { family: None, tokens: each })));
        }
        compute(self.window_secs(), replicas, &families, &running)
    }

    /// Re-evaluates the verdict (the background task, once a second): keeps
    /// the figures replica views show, forgets expired families, and records
    /// an event and a log line once per transition (per replica, and for the
    /// fleet as a whole).
    pub fn evaluate(&self, replicas: &[ReplicaInput], events: &EventLog, now_ms: u64) -> CapacityReport {
        let since = now_ms.saturating_sub(self.window_ms);
        self.working_set.forget_before(since);
        let report = self.report(replicas, now_ms);
        {
            let mut last = self.last.lock().expect("lock");
            last.clear();
            for r in &report.replicas {
                last.insert(Arc::from(r.replica.as_str()), (r.working_set_tokens, r.kv_tokens));
            }
        }
        let mut warnings = self.warnings.lock().expect("lock");
        for r in &report.replicas {
            let warned = warnings.replicas.entry(Arc::from(r.replica.as_str())).or_default();
            if *warned != r.over_capacity {
                *warned = r.over_capacity;
                let detail =
                    format!("working set ~{} tokens vs KV {} tokens", r.working_set_tokens, r.kv_tokens.unwrap_or(0));
                if r.over_capacity {
                    tracing::warn!(replica = %r.replica, "capacity warning: {detail}; routing cannot fix this (see /admin/v1/capacity)");
                    events.record(EventKind::CapacityWarning, Some(&r.replica), None, detail);
                } else {
                    tracing::info!(replica = %r.replica, "capacity warning cleared: {detail}");
                    events.record(EventKind::CapacityCleared, Some(&r.replica), None, detail);
                }
            }
        }
        if warnings.aggregate != report.aggregate.over_capacity {
            warnings.aggregate = report.aggregate.over_capacity;
            let detail = format!(
                "fleet working set ~{} tokens vs aggregate KV {} tokens",
                report.aggregate.working_set_tokens, report.aggregate.kv_tokens
            );
            let kind = if warnings.aggregate { EventKind::CapacityWarning } else { EventKind::CapacityCleared };
            tracing::warn!("{detail}");
            events.record(kind, None, None, detail);
        }
        report
    }
}
