//! The outcome recorder: the one writer of what a request leaves behind:
//! pins, history events, metrics, token calibration, the working set and
//! health observations. The request path calls it at each turning point
//! (rejected, attempt failed, responded, body ended) and it decides what
//! each means for every piece of state, so no two places write one thing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::attempt::{AttemptError, AttemptFailure};
use super::body::{BodyEnd, BodyOutcome};
use super::plan::PlanError;
use super::resume::Said;
use super::usage::UsageTap;
use crate::admission::Permit;
use crate::announce::Announcer;
use crate::capacity::{RunningTicket, RunningWorker};
use crate::error::ApiError;
use crate::events::{EventKind, EventLog};
use crate::fleet::health::{HealthTracker, Observation};
use crate::fleet::{InflightGuard, Replica};
use crate::metrics::{ClassLabels, Metrics, ResultLabels, WorkerMetrics};
use crate::pins::{Pin, PinOrigin, PinSource, PinTable};
use crate::policy::conversation::{response_key, KeyKind, SessionKey};
use crate::policy::{Boundary, Dialect, PrefixKey, RouteReason};
use crate::priority::Who;
use crate::sessions::gate::Happened;
use crate::state::AppState;

pub struct OutcomeRecorder {
    pins: Arc<PinTable>,
    events: Arc<EventLog>,
    /// This worker's metric handles (the recorder is built per worker).
    metrics: WorkerMetrics,
    /// Where a moved conversation's old replica is found.
    fleet: Arc<crate::fleet::Fleet>,
    /// This worker's shard of the running requests.
    running: RunningWorker,
    health: Arc<HealthTracker>,
    announcer: Arc<Announcer>,
    /// A passed boundary's mark is written again after this long (a
    /// quarter of the pin TTL): a live conversation's marks never expire.
    mark_refresh_ms: u64,
}

/// A turn as its pins see it: the routing decision (`Routed`), the
/// response head (`Responded`) and a stream continued elsewhere
/// (`OutcomeRecorder::continued`) record its pins alike.
#[derive(Clone)]
pub struct Turn {
    /// Where the request's own pin goes (None: never pinned).
    pub pin_at: Option<PrefixKey>,
    /// The boundaries it passed on the way there (keys and estimated
    /// tokens, in order): marked, so that a later turn whose tail was
    /// rewritten finds the conversation (`PinTable::passed_marks`).
    pub passed: Arc<[crate::policy::Passed]>,
    /// The longest pinned prefix the request carried.
    pub parent: Option<PrefixKey>,
    /// The conversation's explicit name, if it has one.
    pub session: Option<SessionKey>,
    pub dialect: Dialect,
    pub est_tokens: u64,
    /// When the turn began here (its session's arrival, on its first
    /// turn): its pins are recorded at that moment, the one they were
    /// announced with, so every instance dates the conversation alike
    /// (which session is the youngest).
    pub now_ms: u64,
}

/// A response head arrived: what the recorder needs to know about it.
pub struct Responded<'a> {
    pub replica: &'a Arc<Replica>,
    pub reason: RouteReason,
    pub success: bool,
    pub ttfb: Duration,
    /// Replicas this request failed on first, in order.
    pub tried: &'a [Arc<str>],
    /// The first replica failed over from, and whether this request took it down.
    pub failed_from: Option<&'a (Arc<str>, bool)>,
    pub turn: Turn,
    /// The longest pinned prefix the request carried, and its pin.
    pub pinned: Option<&'a (Boundary, Pin)>,
}

/// A routing decision, before the request is sent.
pub struct Routed<'a> {
    pub replica: &'a Arc<str>,
    pub turn: Turn,
    pub pinned: Option<&'a (Boundary, Pin)>,
}

fn result(r: &'static str) -> ResultLabels {
    ResultLabels { result: r }
}

