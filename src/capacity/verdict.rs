//! The verdict, pure: working sets against KV capacity, per replica and for
//! the fleet, from the active families and the running requests.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::running::RunningRequest;
use crate::policy::PrefixKey;

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
    /// Sessions resident here now (`sessions/`: first turn until idle).
    #[serde(default)]
    pub resident_sessions: usize,
    /// What they count for against the room, tokens: each at the larger of
    /// its context now and what it was projected to grow to.
    #[serde(default)]
    pub resident_tokens: u64,
    /// KV room left for new sessions in tokens (negative: over); absent
    /// when the capacity is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room_tokens: Option<i64>,
    /// What it holds as learned, tokens: its wall once one was seen, else
    /// the declared capacity (`kv_tokens`) raised to the most that
    /// returning sessions found kept. Absent: nothing declared or learned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learned_tokens: Option<u64>,
    /// The receipts behind it.
    #[serde(default)]
    pub evidence: super::Learned,
    /// The engine's prefill rate here, tokens a second: uncached prompt
    /// tokens over the engine's time to their first events, queues left
    /// out, smoothed (a pause is bounded by it, and a turn moves by it).
    /// Absent: not measured yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_s: Option<f64>,
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
    /// New sessions held at the KV wall (filled by the admin API).
    #[serde(default)]
    pub sessions: SessionQueue,
    /// Whether tenants share pins and prefix caches (`identity.scope`,
    /// `identity.cache_salt`; filled by the admin API).
    #[serde(default)]
    pub tenancy: crate::policy::tenancy::Tenancy,
}

/// The queue of new sessions waiting for room, and how their waits went.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct SessionQueue {
    /// Waiting now.
    pub held: usize,
    /// `sessions.max_held`.
    pub max_held: usize,
    /// `sessions.max_wait_ms` (0: the hold is off).
    pub max_wait_ms: u64,
    /// `sessions.idle_ms`.
    pub idle_ms: u64,
    /// Sessions that waited, since start: placed, and admitted over capacity.
    pub waited: u64,
    pub over_capacity: u64,
    /// Mean and longest wait, in ms.
    pub mean_wait_ms: u64,
    pub max_wait_seen_ms: u64,
    /// What a new session with no first link of its own is projected to
    /// grow to, tokens: the upper quartile of the peaks of the sessions
    /// that ended here (absent: nothing learned yet; sessions are then
    /// admitted at their first turn's size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projected_tokens: Option<u64>,
    /// Sessions whose peak the projections learned from (the latest 64).
    #[serde(default)]
    pub projections_learned: usize,
    /// First links (system prompt, instructions, tools) with a projection of their own.
    #[serde(default)]
    pub projection_links: usize,
    /// Waiting now, by priority class.
    #[serde(default)]
    pub held_by_class: HeldByClass,
    /// Turns of resident sessions paused now (their replica crossed, or
    /// their room taken by a higher class).
    #[serde(default)]
    pub paused_turns: usize,
    /// The sessions waiting, in the order they go: by class, then turns
    /// between clients, then arrival.
    #[serde(default)]
    pub queue: Vec<QueuedSession>,
}

/// Sessions waiting, by priority class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HeldByClass {
    pub interactive: usize,
    pub default: usize,
    pub background: usize,
}

/// One session waiting for room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct QueuedSession {
    pub class: crate::priority::Class,
    /// Its client: an API key's hash (`key-...`), an `x-prefixgate-client`
    /// name, or `anonymous`.
    pub client: String,
    /// Its estimated footprint, tokens.
    pub tokens: u64,
    pub waited_ms: u64,
}

/// What the verdict needs to know of one replica, gathered by the caller
/// (`Fleet::capacity_inputs`): this module reads no fleet of its own.
#[derive(Debug, Clone)]
pub struct ReplicaInput {
    pub id: Arc<str>,
    pub declared_kv: Option<u64>,
    pub metrics_kv: Option<u64>,
    pub bytes_per_token: f64,
}

/// The pure part: working sets and the verdict from the active families
/// (replica, family, largest context) and the running requests.
pub(super) fn compute(
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
            running.iter().filter(|(id, _)| **id == *r.id).map(|(_, q)| q).collect();
        for (_, family, tokens) in families_active.iter().filter(|(id, _, _)| **id == *r.id) {
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
            resident_sessions: 0,
            resident_tokens: 0,
            room_tokens: None,
            learned_tokens: None,
            evidence: Default::default(),
            prefill_tokens_per_s: None,
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
    CapacityReport {
        window_secs,
        replicas: out,
        aggregate,
        verdict,
        warning,
        sessions: SessionQueue::default(),
        tenancy: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fam(replica: &str, family: u128, tokens: u64) -> (Arc<str>, PrefixKey, u64) {
        (Arc::from(replica), family, tokens)
    }

    fn input(id: &str, kv: u64) -> ReplicaInput {
        ReplicaInput { id: Arc::from(id), declared_kv: Some(kv), metrics_kv: None, bytes_per_token: 4.0 }
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
            &[ReplicaInput { id: Arc::from("a"), declared_kv: None, metrics_kv: None, bytes_per_token: 4.0 }],
            &[],
            &[],
        );
        assert_eq!(r.verdict, Verdict::Unknown);
    }
}
