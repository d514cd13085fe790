//! The capacity wall, made visible. A running sequence and its cached prefix
//! draw on the same per-card KV pool; when the conversations a card must keep
//! warm do not fit, they evict each other and every turn re-prefills, and no
//! placement fixes that. This module estimates each replica's working set,
//! compares it with KV capacity, and says so in plain words.
//!
//! Working set of a replica = for each conversation family active within the
//! window (a family that came back for a second turn, or is running now) the
//! largest estimated context it holds there, plus running requests that
//! belong to no such family. KV capacity comes from the replica's vLLM
//! metrics (`vllm:cache_config_info`: num_gpu_blocks x block_size) when it
//! exposes them, else from the declared `kv_tokens`; the source is reported.
//!
//! Token estimates start at 4 bytes per token and are calibrated per replica
//! from the `usage.prompt_tokens` that replicas report.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::events::EventKind;
use crate::gateway::Gateway;
use crate::metrics::replica_label;
use crate::pins::Pin;
use crate::policy::PrefixKey;
use crate::tokens::BYTES_PER_TOKEN;

/// Calibration keeps this much of each new sample (an exponential average).
const CALIBRATION_WEIGHT: f64 = 0.2;

#[derive(Debug, Clone)]
struct ReplicaFacts {
    bytes_per_token: f64,
    samples: u64,
    metrics_kv_tokens: Option<u64>,
    warned: bool,
}

impl Default for ReplicaFacts {
    fn default() -> Self {
        ReplicaFacts { bytes_per_token: BYTES_PER_TOKEN as f64, samples: 0, metrics_kv_tokens: None, warned: false }
    }
}

#[derive(Debug, Clone, Copy)]
struct RunningRequest {
    family: Option<PrefixKey>,
    tokens: u64,
}

/// (working set tokens, KV capacity tokens) from the last report.
type LastFigures = (u64, Option<u64>);

#[derive(Default)]
pub struct CapacityTracker {
    facts: Mutex<HashMap<Arc<str>, ReplicaFacts>>,
    running: Mutex<HashMap<u64, (Arc<str>, RunningRequest)>>,
    next_ticket: AtomicU64,
    aggregate_warned: Mutex<bool>,
    /// The last report's (working set, capacity) per replica, for replica views.
    last: Mutex<HashMap<Arc<str>, LastFigures>>,
}

/// What `view` of one replica needs.
pub struct ReplicaFigures {
    pub kv_tokens: Option<u64>,
    pub bytes_per_token: f64,
    pub working_set_tokens: u64,
}

/// Registered while a request runs; unregisters on drop.
pub struct RunningTicket {
    tracker: Arc<Gateway>,
    id: u64,
}

impl Drop for RunningTicket {
    fn drop(&mut self) {
        self.tracker.capacity.running.lock().expect("lock").remove(&self.id);
    }
}

impl CapacityTracker {
    pub fn bytes_per_token(&self, replica: &str) -> f64 {
        self.facts.lock().expect("lock").get(replica).map_or(BYTES_PER_TOKEN as f64, |f| f.bytes_per_token)
    }

    /// Estimated tokens of `bytes` of prompt on `replica`.
    pub fn estimate(&self, replica: &str, bytes: usize) -> u64 {
        (bytes as f64 / self.bytes_per_token(replica)).ceil() as u64
    }

    /// Feeds one measured (bytes, prompt_tokens) pair into the replica's ratio.
    pub fn calibrate(&self, replica: &Arc<str>, prompt_bytes: usize, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = (prompt_bytes as f64 / prompt_tokens as f64).clamp(0.5, 16.0);
        let mut facts = self.facts.lock().expect("lock");
        let f = facts.entry(replica.clone()).or_default();
        f.bytes_per_token = if f.samples == 0 {
            sample
        } else {
            f.bytes_per_token * (1.0 - CALIBRATION_WEIGHT) + sample * CALIBRATION_WEIGHT
        };
        f.samples += 1;
    }

    pub fn set_metrics_kv(&self, replica: &Arc<str>, kv_tokens: Option<u64>) {
        self.facts.lock().expect("lock").entry(replica.clone()).or_default().metrics_kv_tokens = kv_tokens;
    }

    pub fn begin(gw: &Arc<Gateway>, replica: &Arc<str>, family: Option<PrefixKey>, tokens: u64) -> RunningTicket {
        let id = gw.capacity.next_ticket.fetch_add(1, Ordering::Relaxed);
        gw.capacity.running.lock().expect("lock").insert(id, (replica.clone(), RunningRequest { family, tokens }));
        RunningTicket { tracker: gw.clone(), id }
    }

