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
//! Two parts, one file each: the running requests (`running.rs`, a shard
//! per worker) and the verdict (`verdict.rs`, pure). This file ties them
//! together and records transitions. The working set is not kept here: it
//! is read from the one record of where conversations live, each
//! replica's `fleet::residents::Residents` (the sessions the hold counts,
//! and those that came back and idled out within the window), gathered by
//! `Fleet::capacity_inputs`. What is kept per replica here (last figures,
//! warning, what other instances run there) is a `CapacityRecord` on the
//! replica's own record (`fleet::Replica::capacity`), so it leaves with the
//! replica. Nothing here takes a lock both workers share on every request.
//!
//! Why not scan the pins: the pin table holds up to millions of one-shot
//! pins, and scanning it every second under its locks stalled the request
//! path. The conversations that matter are told to the residents as they
//! are served, so a report costs O(active conversations), not O(pins).

mod running;
mod verdict;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use running::{RunningRequest, RunningRequests, RunningTicket, RunningWorker};
use verdict::compute;
pub use verdict::{
    AggregateCapacity, CapacityReport, HeldByClass, KvSource, QueuedSession, ReplicaCapacity, ReplicaInput,
    SessionQueue, Verdict,
};

use crate::events::{EventKind, EventLog};
use crate::policy::PrefixKey;

/// What the capacity module keeps about one replica, on the replica's record.
#[derive(Debug, Default)]
pub struct CapacityRecord {
    /// (working set tokens, KV capacity tokens) from the last evaluation.
    last: Mutex<Option<(u64, Option<u64>)>>,
    /// Whether its capacity warning is raised (an event per transition).
    warned: AtomicBool,
    /// Requests other gateway instances run here: count and tokens, from
    /// their heartbeats (a shared store), so the verdict covers the fleet.
    elsewhere_count: AtomicU64,
    elsewhere_tokens: AtomicU64,
}

impl CapacityRecord {
    /// The figures of the last evaluation (the background task runs one a second).
    pub fn figures(&self) -> ReplicaFigures {
        let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        ReplicaFigures { kv_tokens: last.and_then(|l| l.1), working_set_tokens: last.map_or(0, |l| l.0) }
    }

    /// What the other live instances run here now (from their heartbeats).
    pub fn set_running_elsewhere(&self, (count, tokens): (u64, u64)) {
        self.elsewhere_count.store(count, Ordering::Relaxed);
        self.elsewhere_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Forgets the last figures and the warning (the replica's pins were
    /// deleted: the next evaluation starts it afresh).
    pub fn forget(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.warned.store(false, Ordering::Relaxed);
    }
}

/// One replica as the capacity module sees it: what the verdict reads, and
/// the record kept on the replica (`Fleet::capacity_inputs` gathers them).
#[derive(Debug, Clone)]
pub struct Tracked {
    pub input: ReplicaInput,
    pub record: Arc<CapacityRecord>,
    /// Its working set: (conversation, largest context) of each that came
    /// back there, resident now or ended within the window.
    pub working_set: Vec<(PrefixKey, u64)>,
}

pub struct Capacity {
    pub running: Arc<RunningRequests>,
    window_ms: u64,
    /// Whether the fleet-wide warning is raised.
    aggregate_warned: AtomicBool,
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
            window_ms: window_secs.saturating_mul(1000),
            aggregate_warned: AtomicBool::new(false),
        }
    }

    pub fn window_secs(&self) -> u64 {
        self.window_ms / 1000
    }