impl OutcomeRecorder {
    pub fn new(s: &AppState) -> OutcomeRecorder {
        OutcomeRecorder {
            pins: s.pins.clone(),
            events: s.events.clone(),
            metrics: WorkerMetrics::new(s.metrics.clone()),
            fleet: s.fleet.clone(),
            running: s.capacity.running.worker(),
            health: s.health.clone(),
            announcer: s.announcer.clone(),
            mark_refresh_ms: s.config.pins.ttl_secs.saturating_mul(1_000) / 4,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        self.metrics.shared()
    }

    /// Counts a request as running on `replica` until the ticket drops.
    pub fn running(&self, replica: &Arc<str>, family: Option<PrefixKey>, est_tokens: u64) -> RunningTicket {
        self.running.begin(replica, family, est_tokens)
    }

    /// The gateway answered with an error of its own before any replica.
    pub fn rejected(&self, why: &'static str) {
        self.metrics().rejected.get_or_create(&result(why)).inc();
    }

    pub fn pin_lookup(&self, hit: bool) {
        if hit { &self.metrics.pin_hits } else { &self.metrics.pin_misses }.inc();
    }

    pub fn admission_waited(&self, replica: &Replica) {
        replica.series.admission(self.metrics(), 1, 0);
    }

    pub fn admission_rejected(&self, replica: &Replica) {
        replica.series.admission(self.metrics(), 0, 1);
    }

    /// Counts failovers from each of `tried` to `to` (None: nowhere left).
    /// A replica that left the fleet meanwhile is not counted.
    fn failovers(&self, tried: &[Arc<str>], to: Option<&Replica>) {
        for from in tried.iter().filter_map(|id| self.fleet.get(id)) {
            from.series.failover(self.metrics(), to.map(|r| &r.series));
        }
    }

    /// No plan: the request ends here, after failing on `tried` (if anywhere).
    pub fn plan_failed(&self, e: PlanError, tried: &[Arc<str>]) -> ApiError {
        match e {
            PlanError::ModelNotFound(model) => {
                self.rejected("model_not_found");
                ApiError::ModelNotFound(model)
            }
            PlanError::StoredResponse { id, replica, why, gone } => {
                self.rejected("stored_response_unavailable");
                ApiError::StoredResponseUnavailable { id, replica, why: why.to_string(), gone }
            }
            PlanError::NoReplica => {
                self.rejected("no_replica");
                self.failovers(tried, None);
                ApiError::NoReplica
            }
        }
    }

    /// An attempt ended before a response head (the rule: `attempt.rs`). A
    /// connection that failed before the write is a health observation (the
    /// replica is down now); returns true when this attempt took it down. A
    /// close after the write is re-sent but says nothing of the replica's
    /// health; `stores_response`: the request may have left a stored
    /// response there, which the history records. Other failures end the
    /// request.
    pub fn attempt_failed(
        &self,
        replica: &Replica,
        reason: RouteReason,
        e: &AttemptError,
        stores_response: bool,
    ) -> bool {
        match e.failure {
            AttemptFailure::Connect => {
                tracing::warn!(replica = %replica.id, "connection failed, failing over: {}", e.message);
                self.health.observe(
                    replica,
                    Observation::ConnectionFailed { error: e.message.clone() },
                    crate::clock::now_ms(),
                )
            }
            AttemptFailure::ClosedAfterWrite => {
                tracing::warn!(replica = %replica.id, "connection closed after the request was written; re-sending: {}", e.message);
                if stores_response {
                    let detail = "a Responses request with store: true was re-sent after its connection closed \
                                  after the write; this replica may hold a stored response no client can reach";
                    self.events.record(EventKind::Failover, Some(&replica.id), None, detail);
                }
                false
            }
            AttemptFailure::Timeout | AttemptFailure::Upstream => {
                replica.series.count_request(self.metrics(), reason, e.status_label().into());
                false
            }
        }
    }

    /// A replica was chosen: with a shared store, the pins this request
    /// will write are announced now, while the replica works, so that the
    /// conversation's next turn finds them on any instance however fast it
    /// comes (`announce.rs`). They are recorded here only once the replica
    /// answers; a request that fails leaves the others a pin to a replica
    /// that never cached the prefix, which costs the next turn what
    /// spreading it would have cost.
    pub fn routed(&self, r: &Routed) {
        if !self.announcer.enabled() {
            return;
        }
        let (replica, t) = (r.replica, &r.turn);
        let now = t.now_ms;
        if let Some(s) = t.session {
            let origin = PinOrigin { dialect: t.dialect, source: session_source(s.kind) };
            let pin = self.pins.next_pin(s.key, replica, None, t.est_tokens, now, origin);
            self.announcer.announce((s.key, Some(pin)));
        }
        let Some(pin_at) = t.pin_at else { return };
        let parent = r.pinned.map(|(_, p)| p);
        let origin = PinOrigin { dialect: t.dialect, source: PinSource::Prefix };
        let pin = self.pins.next_pin(pin_at, replica, parent, t.est_tokens, now, origin);
        let conversation = (pin.turns, pin.family);
        self.announcer.announce((pin_at, Some(pin)));
        for (key, mark) in
            self.pins.passed_marks(&t.passed, replica, conversation, now, self.mark_refresh_ms, t.dialect)
        {
            self.announcer.announce((key, Some(mark)));
        }
        if let Some((m, p)) = r.pinned.filter(|(_, p)| p.replica != *replica) {
            // The conversation moves: its parent prefix lives where it goes.
            self.announcer.announce((m.key, Some(Pin { replica: replica.clone(), last_used_ms: now, ..p.clone() })));
        }
    }

    /// A response head arrived. Records failovers, the pin (for a success),
    /// a moved conversation, and time to first byte. Returns the cached
    /// tokens the route predicts (a warm turn on its own replica).
    pub fn responded(&self, r: &Responded) -> Option<u64> {
        self.failovers(r.tried, Some(r.replica));
        if let Some((from, true)) = r.failed_from {
            self.events.record(
                EventKind::Failover,
                Some(from),
                Some(&r.replica.id),
                "connection failed before any response byte; retried",
            );
        }
        r.replica.series.route(self.metrics(), r.reason).upstream_ttfb.observe(r.ttfb.as_secs_f64());
        if !r.success {
            return None;
        }
        let t = &r.turn;
        let home = t.pin_at.and(r.pinned.map(|(m, pin)| (m, &pin.replica)));
        let predicted = match home {
            Some((m, home)) if home == &r.replica.id => Some(r.replica.calibration.estimate(m.bytes)),
            // The baselines move conversations on every turn by design;
            // history records the moves the shape policy had to make.
            Some((_, home))
                if matches!(r.reason, RouteReason::Repinned | RouteReason::Failover | RouteReason::Moved) =>
            {
                let detail = match r.reason {
                    RouteReason::Moved => format!(
                        "moved: waiting behind {} tokens of work there cost more than prefilling its context here",
                        self.fleet.get(home).map_or(0, |h| h.work.outstanding())
                    ),
                    reason => format!("{} route", reason.as_str()),
                };
                self.events.record(EventKind::PinMoved, Some(home), Some(&r.replica.id), detail);
                let why = match r.reason {
                    RouteReason::Moved => Some("queue"),
                    RouteReason::Repinned => Some("unroutable"),
                    _ => None,
                };
                if let Some(reason) = why {
                    let labels = crate::metrics::ReasonLabels { reason };
                    self.metrics.shared().session_moves.get_or_create(&labels).inc();
                }
                None
            }
            _ => None,
        };
        self.record_pins(&r.replica.id, t, t.now_ms);
        predicted
    }

    /// The turn's pins, recorded on `replica` (where it was answered): its
    /// session key's (the session lives where its latest turn went) and
    /// its prefix's; a conversation that moved is forgotten where it was
    /// (`Sessions::begin_turn` moved it if it was resident there).
    fn record_pins(&self, replica: &Arc<str>, pins: &Turn, now: u64) {
        if let Some(s) = pins.session {
            let origin = PinOrigin { dialect: pins.dialect, source: session_source(s.kind) };
            self.pins.record(s.key, replica, None, pins.est_tokens, now, origin);
        }
        let Some(pin_at) = pins.pin_at else { return };
        let origin = PinOrigin { dialect: pins.dialect, source: PinSource::Prefix };
        let recorded = self.pins.record(pin_at, replica, pins.parent, pins.est_tokens, now, origin);
        let conversation = (recorded.turns, recorded.family);
        let marks =
            self.pins.passed_marks(&pins.passed, replica, conversation, now, self.mark_refresh_ms, pins.dialect);
        self.pins.write_marks(marks);
        if let Some(old) = recorded.moved_from.and_then(|from| self.fleet.get(&from)) {
            old.residents.forget(recorded.family);
        }
    }
}

/// Where a session key's pin came from.
fn session_source(kind: KeyKind) -> PinSource {
    match kind {
        KeyKind::PromptCacheKey => PinSource::PromptCacheKey,
        KeyKind::SessionHeader => PinSource::SessionHeader,
    }
}

impl OutcomeRecorder {
    /// Reads a pinned turn's receipt: a prefix its home lost means the
    /// replica is over its wall in practice. It then takes no new session
    /// above the load it lost it at (`Residents::receipt`); said once per
    /// lowering, in history and the log.
    /// `session`: the turn's, when it is a session's (other sessions' turns
    /// that ran between its last two here: a prefix kept then was kept
    /// beside theirs).
    fn receipt(&self, replica: &Replica, predicted: u64, cached: u64, session: Option<PrefixKey>) {
        use crate::fleet::wall::Receipt;
        let before = replica.residents.evidence.wall();
        let others_between = session.map_or(0, |s| replica.residents.others_between(s));
        let receipt = replica.residents.receipt(predicted, cached, others_between, crate::clock::now_ms());
        tracing::debug!(replica = %replica.id, predicted, cached, others_between, ?receipt, "receipt read");
        match receipt {
            Receipt::Lost { load } if before.is_none_or(|w| load < w) => {
                let detail = format!(
                    "a pinned turn found {cached} of ~{predicted} cached tokens at ~{load} tokens resident: \
                     the replica did not keep the session; no new session above that load"
                );
                tracing::warn!(replica = %replica.id, "{detail}");
                self.events.record(EventKind::KvWallSeen, Some(&replica.id), None, detail);
            }
            Receipt::Unwalled { wall, load } => {
                let detail = format!(
                    "a pinned turn found its prefix after other sessions' turns at ~{load} tokens resident, \
                     above the wall at ~{wall}: the replica keeps more; wall forgotten"
                );
                tracing::info!(replica = %replica.id, "{detail}");
                self.events.record(EventKind::KvWallForgotten, Some(&replica.id), None, detail);
            }
            Receipt::Missed { load, kept_beside } => tracing::debug!(
                replica = %replica.id,
                "a pinned turn found {cached} of ~{predicted} cached tokens at ~{load} tokens resident, where \
                 sessions were kept beside others' turns at ~{kept_beside}: a miss, not a wall"
            ),
            _ => {}
        }
    }

