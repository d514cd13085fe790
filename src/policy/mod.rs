//! The routing policy: a request's shape and the replicas' routable states in,
//! a decision out. No I/O, no clock, no async, no storage: every rule here is
//! testable by calling a function.
//!
//! The rule (from the field's measurements): a *continuation* (a request with
//! history whose prefix was served before) goes back to the replica that
//! holds that prefix in its KV cache; anything else is spread with a counter,
//! so cold prefills run on all cards at once. A hash would send every member
//! of a batch that shares a system prompt to one card.

mod chain;
mod chat;
mod completions;
pub mod conversation;
pub mod identity;
mod json;
mod messages;
mod responses;
mod stream;
pub mod tenancy;

use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicU64, Ordering};

pub use identity::{Boundary, Dialect, Endpoint, IdentityBlocks, Passed, PrefixKey, RequestShape, ShapeError};
pub use stream::{SeamRisk, StreamAsks};
use xxhash_rust::xxh3::xxh3_128;

/// Routing mode. `roundrobin` and `affinity` are the comparison baselines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Pin continuations to their prefix's replica; spread everything else.
    #[default]
    Shape,
    /// A counter for everything: loses every other cache hit in an agent loop.
    #[serde(rename = "roundrobin")]
    RoundRobin,
    /// Everything by prefix: a batch sharing a system prompt lands on one card.
    Affinity,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "shape" => Ok(Mode::Shape),
            "roundrobin" => Ok(Mode::RoundRobin),
            "affinity" => Ok(Mode::Affinity),
            other => Err(format!("unknown policy '{other}' (expected shape, roundrobin or affinity)")),
        }
    }
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Shape => "shape",
            Mode::RoundRobin => "roundrobin",
            Mode::Affinity => "affinity",
        }
    }

    /// The mode named by `PREFIXGATE_POLICY`, if set and valid.
    pub fn from_env() -> Result<Option<Mode>, String> {
        match std::env::var("PREFIXGATE_POLICY") {
            Ok(v) => v.parse().map(Some),
            Err(_) => Ok(None),
        }
    }
}

/// The routing settings an operator can change at runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct PolicySettings {
    pub mode: Mode,
    pub identity: IdentityBlocks,
}

impl PolicySettings {
    pub fn validate(&self) -> Result<(), String> {
        const MAX: usize = 1 << 30;
        let sizes = [self.identity.block_bytes, self.identity.block_tokens];
        if sizes.iter().any(|n| !(1..=MAX).contains(n)) {
            return Err(format!("identity block sizes must be between 1 and {MAX}"));
        }
        Ok(())
    }
}

/// The settings in force: read by every request, replaced by the operator.
#[derive(Debug)]
pub struct CurrentPolicy(ArcSwap<PolicySettings>);

impl CurrentPolicy {
    pub fn new(settings: PolicySettings) -> CurrentPolicy {
        CurrentPolicy(ArcSwap::from_pointee(settings))
    }

    pub fn get(&self) -> PolicySettings {
        **self.0.load()
    }

    /// Replaces the settings; returns the previous ones.
    pub fn replace(&self, next: PolicySettings) -> PolicySettings {
        *self.0.swap(std::sync::Arc::new(next))
    }
}

/// Why a request went where it went (the `x-prefixgate-route` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteReason {
    Pinned,
    Spread,
    RoundRobin,
    Affinity,
    /// The pinned replica was not routable: spread, and the pin moves.
    Repinned,
    /// The chosen replica refused the connection: retried elsewhere.
    Failover,
    /// No prefix evidence; the conversation's session key named its replica.
    Session,
    /// `previous_response_id` (or a stored response's path): only its replica can serve it.
    Response,
    /// A continuation whose replica's queue costs more than prefilling its
    /// whole context elsewhere (`moves`): spread, and the pin moves.
    Moved,
}

