//! Prometheus metrics (`GET /metrics` on the admin listener). Names follow
//! Prometheus conventions: `prefixgate_` prefix, counters end in `_total`,
//! durations in `_seconds`. Every name here is listed in docs/observability.md and a
//! test scrapes the live endpoint for each, so docs and code cannot drift.
//!
//! Counters and histograms are updated on the request path (atomics in a
//! stripe per thread, `striped.rs`; no locks beyond the label map); gauges
//! that mirror fleet state are set at scrape time from the fleet itself, so
//! they cannot disagree with it.
//!
//! A replica's series live on its fleet record and leave with it
//! (`replica.rs`).

use std::borrow::Cow;
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::striped::{StripedCounter, StripedHistogram};

use crate::capacity::CapacityReport;

mod replica;
pub use replica::{ReplicaSeries, RouteMetrics, SeriesTotals};

// Label values on the request path are shared replica names and static
// strings: a label set costs no allocation per request.

/// A replica name as a label value: shares the fleet's `Arc<str>`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Name(pub Arc<str>);

impl EncodeLabelValue for Name {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&&*self.0, encoder)
    }
}

impl From<&Arc<str>> for Name {
    fn from(name: &Arc<str>) -> Name {
        Name(name.clone())
    }
}

impl From<&str> for Name {
    fn from(name: &str) -> Name {
        Name(name.into())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub replica: Name,
    pub route: &'static str,
    pub status: Cow<'static, str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub replica: Name,
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    pub replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceResultLabels {
    pub source: String,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceChangeLabels {
    pub source: String,
    pub change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailoverLabels {
    pub from: Name,
    pub to: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContinuedLabels {
    pub dialect: &'static str,
    pub reason: &'static str,
    pub exact: &'static str,
}

/// Why a broken stream did not go on (`proxy::resume::Refusal::as_str`,
/// every one: a test there holds the two lists together).
pub const NOT_CONTINUED_REASONS: [&str; 13] = [
    "structured_output",
    "n_greater_than_1",
    "logprobs",
    "inside_tool_call",
    "inside_reasoning",
    "no_token_ids",
    "too_many_tokens",
    "max_continuations",
    "no_replica",
    "too_many_resuming",
    "no_transcript",
    "no_tokenizer",
    "stored_response",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    pub class: &'static str,
}

impl ClassLabels {
    pub fn of(class: crate::priority::Class) -> ClassLabels {
        ClassLabels { class: class.as_str() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// An HTTP status as a label value; the usual ones without an allocation.
pub fn status_label(status: u16) -> Cow<'static, str> {
    match status {
        200 => Cow::Borrowed("200"),
        400 => Cow::Borrowed("400"),
        404 => Cow::Borrowed("404"),
        429 => Cow::Borrowed("429"),
        500 => Cow::Borrowed("500"),
        502 => Cow::Borrowed("502"),
        503 => Cow::Borrowed("503"),
        504 => Cow::Borrowed("504"),
        other => Cow::Owned(other.to_string()),
    }
}

type HistogramFamily<L> = Family<L, StripedHistogram, fn() -> StripedHistogram>;

fn hold_histogram() -> Histogram {
    // 10 ms .. ~164 s: a hand-off between sessions to sessions.max_wait_ms.
    Histogram::new(exponential_buckets(0.01, 2.0, 15))
}

fn latency_histogram() -> StripedHistogram {
    // 1 ms .. ~524 s: covers a warm first token and a cold 90k-token prefill.
    StripedHistogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// One replica's state for the gauges that mirror it, read by the scrape
/// handler from the components themselves (this module reads none).
#[derive(Debug, Clone, Default)]
pub struct ReplicaGauges {
    pub id: String,
    pub inflight: i64,
    pub large_inflight: i64,
    pub pins: usize,
    pub up: bool,
    pub queued: usize,
    pub bytes_per_token: f64,
    pub resident_sessions: usize,
    /// None: capacity unknown.
    pub room_tokens: Option<i64>,
    pub resident_tokens: u64,
    /// None: no wall seen.
    pub wall_tokens: Option<u64>,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, StripedCounter>,
    pub upstream_ttfb: HistogramFamily<RouteLabels>,
    pub first_token: HistogramFamily<RouteLabels>,
    pub request_duration: HistogramFamily<RouteLabels>,
    pub failovers: Family<FailoverLabels, Counter>,
    pub streams_continued: Family<ContinuedLabels, Counter>,
    pub streams_not_continued: Family<ReasonLabels, Counter>,
    pub session_moves: Family<ReasonLabels, Counter>,
    pub pin_lookups: Family<ResultLabels, StripedCounter>,
    pub rejected: Family<ResultLabels, Counter>,
    pub prompt_tokens: Family<RouteLabels, StripedCounter>,
    pub cached_tokens: Family<RouteLabels, StripedCounter>,
    pub usage_measured: Family<ResultLabels, StripedCounter>,
    pub admission_waits: Family<ReplicaLabels, Counter>,
    pub admission_rejections: Family<ReplicaLabels, Counter>,
    // Mirrors of fleet state, set at scrape time.
    pub inflight: Family<ReplicaLabels, Gauge>,
    pub large_inflight: Family<ReplicaLabels, Gauge>,
    pub pins: Family<ReplicaLabels, Gauge>,
    pub replica_up: Family<ReplicaLabels, Gauge>,
    pub admission_queue_depth: Family<ReplicaLabels, Gauge>,
    pub working_set_tokens: Family<ReplicaLabels, Gauge>,
    pub kv_capacity_tokens: Family<ReplicaLabels, Gauge>,
    pub bytes_per_token: Family<ReplicaLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub capacity_warning: Family<ReplicaLabels, Gauge>,
    /// 1 while the store answers (a shared store that is unreachable: 0).
    pub store_up: Gauge,
    /// Pin changes announced to other instances (result=sent|dropped|failed).
    pub announcements: Family<ResultLabels, Counter>,
    /// From another instance's announcement to its pins applied here.
    pub propagation: Histogram,
    /// Stored response ids this instance did not know, by where they were
    /// found (result=store|replica|unknown).
    pub stored_response_lookups: Family<ResultLabels, Counter>,
    /// Continuations and named sessions with no pin here, read from the
    /// shared store (result=found|missed).
    pub pin_read_through: Family<ResultLabels, Counter>,
    /// Pin changes the flusher wrote to the store.
    pub pins_persisted: Counter,
    /// New sessions' waits for room at the KV wall, placed or not.
    pub session_hold: Family<ClassLabels, Histogram, fn() -> Histogram>,
    /// New sessions waiting for room now.
    pub held_sessions: Family<ClassLabels, Gauge>,
    /// Resident sessions whose room went to a waiting higher class.
    pub sessions_preempted: Family<ClassLabels, Counter>,
    /// New sessions admitted over capacity (no room opened within the wait).
    pub sessions_over_capacity: Counter,
    /// Turns of resident sessions paused at their boundary, by the session's class.
    pub session_turns_paused: Family<ClassLabels, Counter>,
    /// Turns paused now, by class.
    pub paused_turns: Family<ClassLabels, Gauge>,
    /// Tokens the resident sessions count for per replica, and the wall its
    /// receipts found (set at scrape; 0: no wall seen).
    pub resident_tokens: Family<ReplicaLabels, Gauge>,
    pub kv_wall_tokens: Family<ReplicaLabels, Gauge>,
    /// Sessions resident per replica, and the room left (tokens; set at scrape).
    pub resident_sessions: Family<ReplicaLabels, Gauge>,
    pub room_tokens: Family<ReplicaLabels, Gauge>,
    /// Spans the trace collector did not take (down, slow, refusing).
    pub spans_dropped: Counter,
    /// History events waiting to be written to the store.
    pub events_unwritten: Gauge,
    pub pin_pages_on_disk: Gauge,
    /// History events dropped unwritten (the backlog was full during an outage).
    pub events_unwritten_dropped: Counter,
    /// Discovery sources read, by source and result (ok|failed|held).
    pub discovery_reads: Family<SourceResultLabels, Counter>,
    /// Replicas each discovery source lists now.
    pub discovery_replicas: Family<SourceLabels, Gauge>,
    /// 1 while a discovery source fails (its last good answer stands).
    pub discovery_stale: Family<SourceLabels, Gauge>,
    /// What discovery did to the fleet, by source and change
    /// (added|updated|drained|returned|removed|conflict).
    pub discovery_changes: Family<SourceChangeLabels, Counter>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            requests: Family::default(),
            upstream_ttfb: Family::new_with_constructor(latency_histogram as fn() -> StripedHistogram),
            first_token: Family::new_with_constructor(latency_histogram as fn() -> StripedHistogram),
            request_duration: Family::new_with_constructor(latency_histogram as fn() -> StripedHistogram),
            failovers: Family::default(),
            streams_continued: Family::default(),
            streams_not_continued: Family::default(),
            session_moves: Family::default(),
            pin_lookups: Family::default(),
            rejected: Family::default(),
            prompt_tokens: Family::default(),
            cached_tokens: Family::default(),
            usage_measured: Family::default(),
            admission_waits: Family::default(),
            admission_rejections: Family::default(),
            inflight: Family::default(),
            large_inflight: Family::default(),
            pins: Family::default(),
            replica_up: Family::default(),
            admission_queue_depth: Family::default(),
            working_set_tokens: Family::default(),
            kv_capacity_tokens: Family::default(),
            bytes_per_token: Family::default(),
            capacity_warning: Family::default(),
            store_up: Gauge::default(),
            announcements: Family::default(),
            // 50 µs .. ~1.6 s: a pub/sub hop on loopback is well under a millisecond.
            propagation: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            stored_response_lookups: Family::default(),
            pin_read_through: Family::default(),
            pins_persisted: Counter::default(),
            // 10 ms .. ~164 s: a session waits for another to finish.
            session_hold: Family::new_with_constructor(hold_histogram as fn() -> Histogram),
            held_sessions: Family::default(),
            sessions_preempted: Family::default(),
            sessions_over_capacity: Counter::default(),
            session_turns_paused: Family::default(),
            paused_turns: Family::default(),
            resident_tokens: Family::default(),
            kv_wall_tokens: Family::default(),
            resident_sessions: Family::default(),
            room_tokens: Family::default(),
            spans_dropped: Counter::default(),
            events_unwritten: Gauge::default(),
            pin_pages_on_disk: Gauge::default(),
            events_unwritten_dropped: Counter::default(),
            discovery_reads: Family::default(),
            discovery_replicas: Family::default(),
            discovery_stale: Family::default(),
            discovery_changes: Family::default(),
            registry: Registry::default(),
        };
        // Registration clones the families (they share state through Arcs).
        registry.register(
            "prefixgate_requests",
            "Requests proxied, by replica, route reason and status",
            m.requests.clone(),
        );
        registry.register(
            "prefixgate_upstream_ttfb_seconds",
            "Time to the first upstream response byte",
            m.upstream_ttfb.clone(),
        );
        registry.register(
            "prefixgate_time_to_first_token_seconds",
            "Streamed responses: time from the attempt's start to the first event of the body (the first token)",
            m.first_token.clone(),
        );
        registry.register(
            "prefixgate_request_duration_seconds",
            "Time until the response body ended",
            m.request_duration.clone(),
        );
        registry.register(
            "prefixgate_failovers",
            "Requests retried on another replica after a connection failure",
            m.failovers.clone(),
        );
        registry.register(
            "prefixgate_streams_continued",
            "Streams that broke after their first byte and went on on another replica",
            m.streams_continued.clone(),
        );
        registry.register(
            "prefixgate_streams_not_continued",
            "Streams that broke after their first byte and could not go on, by why",
            m.streams_not_continued.clone(),
        );
        registry.register(
            "prefixgate_session_moves",
            "Conversations moved to another replica by the shape policy, by why: `queue` (waiting there cost more than a whole prefill elsewhere), `unroutable` (their replica was not routable)",
            m.session_moves.clone(),
        );
        registry.register(
            "prefixgate_pin_lookups",
            "Continuation pin lookups by result (hit, miss)",
            m.pin_lookups.clone(),
        );
        registry.register(
            "prefixgate_rejected_requests",
            "Requests answered by the gateway with an error, by reason",
            m.rejected.clone(),
        );
        registry.register(
            "prefixgate_prompt_tokens",
            "Prompt tokens reported by replicas in usage, by replica and route",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "prefixgate_cached_tokens",
            "Cached prompt tokens reported by replicas, by replica and route",
            m.cached_tokens.clone(),
        );
        registry.register(
            "prefixgate_usage_measured",
            "Successful responses whose usage could be read (result=measured|unmeasured)",
            m.usage_measured.clone(),
        );
        registry.register(
            "prefixgate_admission_waits",
            "Large requests that waited for an admission slot",
            m.admission_waits.clone(),
        );
        registry.register(
            "prefixgate_admission_rejections",
            "Large requests rejected by admission (queue full or wait timeout)",
            m.admission_rejections.clone(),
        );
        registry.register("prefixgate_inflight_requests", "Requests in flight per replica", m.inflight.clone());
        registry.register(
            "prefixgate_large_inflight_requests",
            "Large-context requests in flight per replica",
            m.large_inflight.clone(),
        );
        registry.register("prefixgate_pins", "Conversation pins held per replica", m.pins.clone());
        registry.register(
            "prefixgate_replica_up",
            "1 when the replica takes traffic (active and not down)",
            m.replica_up.clone(),
        );
        registry.register(
            "prefixgate_admission_queue_depth",
            "Large requests waiting for an admission slot",
            m.admission_queue_depth.clone(),
        );
        registry.register(
            "prefixgate_working_set_tokens",
            "Estimated KV working set: active families plus running requests",
            m.working_set_tokens.clone(),
        );
        registry.register(
            "prefixgate_kv_capacity_tokens",
            "KV cache capacity in tokens (declared or read from the replica)",
            m.kv_capacity_tokens.clone(),
        );
        registry.register("prefixgate_bytes_per_token", "Calibrated prompt bytes per token", m.bytes_per_token.clone());
        registry.register(
            "prefixgate_capacity_warning",
            "1 when the working set exceeds KV capacity",
            m.capacity_warning.clone(),
        );
        registry.register(
            "prefixgate_store_up",
            "1 while the store answers; 0 while a shared store is unreachable (routing goes on from memory)",
            m.store_up.clone(),
        );
        registry.register(
            "prefixgate_shared_announcements",
            "Pin changes announced to the other instances at once (result=sent|dropped|failed)",
            m.announcements.clone(),
        );
        registry.register(
            "prefixgate_shared_propagation_seconds",
            "From another instance announcing a pin change to this instance applying it",
            m.propagation.clone(),
        );
        registry.register(
            "prefixgate_stored_response_lookups",
            "Stored response ids unknown here, by where they were found (result=store|replica|unknown)",
            m.stored_response_lookups.clone(),
        );
        registry.register(
            "prefixgate_pin_read_through",
            "Continuations and named sessions with no pin here, read from the shared store (result=found|missed)",
            m.pin_read_through.clone(),
        );
        registry.register(
            "prefixgate_pins_persisted",
            "Pin changes written to the store by the flusher (batched behind the requests)",
            m.pins_persisted.clone(),
        );
        registry.register(
            "prefixgate_session_hold_seconds",
            "How long new sessions waited for room at the KV wall, by priority class",
            m.session_hold.clone(),
        );
        registry.register(
            "prefixgate_held_sessions",
            "New sessions waiting for room now, by priority class",
            m.held_sessions.clone(),
        );
        registry.register(
            "prefixgate_sessions_preempted",
            "Resident sessions whose room went to a waiting session of a higher class, by the preempted one's class",
            m.sessions_preempted.clone(),
        );
        registry.register(
            "prefixgate_sessions_over_capacity",
            "New sessions admitted over capacity after waiting sessions.max_wait_ms",
            m.sessions_over_capacity.clone(),
        );
        registry.register(
            "prefixgate_session_turns_paused",
            "Turns of resident sessions paused at their boundary (their replica's sessions outgrew its KV), by the session's priority class",
            m.session_turns_paused.clone(),
        );
        registry.register(
            "prefixgate_paused_turns",
            "Turns of resident sessions paused now at the KV wall, by the session's priority class",
            m.paused_turns.clone(),
        );
        registry.register(
            "prefixgate_resident_session_tokens",
            "Tokens the sessions resident per replica count for (each at the larger of its context and its projection)",
            m.resident_tokens.clone(),
        );
        registry.register(
            "prefixgate_kv_wall_tokens",
            "The load at which a replica was seen to lose a resident session's prefix: its wall in practice (0: none seen)",
            m.kv_wall_tokens.clone(),
        );
        registry.register(
            "prefixgate_resident_sessions",
            "Sessions resident per replica (first turn until sessions.idle_ms idle)",
            m.resident_sessions.clone(),
        );
        registry.register(
            "prefixgate_room_tokens",
            "KV room left per replica for new sessions (capacity minus resident sessions), where capacity is known",
            m.room_tokens.clone(),
        );
        registry.register(
            "prefixgate_spans_dropped",
            "Trace spans lost on the way to the collector (it was down, slow or refusing)",
            m.spans_dropped.clone(),
        );
        registry.register(
            "prefixgate_pin_pages_on_disk",
            "Pin pages not read yet since the start (sled: read on first touch and in the background; 0 once whole)",
            m.pin_pages_on_disk.clone(),
        );
        registry.register(
            "prefixgate_events_unwritten",
            "History events waiting to be written to the store (bounded by history.max_unwritten)",
            m.events_unwritten.clone(),
        );
        registry.register(
            "prefixgate_events_unwritten_dropped",
            "History events dropped before they were written: the backlog was full while the store was unreachable",
            m.events_unwritten_dropped.clone(),
        );
        registry.register(
            "prefixgate_discovery_reads",
            "Discovery sources read, by source and result (ok|failed|held)",
            m.discovery_reads.clone(),
        );
        registry.register(
            "prefixgate_discovery_replicas",
            "Replicas each discovery source lists now",
            m.discovery_replicas.clone(),
        );
        registry.register(
            "prefixgate_discovery_stale",
            "1 while a discovery source fails and its last good answer stands",
            m.discovery_stale.clone(),
        );
        registry.register(
            "prefixgate_discovery_changes",
            "Fleet changes made by discovery (change=added|updated|drained|returned|removed|conflict)",
            m.discovery_changes.clone(),
        );
        // Every result starts at zero, so a rate over a quiet series is 0, not absent.
        for result in ["sent", "dropped", "failed"] {
            m.announcements.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        for result in ["store", "replica", "unknown"] {
            m.stored_response_lookups.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        for result in ["found", "missed"] {
            m.pin_read_through.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        // Chat and completions go on exactly or from their text; Responses
        // and Messages from their text only (vLLM gives no ids there).
        let ways = [("chat", "true"), ("chat", "false"), ("completions", "true"), ("completions", "false")];
        for (dialect, exact) in ways.into_iter().chain([("responses", "false"), ("messages", "false")]) {
            for reason in ["replica_failed", "stalled", "drained"] {
                m.streams_continued.get_or_create(&ContinuedLabels { dialect, reason, exact }).inc_by(0);
            }
        }
        for reason in NOT_CONTINUED_REASONS {
            m.streams_not_continued.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for reason in ["queue", "unroutable"] {
            m.session_moves.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        // Every class starts at zero, so a rate over a quiet class is 0, not absent.
        for class in crate::priority::Class::ALL {
            let l = ClassLabels::of(class);
            m.sessions_preempted.get_or_create(&l).inc_by(0);
            m.session_turns_paused.get_or_create(&l).inc_by(0);
            m.paused_turns.get_or_create(&l).set(0);
            m.held_sessions.get_or_create(&l).set(0);
            let _ = m.session_hold.get_or_create(&l);
        }
        Metrics { registry, ..m }
    }

    /// Starts a discovery source's series at zero, so a rate over a quiet
    /// series is 0, not absent.
    pub fn discovery_source(&self, source: &str) {
        for result in ["ok", "failed", "held"] {
            self.discovery_reads.get_or_create(&SourceResultLabels { source: source.to_string(), result }).inc_by(0);
        }
        for change in ["added", "updated", "drained", "returned", "removed", "conflict"] {
            self.discovery_change_by(source, change, 0);
        }
        let labels = SourceLabels { source: source.to_string() };
        self.discovery_replicas.get_or_create(&labels).set(0);
        self.discovery_stale.get_or_create(&labels).set(0);
    }

    /// Counts one read of a discovery source and sets its gauges.
    pub fn discovery_read(&self, source: &str, result: &'static str, replicas: usize, stale: bool) {
        let labels = SourceLabels { source: source.to_string() };
        self.discovery_reads.get_or_create(&SourceResultLabels { source: source.to_string(), result }).inc();
        self.discovery_replicas.get_or_create(&labels).set(replicas as i64);
        self.discovery_stale.get_or_create(&labels).set(i64::from(stale));
    }

    pub fn discovery_change(&self, source: &str, change: &'static str) {
        self.discovery_change_by(source, change, 1);
    }

    fn discovery_change_by(&self, source: &str, change: &'static str, n: u64) {
        self.discovery_changes.get_or_create(&SourceChangeLabels { source: source.to_string(), change }).inc_by(n);
    }

    /// Sets the gauges that mirror fleet and capacity state (at scrape time,
    /// from the components themselves, so they cannot disagree with them).
    /// Pin counts are kept incrementally by the pin table: no scan here.
    pub fn refresh_gauges(&self, replicas: &[ReplicaGauges], report: &CapacityReport) {
        for family in [
            &self.inflight,
            &self.large_inflight,
            &self.pins,
            &self.replica_up,
            &self.admission_queue_depth,
            &self.working_set_tokens,
            &self.kv_capacity_tokens,
            &self.capacity_warning,
            &self.resident_sessions,
            &self.room_tokens,
            &self.resident_tokens,
            &self.kv_wall_tokens,
        ] {
            family.clear();
        }
        self.bytes_per_token.clear();
        for r in replicas {
            let l = replica_label(&r.id);
            self.inflight.get_or_create(&l).set(r.inflight);
            self.large_inflight.get_or_create(&l).set(r.large_inflight);
            self.pins.get_or_create(&l).set(r.pins as i64);
            self.replica_up.get_or_create(&l).set(i64::from(r.up));
            self.admission_queue_depth.get_or_create(&l).set(r.queued as i64);
            self.bytes_per_token.get_or_create(&l).set(r.bytes_per_token);
            self.resident_sessions.get_or_create(&l).set(r.resident_sessions as i64);
            if let Some(room) = r.room_tokens {
                self.room_tokens.get_or_create(&l).set(room);
            }
            self.resident_tokens.get_or_create(&l).set(r.resident_tokens as i64);
            self.kv_wall_tokens.get_or_create(&l).set(r.wall_tokens.unwrap_or(0) as i64);
        }
        for r in &report.replicas {
            let l = replica_label(&r.replica);
            self.working_set_tokens.get_or_create(&l).set(r.working_set_tokens as i64);
            self.kv_capacity_tokens.get_or_create(&l).set(r.kv_tokens.unwrap_or(0) as i64);
            self.capacity_warning.get_or_create(&l).set(i64::from(r.over_capacity));
        }
        self.capacity_warning
            .get_or_create(&replica_label("_aggregate"))
            .set(i64::from(report.aggregate.over_capacity));
    }

    /// Every metric's name as samples carry it (counters end in `_total`),
    /// in registration order: read from the registry itself, so the list
    /// docs/observability.md keeps (and a test compares) is typed nowhere else.
    pub fn exposed_names(&self) -> Vec<String> {
        self.encode()
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .map(|(name, kind)| if kind == "counter" { format!("{name}_total") } else { name.to_string() })
            .collect()
    }

    /// The replica names the exposition carries (labels `replica`, `from`
    /// and `to`): for the churn test, which bounds them.
    pub fn replica_names_exposed(&self) -> usize {
        let text = self.encode();
        let mut names = std::collections::BTreeSet::new();
        for label in ["replica=\"", "from=\"", "to=\""] {
            for (i, _) in text.match_indices(label) {
                let rest = &text[i + label.len()..];
                names.insert(&rest[..rest.find('"').unwrap_or(0)]);
            }
        }
        names.len()
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// One worker's handles on the request-path counters that name no replica.
/// A family guards its label map with a lock that every reader writes to
/// (the reader count), so two workers looking up the same label set bounce
/// that cache line between cores on every request: a worker keeps its own
/// clones (they share the family's atomics; the exposition is unchanged).
/// A replica's handles are on its record (`ReplicaSeries`).
pub struct WorkerMetrics {
    shared: Arc<Metrics>,
    pub measured: StripedCounter,
    pub unmeasured: StripedCounter,
    pub pin_hits: StripedCounter,
    pub pin_misses: StripedCounter,
}

impl WorkerMetrics {
    pub fn new(shared: Arc<Metrics>) -> WorkerMetrics {
        let result = |family: &Family<ResultLabels, StripedCounter>, r| {
            family.get_or_create(&ResultLabels { result: r }).clone()
        };
        WorkerMetrics {
            measured: result(&shared.usage_measured, "measured"),
            unmeasured: result(&shared.usage_measured, "unmeasured"),
            pin_hits: result(&shared.pin_lookups, "hit"),
            pin_misses: result(&shared.pin_lookups, "miss"),
            shared,
        }
    }

    pub fn shared(&self) -> &Arc<Metrics> {
        &self.shared
    }
}

/// Adds `item` to a replica's list of series unless it is there already.
fn push_once<T: PartialEq + Clone>(list: &mut Vec<T>, item: &T) {
    if !list.contains(item) {
        list.push(item.clone());
    }
}

pub fn replica_label(id: &str) -> ReplicaLabels {
    ReplicaLabels { replica: id.to_string() }
}