    /// A response the replica stored (Responses API): follow-ups naming it
    /// must come back here. Persisted like any pin.
    /// `key`: the response id's, in its tenant's scope.
    /// What the session gate did (`sessions::gate::Happened`), for `who`'s
    /// request: history and metrics record each, as it happens.
    pub fn session(&self, happened: Happened, who: &Who) {
        let m = self.metrics();
        let whose = format!("class {}, client {}", who.class.as_str(), who.client);
        match happened {
            Happened::QueueFull => self.rejected("session_queue_full"),
            Happened::Held { tokens, waited, over_capacity, alone } => {
                m.session_hold.get_or_create(&ClassLabels::of(who.class)).observe(waited.as_secs_f64());
                let ms = waited.as_millis();
                let alone = if alone { " (larger than any replica: it runs alone)" } else { "" };
                if !over_capacity {
                    let detail = format!("a new session of ~{tokens} tokens ({whose}) waited {ms} ms for room{alone}");
                    self.events.record(EventKind::SessionHeld, None, None, detail);
                    return;
                }
                m.sessions_over_capacity.inc();
                tracing::warn!(tokens, waited_ms = ms as u64, "no room opened: a new session admitted over capacity");
                let detail = format!(
                    "a new session of ~{tokens} tokens ({whose}) waited {ms} ms (sessions.max_wait_ms) without room and was admitted over capacity{alone}"
                );
                self.events.record(EventKind::SessionOverCapacity, None, None, detail);
            }
            Happened::Preempted { replica, class, for_class, for_tokens } => {
                m.sessions_preempted.get_or_create(&ClassLabels::of(class)).inc();
                let detail = format!(
                    "a {} session gave its room, between its turns, to a waiting {} session of ~{for_tokens} tokens; its next turn waits for room",
                    class.as_str(),
                    for_class.as_str(),
                );
                self.events.record(EventKind::SessionPreempted, Some(&replica), None, detail);
            }
            Happened::Paused { replica, tokens, waited, class, preempted } => {
                m.session_turns_paused.get_or_create(&ClassLabels::of(class)).inc();
                let why = match preempted {
                    true => "a session of a higher class had taken its room",
                    false => "the sessions here outgrew its KV and it was the first to give way",
                };
                let detail = format!("a turn of ~{tokens} tokens ({whose}) paused {} ms: {why}", waited.as_millis());
                self.events.record(EventKind::SessionPaused, Some(&replica), None, detail);
            }
        }
    }