impl RouteReason {
    /// Every reason, in declaration order (`reason as usize` indexes it).
    pub const ALL: [RouteReason; 9] = [
        RouteReason::Pinned,
        RouteReason::Spread,
        RouteReason::RoundRobin,
        RouteReason::Affinity,
        RouteReason::Repinned,
        RouteReason::Failover,
        RouteReason::Session,
        RouteReason::Response,
        RouteReason::Moved,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::Pinned => "pinned",
            RouteReason::Spread => "spread",
            RouteReason::RoundRobin => "roundrobin",
            RouteReason::Affinity => "affinity",
            RouteReason::Repinned => "repinned",
            RouteReason::Failover => "failover",
            RouteReason::Session => "session",
            RouteReason::Response => "response",
            RouteReason::Moved => "moved",
        }
    }
}

/// A replica as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub id: &'a str,
    /// Active, not known down, serves the requested model, not already tried.
    pub routable: bool,
    /// Can start this request without queueing (a free large-context slot,
    /// or no limit). Spread picks prefer such replicas; pins ignore it,
    /// because moving a continuation throws its cache away.
    pub spare: bool,
    /// Its share of spread picks relative to the others (`ReplicaSpec::weight`).
    pub weight: u32,
    /// Its outstanding work as the gateway counts it (`fleet::work`): a
    /// spread pick goes to the least, per unit of weight.
    pub load: u64,
    /// It holds the longest prompt the request shares with other
    /// conversations (a system prompt and tools, a document): preferred
    /// among the least loaded.
    pub holds_shared: bool,
    /// Its measured prefill rate, tokens a second (None: not measured).
    pub prefill_tps: Option<f64>,
    /// A conversation moved here would fit its room at the KV wall (true
    /// where nothing is held, `sessions/`): a pinned turn moves only to
    /// such a replica (`moves`).
    pub has_room: bool,
}

impl<'a> Candidate<'a> {
    /// A routable replica with spare room, weight 1 and nothing to do (the
    /// start of tests' and benchmarks' candidates).
    pub fn idle(id: &'a str) -> Candidate<'a> {
        Candidate {
            id,
            routable: true,
            spare: true,
            weight: 1,
            load: 0,
            holds_shared: false,
            prefill_tps: None,
            has_room: true,
        }
    }
}

/// How requests that continue nothing are placed (`routing.spread`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Spread {
    /// The least outstanding work per unit of weight; among equals, a
    /// replica holding the shared prompt, then the counter.
    #[default]
    Load,
    /// The seed's rule: the counter alone, weighted (load is not read).
    Counter,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub target: Target,
    pub reason: RouteReason,
    /// The longest pinned prefix found (the request's boundary it ends
    /// at: its bytes are the cache the replica should hold), whether or
    /// not it was followed.
    pub matched: Option<Boundary>,
}

/// Where a decision sends the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// This candidate (an index into the candidate slice).
    Candidate(usize),
    /// The next spread pick (`spread_pick`), made by the caller with its
    /// counter's next position: `decide` stays pure, and only spread
    /// decisions advance the counter.
    Spread,
}

impl Decision {
    /// The candidate the request goes to; `spread_at` is called only for a
    /// spread decision.
    pub fn candidate(&self, candidates: &[Candidate], spread: Spread, spread_at: impl FnOnce() -> u64) -> usize {
        match self.target {
            Target::Candidate(i) => i,
            Target::Spread => spread_pick(candidates, spread, spread_at()),
        }
    }
}

/// The spread counter. Only spread picks advance it, so consecutive spread
/// picks alternate across the live replicas whatever pinned traffic does.
#[derive(Debug, Default)]
pub struct SpreadCounter(AtomicU64);