    pub fn replica(&self, id: &str) -> ReplicaFigures {
        let facts = self.facts.lock().expect("lock").get(id).cloned().unwrap_or_default();
        let last = self.last.lock().expect("lock").get(id).copied();
        ReplicaFigures {
            kv_tokens: last.and_then(|l| l.1),
            bytes_per_token: facts.bytes_per_token,
            working_set_tokens: last.map_or(0, |l| l.0),
        }
    }
}

/// Where a replica's KV capacity figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum KvSource {
    /// Read from the replica's vLLM metrics (wins over a declared value).
    Metrics,
    /// Declared in the config or through the API (`kv_tokens`).
    Declared,
    Unknown,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ReplicaCapacity {
    pub replica: String,
    pub kv_tokens: Option<u64>,
    pub kv_source: KvSource,
    pub working_set_tokens: u64,
    pub families_active: usize,
    pub running_requests: usize,
    pub bytes_per_token: f64,
    /// True when the working set exceeds KV capacity.
    pub over_capacity: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AggregateCapacity {
    pub working_set_tokens: u64,
    /// Sum over replicas with a known capacity.
    pub kv_tokens: u64,
    pub families_active: usize,
    pub over_capacity: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Ok,
    /// At least one replica's working set exceeds its KV capacity.
    OverCapacity,
    /// No replica's capacity is known.
    Unknown,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CapacityReport {
    pub window_secs: u64,
    pub replicas: Vec<ReplicaCapacity>,
    pub aggregate: AggregateCapacity,
    pub verdict: Verdict,
    /// Plain words for operators when over capacity: what is happening and the levers.
    pub warning: Option<String>,
}

/// Inputs for one replica, gathered by `assess`'s caller.
pub struct ReplicaInput<'a> {
    pub id: &'a str,
    pub declared_kv: Option<u64>,
    pub metrics_kv: Option<u64>,
    pub bytes_per_token: f64,
}

/// The pure part: working sets and the verdict from pins and running requests.
fn compute(
    window_secs: u64,
    replicas: &[ReplicaInput],
    pins: &[Pin],
    running: &[(Arc<str>, RunningRequest)],
) -> CapacityReport {
    let mut out = Vec::new();
    let mut all_families = HashSet::new();
    for r in replicas {
        // family -> largest context held on this replica
        let mut families: HashMap<PrefixKey, u64> = HashMap::new();
        let running_here: Vec<&RunningRequest> =
            running.iter().filter(|(id, _)| &**id == r.id).map(|(_, q)| q).collect();
        let running_families: HashSet<PrefixKey> = running_here.iter().filter_map(|q| q.family).collect();
        for p in pins.iter().filter(|p| &*p.replica == r.id && (p.turns >= 2 || running_families.contains(&p.family))) {
            let e = families.entry(p.family).or_default();
            *e = (*e).max(p.est_tokens);
        }
        let mut loose = 0;
        for q in &running_here {
            match q.family {
                Some(f) => {
                    let e = families.entry(f).or_default();
                    *e = (*e).max(q.tokens);
                }
                None => loose += q.tokens,
            }
        }
        all_families.extend(families.keys().copied());
        let working_set_tokens = families.values().sum::<u64>() + loose;
        let (kv_tokens, kv_source) = match (r.metrics_kv, r.declared_kv) {
            (Some(m), _) => (Some(m), KvSource::Metrics),
            (None, Some(d)) => (Some(d), KvSource::Declared),
            (None, None) => (None, KvSource::Unknown),
        };
        out.push(ReplicaCapacity {
            replica: r.id.to_string(),
            kv_tokens,
            kv_source,
            working_set_tokens,
            families_active: families.len(),
            running_requests: running_here.len(),
            bytes_per_token: r.bytes_per_token,
            over_capacity: kv_tokens.is_some_and(|kv| working_set_tokens > kv),
        });
    }
    let known: Vec<&ReplicaCapacity> = out.iter().filter(|r| r.kv_tokens.is_some()).collect();
    let aggregate = AggregateCapacity {
        working_set_tokens: out.iter().map(|r| r.working_set_tokens).sum(),
        kv_tokens: known.iter().filter_map(|r| r.kv_tokens).sum(),
        families_active: all_families.len(),
        over_capacity: !known.is_empty()
            && known.iter().map(|r| r.working_set_tokens).sum::<u64>() > known.iter().filter_map(|r| r.kv_tokens).sum(),
    };
    let over: Vec<&ReplicaCapacity> = out.iter().filter(|r| r.over_capacity).collect();
    let verdict = if !over.is_empty() || aggregate.over_capacity {
        Verdict::OverCapacity
    } else if known.is_empty() {
        Verdict::Unknown
    } else {
        Verdict::Ok
    };
    let warning = (verdict == Verdict::OverCapacity).then(|| {
        let detail = over
            .iter()
            .map(|r| format!("{} needs ~{} tokens of KV but holds {}", r.replica, r.working_set_tokens, r.kv_tokens.unwrap_or(0)))
            .collect::<Vec<_>>()
            .join("; ");
        format!(
            "Over KV capacity: {}{}. The conversations active on a card do not fit in its KV cache together, so they evict \
             each other and turns re-prefill from scratch. Routing cannot fix this: a running sequence and its cached prefix \
             share the same pool. The levers are capacity (another card), fewer concurrent large contexts (admission limits, \
             or client-side context compaction), or a platform with more KV per card.",
            if detail.is_empty() { "the fleet as a whole".to_string() } else { detail },
            if aggregate.over_capacity { " (the sum over all cards is over too)" } else { "" }
        )
    });
    CapacityReport { window_secs, replicas: out, aggregate, verdict, warning }
}

/// Computes the current report from the gateway's state.
pub fn report(gw: &Gateway) -> CapacityReport {
    let window = gw.config.admission.working_set_window_secs;
    let since = crate::clock::now_ms().saturating_sub(window * 1000);
    let pins = gw.pins.conversations_active_since(since);
    let running: Vec<(Arc<str>, RunningRequest)> =
        gw.capacity.running.lock().expect("lock").values().cloned().collect();
    let facts = gw.capacity.facts.lock().expect("lock").clone();
    let fleet = gw.fleet.snapshot();
    let specs: Vec<_> = fleet.iter().map(|r| (r.id.clone(), r.spec())).collect();
    let inputs: Vec<ReplicaInput> = specs
        .iter()
        .map(|(id, spec)| {
            let f = facts.get(id).cloned().unwrap_or_default();
            ReplicaInput {
                id,
                declared_kv: spec.kv_tokens,
                metrics_kv: f.metrics_kv_tokens,
                bytes_per_token: f.bytes_per_token,
            }
        })
        .collect();
    let report = compute(window, &inputs, &pins, &running);
    let mut last = gw.capacity.last.lock().expect("lock");
    last.clear();
    for r in &report.replicas {
        last.insert(Arc::from(r.replica.as_str()), (r.working_set_tokens, r.kv_tokens));
    }
    report
}

/// Re-evaluates the verdict; records an event and a log line once per
/// transition (per replica, and for the fleet as a whole).
pub fn evaluate(gw: &Gateway) -> CapacityReport {
    let report = report(gw);
    let mut facts = gw.capacity.facts.lock().expect("lock");
    for r in &report.replicas {
        let f = facts.entry(Arc::from(r.replica.as_str())).or_default();
        if f.warned != r.over_capacity {
            f.warned = r.over_capacity;
            let detail =
                format!("working set ~{} tokens vs KV {} tokens", r.working_set_tokens, r.kv_tokens.unwrap_or(0));
            if r.over_capacity {
                tracing::warn!(replica = %r.replica, "capacity warning: {detail}; routing cannot fix this (see /admin/v1/capacity)");
                gw.events.record(EventKind::CapacityWarning, Some(&r.replica), None, detail);
            } else {
                tracing::info!(replica = %r.replica, "capacity warning cleared: {detail}");
                gw.events.record(EventKind::CapacityCleared, Some(&r.replica), None, detail);
            }
        }
    }
    drop(facts);
    let mut agg = gw.capacity.aggregate_warned.lock().expect("lock");
    if *agg != report.aggregate.over_capacity {
        *agg = report.aggregate.over_capacity;
        let detail = format!(
            "fleet working set ~{} tokens vs aggregate KV {} tokens",
            report.aggregate.working_set_tokens, report.aggregate.kv_tokens
        );
        let kind = if *agg { EventKind::CapacityWarning } else { EventKind::CapacityCleared };
        tracing::warn!("{detail}");
        gw.events.record(kind, None, None, detail);
    }
    report
}

/// Sets the gauges that mirror fleet and capacity state (called at scrape).
pub fn refresh_gauges(gw: &Gateway) {
    let report = report(gw);
    let m = &gw.metrics;
    for family in [
        &m.inflight,
        &m.large_inflight,
        &m.pins,
        &m.replica_up,
        &m.admission_queue_depth,
        &m.working_set_tokens,
        &m.kv_capacity_tokens,
        &m.capacity_warning,
    ] {
        family.clear();
    }
    m.bytes_per_token.clear();
    let pins = gw.pins.count_by_replica();
    for r in gw.fleet.snapshot().iter() {
        let l = replica_label(&r.id);
        m.inflight.get_or_create(&l).set(r.inflight());
        m.large_inflight.get_or_create(&l).set(r.large_inflight());
        m.pins.get_or_create(&l).set(pins.get(&r.id).copied().unwrap_or(0) as i64);
        m.replica_up.get_or_create(&l).set(i64::from(r.routable()));
        m.admission_queue_depth.get_or_create(&l).set(gw.admission.queued(&r.id) as i64);
        m.bytes_per_token.get_or_create(&l).set(gw.capacity.bytes_per_token(&r.id));
        // Counters a dashboard divides by: present from the start, at zero.
        m.admission_waits.get_or_create(&l).inc_by(0);
        m.admission_rejections.get_or_create(&l).inc_by(0);
    }
    for r in &report.replicas {
        let l = replica_label(&r.replica);
        m.working_set_tokens.get_or_create(&l).set(r.working_set_tokens as i64);
        m.kv_capacity_tokens.get_or_create(&l).set(r.kv_tokens.unwrap_or(0) as i64);
        m.capacity_warning.get_or_create(&l).set(i64::from(r.over_capacity));
    }
    m.capacity_warning.get_or_create(&replica_label("_aggregate")).set(i64::from(report.aggregate.over_capacity));
}

/// Parses `vllm:cache_config_info{...num_gpu_blocks="N",block_size="B"...}` from a metrics page.
pub fn kv_tokens_from_vllm_metrics(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let label = |name: &str| -> Option<u64> {
        let start = line.find(&format!("{name}=\""))? + name.len() + 2;
        line[start..].split('"').next()?.parse().ok()
    };
    Some(label("num_gpu_blocks")? * label("block_size")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(replica: &str, family: u128, turns: u32, tokens: u64) -> Pin {
        Pin { replica: replica.into(), created_ms: 0, last_used_ms: 0, turns, est_tokens: tokens, family }
    }

    fn input(id: &str, kv: u64) -> ReplicaInput<'_> {
        ReplicaInput { id, declared_kv: Some(kv), metrics_kv: None, bytes_per_token: 4.0 }
    }

    #[test]
    fn three_large_families_on_two_cards_is_over_capacity_on_the_shared_card() {
        // The seed's wall: 50-80k-token families, 122,636 KV tokens per card.
        let pins = vec![pin("a", 1, 3, 80_000), pin("a", 1, 2, 70_000), pin("b", 2, 3, 60_000), pin("a", 3, 2, 50_000)];
        let r = compute(300, &[input("a", 122_636), input("b", 122_636)], &pins, &[]);
        assert_eq!(r.verdict, Verdict::OverCapacity);
        assert_eq!(r.replicas[0].working_set_tokens, 130_000);
        assert_eq!(r.replicas[0].families_active, 2);
        assert!(!r.replicas[1].over_capacity);
        assert!(r.warning.unwrap().contains("Routing cannot fix this"));
    }

    #[test]
    fn one_shot_pins_do_not_count_but_running_requests_do() {
        let pins = vec![pin("a", 1, 1, 100_000)];
        let r = compute(300, &[input("a", 122_636)], &pins, &[]);
        assert_eq!((r.replicas[0].working_set_tokens, r.verdict), (0, Verdict::Ok));
        let running = vec![
            (Arc::from("a"), RunningRequest { family: Some(1), tokens: 110_000 }),
            (Arc::from("a"), RunningRequest { family: None, tokens: 20_000 }),
        ];
        let r = compute(300, &[input("a", 122_636)], &pins, &running);
        assert_eq!(r.replicas[0].working_set_tokens, 130_000);
        assert_eq!(r.verdict, Verdict::OverCapacity);
    }

    #[test]
    fn metrics_capacity_wins_over_declared_and_unknown_is_unknown() {
        let mut i = input("a", 1_000);
        i.metrics_kv = Some(5_000);
        let r = compute(300, &[i], &[], &[]);
        assert_eq!((r.replicas[0].kv_tokens, r.replicas[0].kv_source), (Some(5_000), KvSource::Metrics));
        let r = compute(
            300,
            &[ReplicaInput { id: "a", declared_kv: None, metrics_kv: None, bytes_per_token: 4.0 }],
            &[],
            &[],
        );
        assert_eq!(r.verdict, Verdict::Unknown);
    }

    #[test]
    fn parses_vllm_cache_config_info() {
        let text =
            "# HELP x\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"7664\"} 1.0\n";
        assert_eq!(kv_tokens_from_vllm_metrics(text), Some(122_624));
        assert_eq!(kv_tokens_from_vllm_metrics("vllm:num_requests_running 1"), None);
    }

    #[test]
    fn calibration_moves_toward_measured_ratio() {
        let t = CapacityTracker::default();
        let id: Arc<str> = Arc::from("a");
        assert_eq!(t.bytes_per_token("a"), 4.0);
        t.calibrate(&id, 3_000, 1_000);
        assert_eq!(t.bytes_per_token("a"), 3.0);
        t.calibrate(&id, 5_000, 1_000);
        assert!((t.bytes_per_token("a") - 3.4).abs() < 1e-9);
        assert_eq!(t.estimate("a", 340), 100);
    }
}