    /// A stream broke (`why`) after what it `said` and went on from `from`
    /// on `to`: the history says so, and the turn's pins move where the
    /// answer was finished (that replica holds its prefix now).
    pub fn continued(&self, from: &Arc<str>, to: &Replica, said: &Said, why: super::resume::Break, pins: &Turn) {
        let dialect = pins.dialect.as_str();
        let (seam, exact) = (said.seam(), if said.exact() { "true" } else { "false" });
        let detail = format!("{dialect} stream went on after {seam} tokens (exact: {exact}; {})", why.as_str());
        self.events.record(EventKind::StreamContinued, Some(from), Some(&to.id), detail);
        let labels = crate::metrics::ContinuedLabels { dialect, reason: why.as_str(), exact };
        self.metrics.shared().streams_continued.get_or_create(&labels).inc();
        // The answer was finished there: its prefix lives there now.
        self.record_pins(&to.id, pins, crate::clock::now_ms());
    }

    /// A stream broke (`why`) on `replica` and could not go on (`refused`).
    pub fn not_continued(&self, replica: &Arc<str>, refused: super::resume::Refusal, why: super::resume::Break) {
        let detail = format!("stream broke ({}) and did not go on: {}", why.as_str(), refused.as_str());
        self.events.record(EventKind::StreamNotContinued, Some(replica), None, detail);
        let labels = crate::metrics::ReasonLabels { reason: refused.as_str() };
        self.metrics.shared().streams_not_continued.get_or_create(&labels).inc();
    }

