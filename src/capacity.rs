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
//! Why incremental: the pin table holds up to millions of one-shot pins, and
//! scanning it every second under its locks stalled the request path. The
//! families that matter are told to us as they are served (`touch_family`),
//! so a report costs O(active families), not O(pins).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::events::{EventKind, EventLog};
use crate::fleet::Fleet;
use crate::pins::Pin;
use crate::policy::PrefixKey;
use crate::tokens::Calibration;

#[derive(Debug, Clone, Copy)]
pub struct RunningRequest {
    pub family: Option<PrefixKey>,
    pub tokens: u64,
}

/// Requests running now, with the context they occupy. Each worker
/// registers its requests in a shard of its own (`worker`, taken once when
/// the worker starts): a request's begin and end touch only memory its
/// worker owns (one shared map moved its lock and table between the cores on
/// every request). Readers (once a second, and heartbeats) walk every shard;
/// a shard whose worker and tickets are gone drops out.
#[derive(Default)]
pub struct RunningRequests {
    shards: Mutex<Vec<Weak<RunningShard>>>,
}

/// One worker's shard of the running requests.
pub struct RunningWorker(Arc<RunningShard>);

#[derive(Default)]
struct RunningShard {
    map: Mutex<ShardMap>,
}

#[derive(Default)]
struct ShardMap {
    running: foldhash::HashMap<u64, (Arc<str>, RunningRequest)>,
    next_ticket: u64,
}

/// Registered while a request runs; unregisters on drop, however the request ends.
pub struct RunningTicket {
    shard: Arc<RunningShard>,
    id: u64,
}

impl Drop for RunningTicket {
    fn drop(&mut self) {
        self.shard.map.lock().expect("lock").running.remove(&self.id);
    }
}

impl RunningWorker {
    pub fn begin(&self, replica: &Arc<str>, family: Option<PrefixKey>, tokens: u64) -> RunningTicket {
        let id = {
            let mut map = self.0.map.lock().expect("lock");
            map.next_ticket += 1;
            let id = map.next_ticket;
            map.running.insert(id, (replica.clone(), RunningRequest { family, tokens }));
            id
        };
        RunningTicket { shard: self.0.clone(), id }
    }
}

impl RunningRequests {
    /// A shard for one worker, taken once; a ticket keeps its shard counted
    /// until the ticket drops, whoever began it.
    pub fn worker(&self) -> RunningWorker {
        let shard = Arc::new(RunningShard::default());
        let mut shards = self.shards.lock().expect("lock");
        shards.retain(|s| s.strong_count() > 0);
        shards.push(Arc::downgrade(&shard));
        RunningWorker(shard)
    }

    fn snapshot(&self) -> Vec<(Arc<str>, RunningRequest)> {
        let shards: Vec<Arc<RunningShard>> =
            self.shards.lock().expect("lock").iter().filter_map(Weak::upgrade).collect();
        shards.iter().flat_map(|s| s.map.lock().expect("lock").running.values().cloned().collect::<Vec<_>>()).collect()
    }

    /// Requests running now per replica: (count, estimated tokens), for this
    /// instance's heartbeat.
    pub fn totals(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        let mut out = std::collections::BTreeMap::new();
        for (replica, q) in self.snapshot() {
            let e: &mut (u64, u64) = out.entry(replica.to_string()).or_default();
            e.0 += 1;
            e.1 += q.tokens;
        }
        out
    }
}

/// A family's largest context on one replica, and when it was last served.
#[derive(Debug, Clone, Copy)]
struct FamilyUse {
    tokens: u64,
    last_used_ms: u64,
}

/// The families served per replica. Keyed by replica first so that a
/// returning family (every request of a conversation) is found by the name
/// it is given: the shared name is cloned only for a replica's first family.
#[derive(Default)]
struct Families(foldhash::HashMap<Arc<str>, foldhash::HashMap<PrefixKey, FamilyUse>>);

impl Families {
    fn on(&mut self, replica: &Arc<str>) -> &mut foldhash::HashMap<PrefixKey, FamilyUse> {
        if !self.0.contains_key(replica) {
            self.0.insert(replica.clone(), foldhash::HashMap::default());
        }
        self.0.get_mut(replica).expect("inserted above")
    }

    fn active(&self, since_ms: u64) -> Vec<(Arc<str>, PrefixKey, u64)> {
        let mut out = Vec::new();
        for (r, fs) in &self.0 {
            let live = fs.iter().filter(|(_, u)| u.last_used_ms >= since_ms);
            out.extend(live.map(|(f, u)| (r.clone(), *f, u.tokens)));
        }
        out
    }

    fn forget_before(&mut self, since_ms: u64) {
        for fs in self.0.values_mut() {
            fs.retain(|_, u| u.last_used_ms >= since_ms);
        }
        self.0.retain(|_, fs| !fs.is_empty());
    }
}