    /// Where the working set's window starts at `now_ms`: what
    /// `Fleet::capacity_inputs` is asked for.
    pub fn since_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.window_ms)
    }

    /// The current report. Reads only: a GET may call it.
    pub fn report(&self, replicas: &[Tracked]) -> CapacityReport {
        let mut families = Vec::new();
        let mut running = self.running.snapshot();
        for Tracked { input, record, working_set } in replicas {
            families.extend(working_set.iter().map(|(f, t)| (input.id.clone(), *f, *t)));
            // Another instance's requests: counted, their tokens spread evenly (no families known).
            let count = record.elsewhere_count.load(Ordering::Relaxed);
            let each = record.elsewhere_tokens.load(Ordering::Relaxed) / count.max(1);
            running.extend((0..count).map(|_| (input.id.clone(), RunningRequest { family: None, tokens: each })));
        }
        let inputs: Vec<ReplicaInput> = replicas.iter().map(|t| t.input.clone()).collect();
        compute(self.window_secs(), &inputs, &families, &running)
    }

    /// Re-evaluates the verdict (the background task, once a second): keeps
    /// the figures replica views show, and records
    /// an event and a log line once per transition (per replica, and for the
    /// fleet as a whole).
    pub fn evaluate(&self, replicas: &[Tracked], events: &EventLog) -> CapacityReport {
        let report = self.report(replicas);
        let records: HashMap<&str, &CapacityRecord> =
            replicas.iter().map(|t| (&*t.input.id, t.record.as_ref())).collect();
        for r in &report.replicas {
            let Some(record) = records.get(r.replica.as_str()) else { continue };
            *record.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((r.working_set_tokens, r.kv_tokens));
            if record.warned.swap(r.over_capacity, Ordering::Relaxed) != r.over_capacity {
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
        let over = report.aggregate.over_capacity;
        if self.aggregate_warned.swap(over, Ordering::Relaxed) != over {
            let detail = format!(
                "fleet working set ~{} tokens vs aggregate KV {} tokens",
                report.aggregate.working_set_tokens, report.aggregate.kv_tokens
            );
            let kind = if over { EventKind::CapacityWarning } else { EventKind::CapacityCleared };
            tracing::warn!("{detail}");
            events.record(kind, None, None, detail);
        }
        report
    }
}

/// What a replica's receipts say of what it keeps (`fleet::wall::WallEvidence::learned`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Learned {
    /// Where it lost a returning session's prefix (or its engine
    /// preempted, or said its pool was full), tokens resident; absent: no
    /// wall seen, and nothing waits for room there (`sessions.wall = "learned"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_tokens: Option<u64>,
    /// How many sessions it held at that wall: one fewer than were
    /// resident when a prefix was lost (at least one), or as many as a
    /// kept receipt above it found. On slots (llama.cpp) the wall the hold
    /// uses is this many whole slots, the unit the room counts in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_sessions: Option<u64>,
    /// The most tokens resident when a returning session still found its
    /// prefix: it keeps at least this much (more than its slot or pool,
    /// where the engine keeps prompts in host memory).
    pub kept_at_tokens: u64,
    /// The most sessions a returning session's prefix was kept across:
    /// itself and the other sessions whose turns ran there in its gap. On
    /// slots the kept side of the capacity is this many whole slots, as
    /// the wall is.
    #[serde(default)]
    pub kept_sessions: u64,
    /// Receipts read: prefixes found, prefixes lost.
    pub receipts_kept: u64,
    pub receipts_lost: u64,
}

impl Learned {
    /// The wall in the unit the room counts (`sessions::room::footprint`):
    /// tokens on a pool; on slots of `slot_tokens`, the slots its sessions
    /// held there. Why not the tokens on slots: sessions shorter than a
    /// slot still take a whole one, so three sessions lost on two slots at
    /// 7,700 tokens set a wall below one slot, and every new session was
    /// held as larger than the replica (one session where two were kept:
    /// docs/benchmarks-log.md, real agent traffic). The loss itself is still judged
    /// in tokens (`fleet::wall::WallEvidence::receipt`).
    pub fn wall(&self, slot_tokens: Option<u64>) -> Option<u64> {
        match (slot_tokens, self.wall_sessions) {
            (Some(slot), Some(sessions)) if slot > 0 => self.wall_tokens.map(|_| sessions * slot),
            _ => self.wall_tokens,
        }
    }

    /// What the replica holds as learned, starting from `declared`: the
    /// most it was seen to keep (the declared capacity, raised by kept
    /// receipts), and no more than where it was seen to lose a prefix
    /// (`wall`). On slots of `slot_tokens` both sides count whole slots:
    /// the sessions kept across each other's turns, the sessions held at
    /// the wall. Why not the kept tokens there: five sessions of 3,000
    /// tokens kept on 8,192-token slots (a host tier) are 15,000 tokens
    /// but five slots of room, and the tokens would cap the room at one.
    /// Why the lower of the two: a loss is read at the load resident when
    /// it was found, which can be above what the replica keeps.
    pub fn capacity(&self, declared: Option<u64>, slot_tokens: Option<u64>) -> Option<u64> {
        let kept_at = match slot_tokens {
            Some(slot) if slot > 0 => self.kept_sessions.saturating_mul(slot),
            _ => self.kept_at_tokens,
        };
        let kept = Some(declared.map_or(kept_at, |d| d.max(kept_at))).filter(|k| *k > 0);
        match (self.wall(slot_tokens), kept) {
            (Some(wall), Some(kept)) => Some(wall.min(kept)),
            (wall, kept) => wall.or(kept),
        }
    }
}