    pub fn stored_response(&self, key: PrefixKey, replica: &Arc<str>) {
        let origin = PinOrigin { dialect: Dialect::Responses, source: PinSource::Response };
        self.pins.record(key, replica, None, 0, crate::clock::now_ms(), origin);
        // The others hear of it now, not at the next flush: the follow-up
        // naming it may come to any of them right after the body ends.
        if self.announcer.enabled() {
            self.announcer.announce((key, self.pins.get(key)));
        }
    }
}

/// A large request's slots: its place in this instance's queue, and (with
/// a shared store) its fleet-wide lease. Both are released when dropped.
pub struct LargeSlot {
    pub permit: Permit,
    pub lease: Option<crate::leases::FleetLease>,
}

/// What a request holds until its body ends: its place in flight, its
/// large-context slot, its running ticket, and its session's turn.
pub struct Holdings {
    pub guard: InflightGuard,
    pub large: Option<LargeSlot>,
    pub running: RunningTicket,
    pub turn: Option<crate::sessions::SessionTurn>,
}

/// Held by the response body; reports to the recorder when the body ends,
/// however it ends, and releases the request's counters, admission slot and
/// running ticket with it.
pub struct Outcome {
    pub recorder: Arc<OutcomeRecorder>,
    pub reason: RouteReason,
    pub status: u16,
    /// The cached tokens a pinned turn should find on its home: with what
    /// the engine reports, its receipt (did the replica keep the session?).
    pub predicted_cached: Option<u64>,
    pub started: Instant,
    pub prompt_bytes: usize,
    pub held: Holdings,
    /// The request's server span, ended with the body.
    pub trace: super::trace::RequestTrace,
    /// The tenant a response it stores is pinned for (`identity.scope`).
    pub scope: crate::policy::tenancy::Scope,
    /// Its turn: its pins move with a stream continued elsewhere.
    pub turn: Turn,
}

impl Outcome {
    /// The replica serving the body (the in-flight guard holds it).
    pub fn replica(&self) -> &Arc<Replica> {
        &self.held.guard.replica
    }
}

impl BodyEnd for Outcome {
    fn continued(&mut self, to: Arc<Replica>, said: &Said, why: super::resume::Break) {
        let from = self.replica().id.clone();
        self.recorder.continued(&from, &to, said, why, &self.turn);
        // In flight and running there from now; its large-context slot and
        // session go with the request.
        self.held.running.move_to(&to.id);
        let large = self.held.guard.large();
        if let Some(turn) = &self.held.turn {
            turn.moved_to(&to);
        }
        // Counted as decoding there at once: its next leg's prefill is not
        // estimated (the answer so far is on top of the prompt).
        self.held.guard = to.resume(large);
    }