impl SpreadCounter {
    /// A counter starting at `n`. Gateway instances sharing a fleet start at
    /// different points (a hash of their name), so their first spread picks
    /// do not all land on the same replica.
    pub fn starting_at(n: u64) -> SpreadCounter {
        SpreadCounter(AtomicU64::new(n))
    }

    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// Decides where a request goes. `pinned` is the longest boundary of the
/// request that has a pin, and the replica it names (the caller looks it up
/// once, see `PinTable::lookup_longest`); it is ignored for requests without
/// history. `named` is the replica the request's session key points at
/// (`conversation.rs`): it decides only when no prefix matched. `None` when no
/// candidate is routable. Pure: a spread decision names no candidate, the
/// caller picks one with its counter (`Decision::candidate`). With
/// `Spread::Load`, a pinned turn whose replica's queue costs more than a
/// whole prefill elsewhere moves (`moves`).
pub fn decide(
    mode: Mode,
    spread_by: Spread,
    shape: &RequestShape,
    candidates: &[Candidate],
    pinned: Option<(Boundary, &str)>,
    named: Option<&str>,
) -> Option<Decision> {
    if !candidates.iter().any(|c| c.routable) {
        return None;
    }
    // Known in every mode: the baselines do not follow pins, but the caller
    // still needs to know which conversation a request continues.
    let pinned = pinned.filter(|_| shape.multi_unit);
    let matched = pinned.map(|(m, _)| m);
    let spread = |reason| Decision { target: Target::Spread, reason, matched };
    match mode {
        Mode::RoundRobin => Some(spread(RouteReason::RoundRobin)),
        Mode::Affinity => match shape.boundaries.first() {
            Some(first) => Some(Decision {
                target: Target::Candidate(rendezvous_pick(candidates, first.key)),
                reason: RouteReason::Affinity,
                matched,
            }),
            None => Some(spread(RouteReason::Spread)),
        },
        Mode::Shape => {
            let (home, reason) = match (pinned, named) {
                (Some((_, home)), _) => (home, RouteReason::Pinned),
                (None, Some(home)) => (home, RouteReason::Session),
                (None, None) => return Some(spread(RouteReason::Spread)),
            };
            match candidates.iter().position(|c| c.routable && c.id == home) {
                Some(i) if reason == RouteReason::Pinned && spread_by == Spread::Load => {
                    let context = crate::tokens::estimate_tokens(shape.prompt_bytes);
                    let cached = matched.map_or(0, |m| crate::tokens::estimate_tokens(m.bytes));
                    let (target, reason) = match moves(candidates, i, context, cached) {
                        Some(to) => (to, RouteReason::Moved),
                        None => (i, reason),
                    };
                    Some(Decision { target: Target::Candidate(target), reason, matched })
                }
                Some(i) => Some(Decision { target: Target::Candidate(i), reason, matched }),
                None => Some(spread(RouteReason::Repinned)),
            }
        }
    }
}

/// Where a pinned turn goes instead of its home (`candidates[home]`), if
/// anywhere: the least loaded other routable candidate with room for it,
/// when waiting at home behind its outstanding work and then prefilling
/// what is not cached (`context - cached` tokens) takes longer than
/// prefilling the whole `context` there behind its work. Times come from
/// each replica's measured prefill rate; where either is not measured, both
/// count alike (tokens against tokens); the saving must be at least
/// `MOVE_MARGIN_TOKENS`. A turn's cached share is what it gives up by
/// moving, so a long, warm context stays unless the queue is longer still;
/// at the KV wall it never moves where it does not fit.
pub fn moves(candidates: &[Candidate], home: usize, context: u64, cached: u64) -> Option<usize> {
    let here = &candidates[home];
    let (to, there) = candidates
        .iter()
        .enumerate()
        .filter(|(i, c)| *i != home && c.routable && c.weight > 0 && c.has_room)
        .min_by_key(|(_, c)| c.load)?;
    let (rate_here, rate_there) = match (here.prefill_tps, there.prefill_tps) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => (a, b),
        _ => (1.0, 1.0),
    };
    let stay = (here.load + context.saturating_sub(cached)) as f64 / rate_here;
    let go = (there.load + context) as f64 / rate_there;
    (stay > go + MOVE_MARGIN_TOKENS as f64 / rate_here).then_some(to)
}