/// (working set tokens, KV capacity tokens) from the last evaluation.
type LastFigures = (u64, Option<u64>);

#[derive(Default)]
struct Warnings {
    replicas: HashMap<Arc<str>, bool>,
    aggregate: bool,
}

pub struct Capacity {
    pub running: Arc<RunningRequests>,
    /// Requests other gateway instances run, per replica: (count, tokens),
    /// from their heartbeats (a shared store), so the verdict covers the fleet.
    elsewhere: Mutex<HashMap<String, (u64, u64)>>,
    window_ms: u64,
    families: Mutex<Families>,
    metrics_kv: Mutex<HashMap<Arc<str>, u64>>,
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
            window_ms: window_secs.saturating_mul(1000),
            families: Mutex::default(),
            metrics_kv: Mutex::default(),
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
        let mut families = self.families.lock().expect("lock");
        let window = self.window_ms;
        let e = families.on(replica).entry(family).or_insert(FamilyUse { tokens: 0, last_used_ms: now_ms });
        if now_ms.saturating_sub(e.last_used_ms) > window {
            e.tokens = 0; // expired: its old size says nothing any more
        }
        e.tokens = e.tokens.max(tokens);
        e.last_used_ms = e.last_used_ms.max(now_ms);
    }

    /// What the other live instances run now (from their heartbeats).
    pub fn set_running_elsewhere(&self, totals: HashMap<String, (u64, u64)>) {
        *self.elsewhere.lock().expect("lock") = totals;
    }

    /// The conversation left `replica` (its pin moved): it no longer lives there.
    pub fn family_moved(&self, family: PrefixKey, from: &str) {
        if let Some(on) = self.families.lock().expect("lock").0.get_mut(from) {
            on.remove(&family);
        }
    }

    /// Families the working set holds on `replica` (for tests).
    #[cfg(test)]
    pub fn families_on(&self, replica: &str) -> usize {
        self.families.lock().expect("lock").0.get(replica).map_or(0, |f| f.len())
    }

    pub fn forget_replica(&self, replica: &str) {
        self.families.lock().expect("lock").0.remove(replica);
    }

    pub fn set_metrics_kv(&self, replica: &Arc<str>, kv_tokens: Option<u64>) {
        let mut map = self.metrics_kv.lock().expect("lock");
        match kv_tokens {
            Some(kv) => map.insert(replica.clone(), kv),
            None => map.remove(replica),
        };
    }

    /// The figures of the last evaluation (the background task runs one a second).
    pub fn replica(&self, id: &str) -> ReplicaFigures {
        let last = self.last.lock().expect("lock").get(id).copied();
        ReplicaFigures { kv_tokens: last.and_then(|l| l.1), working_set_tokens: last.map_or(0, |l| l.0) }
    }

    /// The current report. Reads only: a GET may call it.
    pub fn report(&self, fleet: &Fleet, calibration: &Calibration, now_ms: u64) -> CapacityReport {
        let since = now_ms.saturating_sub(self.window_ms);
        let families = self.families.lock().expect("lock").active(since);
        let mut running = self.running.snapshot();
        for (replica, (count, tokens)) in self.elsewhere.lock().expect("lock").iter() {
            // Another instance's requests: counted, their tokens spread evenly (no families known).
            let each = tokens / (*count).max(1);
            let id: Arc<str> = Arc::from(replica.as_str());
            running.extend((0..*count).map(|_| (id.clone(), RunningRequest { family: None, tokens: each })));
        }
        let metrics_kv = self.metrics_kv.lock().expect("lock").clone();
        let fleet = fleet.snapshot();
        let specs: Vec<_> = fleet.iter().map(|r| (r.id.clone(), r.spec())).collect();
        let inputs: Vec<ReplicaInput> = specs
            .iter()
            .map(|(id, spec)| ReplicaInput {
                id,
                declared_kv: spec.kv_tokens,
                metrics_kv: metrics_kv.get(id).copied(),
                bytes_per_token: calibration.bytes_per_token(id),
            })
            .collect();
        compute(self.window_secs(), &inputs, &families, &running)
    }

    /// Re-evaluates the verdict (the background task, once a second): keeps
    /// the figures replica views show, forgets expired families, and records
    /// an event and a log line once per transition (per replica, and for the
    /// fleet as a whole).
    pub fn evaluate(&self, fleet: &Fleet, calibration: &Calibration, events: &EventLog, now_ms: u64) -> CapacityReport {
        let since = now_ms.saturating_sub(self.window_ms);
        self.families.lock().expect("lock").forget_before(since);
        let report = self.report(fleet, calibration, now_ms);
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

/// The pure part: working sets and the verdict from the active families
/// (replica, family, largest context) and the running requests.
fn compute(
    window_secs: u64,
    replicas: &[ReplicaInput],
    families_active: &[(Arc<str>, PrefixKey, u64)],
    running: &[(Arc<str>, RunningRequest)],
) -> CapacityReport {
    let mut out = Vec::new();
    let mut all_families = HashSet::new();
    for r in replicas {
        // family -> largest context held on this replica
        let mut families: HashMap<PrefixKey, u64> = HashMap::new();
        let running_here: Vec<&RunningRequest> =
            running.iter().filter(|(id, _)| &**id == r.id).map(|(_, q)| q).collect();
        for (_, family, tokens) in families_active.iter().filter(|(id, _, _)| &**id == r.id) {
            let e = families.entry(*family).or_default();
            *e = (*e).max(*tokens);
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

    #[test]
    fn running_requests_count_across_worker_shards_and_a_gone_workers_shard_drops_out() {
        let running = RunningRequests::default();
        let a: Arc<str> = Arc::from("a");
        let (w1, w2) = (running.worker(), running.worker());
        let t1 = w1.begin(&a, None, 100);
        let t2 = w2.begin(&a, Some(7), 50);
        let t3 = w2.begin(&a, None, 25);
        assert_eq!(running.totals().get("a"), Some(&(3, 175)));
        drop(t2);
        assert_eq!(running.totals().get("a"), Some(&(2, 125)));
        // A worker that ends keeps its shard while its tickets run...
        drop(w2);
        assert_eq!(running.totals().get("a"), Some(&(2, 125)));
        drop(t3);
        assert_eq!(running.totals().get("a"), Some(&(1, 100)));
        // ...and then the shard is gone from the list.
        let _w3 = running.worker();
        assert_eq!(running.shards.lock().unwrap().len(), 2, "w1's shard and w3's");
        drop((t1, w1));
        assert!(running.totals().is_empty());
    }

    fn fam(replica: &str, family: u128, tokens: u64) -> (Arc<str>, PrefixKey, u64) {
        (Arc::from(replica), family, tokens)
    }

    fn input(id: &str, kv: u64) -> ReplicaInput<'_> {
        ReplicaInput { id, declared_kv: Some(kv), metrics_kv: None, bytes_per_token: 4.0 }
    }

    #[test]
    fn three_large_families_on_two_cards_is_over_capacity_on_the_shared_card() {
        // The seed's wall: 50-80k-token families, 122,636 KV tokens per card.
        let families = vec![fam("a", 1, 80_000), fam("b", 2, 60_000), fam("a", 3, 50_000)];
        let r = compute(300, &[input("a", 122_636), input("b", 122_636)], &families, &[]);
        assert_eq!(r.verdict, Verdict::OverCapacity);
        assert_eq!(r.replicas[0].working_set_tokens, 130_000);
        assert_eq!(r.replicas[0].families_active, 2);
        assert!(!r.replicas[1].over_capacity);
        assert!(r.warning.unwrap().contains("Routing cannot fix this"));
    }

    #[test]
    fn running_requests_count_with_their_family_or_on_their_own() {
        let r = compute(300, &[input("a", 122_636)], &[], &[]);
        assert_eq!((r.replicas[0].working_set_tokens, r.verdict), (0, Verdict::Ok));
        let running = vec![
            (Arc::from("a"), RunningRequest { family: Some(1), tokens: 110_000 }),
            (Arc::from("a"), RunningRequest { family: None, tokens: 20_000 }),
        ];
        let r = compute(300, &[input("a", 122_636)], &[fam("a", 1, 100_000)], &running);
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
    fn the_working_set_follows_families_as_they_are_served_move_and_expire() {
        let c = Capacity::new(300);
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        c.touch_family(&a, 1, 50_000, 1_000);
        c.touch_family(&a, 1, 60_000, 2_000);
        c.touch_family(&a, 2, 10_000, 2_000);
        let active = |c: &Capacity, now: u64| {
            let since = now.saturating_sub(c.window_ms);
            let mut v: Vec<_> =
                c.families.lock().unwrap().active(since).into_iter().map(|(r, f, t)| (r.to_string(), f, t)).collect();
            v.sort();
            v
        };
        assert_eq!(active(&c, 3_000), vec![("a".into(), 1, 60_000), ("a".into(), 2, 10_000)]);
        c.family_moved(1, "a");
        c.touch_family(&b, 1, 70_000, 3_000);
        assert_eq!(active(&c, 3_000), vec![("a".into(), 2, 10_000), ("b".into(), 1, 70_000)]);
        // Past the window, family 2 no longer counts.
        assert_eq!(active(&c, 2_000 + 300_001), vec![("b".into(), 1, 70_000)]);
        c.forget_replica("b");
        assert!(active(&c, 3_000).iter().all(|(r, _, _)| r != "b"));
    }

    #[test]
    fn parses_vllm_cache_config_info() {
        let text =
            "# HELP x\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"7664\"} 1.0\n";
        assert_eq!(kv_tokens_from_vllm_metrics(text), Some(122_624));
        assert_eq!(kv_tokens_from_vllm_metrics("vllm:num_requests_running 1"), None);
    }
}