    fn not_continued(&mut self, refused: super::resume::Refusal, why: super::resume::Break) {
        self.recorder.not_continued(&self.replica().id, refused, why);
    }

    fn response_id(&mut self, id: &str) {
        self.recorder.stored_response(self.scope.key(response_key(id)), &self.replica().id);
    }

    fn first_event(&mut self) {
        let took = self.started.elapsed();
        self.held.guard.prefilled();
        let route = self.replica().series.route(self.recorder.metrics(), self.reason);
        route.first_token.observe(took.as_secs_f64());
    }

    fn finish(&mut self, outcome: BodyOutcome, usage: Option<&UsageTap>) {
        let m = &self.recorder.metrics;
        let status = match outcome {
            BodyOutcome::Complete => crate::metrics::status_label(self.status),
            BodyOutcome::UpstreamFailed => "upstream_failed".into(),
            BodyOutcome::IdleTimeout => "idle_timeout".into(),
            BodyOutcome::ClientGone => "client_gone".into(),
        };
        let series = &self.replica().series;
        let route = series.route(m.shared(), self.reason);
        route.request_duration.observe(self.started.elapsed().as_secs_f64());
        let complete = outcome == BodyOutcome::Complete;
        let succeeded = complete && (200..300).contains(&self.status);
        let measured = usage.and_then(UsageTap::usage).filter(|_| succeeded);
        self.trace.set(|| {
            use opentelemetry::KeyValue;
            let code = KeyValue::new("http.response.status_code", i64::from(self.status));
            // How the body ended, when not as its status said (client gone, ...).
            let body = (!complete).then(|| KeyValue::new("prefixgate.body", status.to_string()));
            let input = measured.map(|u| KeyValue::new("gen_ai.usage.input_tokens", u.prompt_tokens as i64));
            let cached =
                measured.and_then(|u| u.cached_tokens).map(|c| KeyValue::new("prefixgate.cached_tokens", c as i64));
            [Some(code), body, input, cached].into_iter().flatten()
        });
        series.count_request(m.shared(), self.reason, status);
        if succeeded {
            if measured.is_some() { &m.measured } else { &m.unmeasured }.inc();
            if let Some(u) = measured {
                self.replica().calibration.calibrate(self.prompt_bytes, u.prompt_tokens);
                if let (Some(predicted), Some(cached)) = (self.predicted_cached, u.cached_tokens) {
                    let session = self.held.turn.as_ref().map(crate::sessions::SessionTurn::session);
                    self.recorder.receipt(self.replica(), predicted, cached, session);
                }
                // The engine's prefill rate, for the wall's choices (`room::admit_and_pause`).
                if let (Some(cached), Some(took)) = (u.cached_tokens, self.held.guard.prefill_took()) {
                    self.replica().residents.observe_prefill(u.prompt_tokens.saturating_sub(cached), took);
                }
                route.prompt_tokens.inc_by(u.prompt_tokens);
                route.cached_tokens.inc_by(u.cached_tokens.unwrap_or(0));
            }
        }
    }
}