/// A move must save at least this many tokens' worth of prefill: below it,
/// a snapshot of the queues (which change with every request) says too
/// little to give up a warm prefix, and conversations would bounce.
pub const MOVE_MARGIN_TOKENS: u64 = 4_096;

/// Whether a request whose own last boundary is at index `ends_at`
/// continues the conversation of a pin found at its boundary `at`, which
/// the request that wrote the pin went on past by `went_on` boundaries (0:
/// the pin is that request's own last boundary). A request continues from
/// where a served request ended; or from a boundary a served request
/// passed, when it goes on further than that request did: an agent whose
/// tail was rewritten (a step counter or status replaced, a reminder moved
/// off an older message, an old tool result cleared) re-sends what that
/// request had up to there, then its answer and more. One that goes no
/// further shares a prompt with another conversation (a first turn after
/// the same system prompt and tools, a one-shot after the same document):
/// it is a conversation of its own.
pub fn continues(ends_at: usize, at: usize, went_on: u32) -> bool {
    went_on == 0 || ends_at.saturating_sub(at) > went_on as usize
}

/// A spread pick. With `Spread::Load`, the eligible candidates with the
/// least load per unit of weight, and among them those holding the shared
/// prompt if any do; with `Spread::Counter`, every eligible one. Of those,
/// the `at`-th (modulo their number), each counted as many times as its
/// weight. Eligible: routable, and with spare room when any has it. Weight
/// 0 counts only when every eligible candidate has weight 0. At least one
/// candidate must be routable.
pub fn spread_pick(candidates: &[Candidate], spread: Spread, at: u64) -> usize {
    let any_spare = candidates.iter().any(|c| c.routable && c.spare);
    let eligible = |c: &Candidate| c.routable && (c.spare || !any_spare);
    let any_weighted = candidates.iter().filter(|c| eligible(c)).any(|c| c.weight > 0);
    let weight = |c: &Candidate| if any_weighted { u64::from(c.weight) } else { 1 };
    // Load per unit of weight; a weight-0 candidate among weighted ones is
    // never the least (it is a last resort, as for the counter).
    let per_weight = |c: &Candidate| match weight(c) {
        0 => f64::INFINITY,
        w => c.load as f64 / w as f64,
    };
    let least = match spread {
        Spread::Load => candidates.iter().filter(|c| eligible(c)).map(per_weight).fold(f64::INFINITY, f64::min),
        Spread::Counter => f64::INFINITY,
    };
    let among = |c: &Candidate| eligible(c) && (spread == Spread::Counter || per_weight(c) <= least);
    let holders = spread == Spread::Load && candidates.iter().any(|c| among(c) && c.holds_shared);
    let pool = |c: &Candidate| among(c) && (!holders || c.holds_shared);
    // Never 0: with weights, the least loaded are weighted ones.
    let total: u64 = candidates.iter().filter(|c| pool(c)).map(weight).sum();
    let mut nth = at % total;
    for (i, c) in candidates.iter().enumerate().filter(|(_, c)| pool(c)) {
        if nth < weight(c) {
            return i;
        }
        nth -= weight(c);
    }
    unreachable!("nth < the pool's total weight")
}

/// Highest-random-weight hashing: stable per key, and only the keys of a
/// replica that leaves move when the set changes.
fn rendezvous_pick(candidates: &[Candidate], key: PrefixKey) -> usize {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.routable)
        .max_by_key(|(_, c)| {
            let mut buf = key.to_le_bytes().to_vec();
            buf.extend_from_slice(c.id.as_bytes());
            xxh3_128(&buf)
        })
        .map(|(i, _)| i)
        .expect("at least one routable candidate")
}

#[cfg(test)]
mod tests;
