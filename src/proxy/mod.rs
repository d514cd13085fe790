//! Forwarding `/v1/*` to a replica: the only place that sends client traffic
//! upstream. A request's path, top to bottom:
//! body read (bounded) -> shape extracted -> pin looked up once ->
//! plan (`plan.rs`, pure) -> admission (large contexts) -> attempt
//! (`attempt.rs`) -> response streamed back (`body.rs`), with every outcome
//! reported to the one recorder (`outcome.rs`).
//!
//! A stored response id unknown here is located before planning
//! (`locate.rs`: the shared store, then the replicas themselves).
//!
//! Failover (the rule: `attempt.rs`): a connection that failed before the
//! write marks the replica down at once and the request is planned again
//! without it; one that closed after the write is re-sent to the same
//! replica once, then planned without it. Once the response head arrived,
//! nothing is retried.

mod attempt;
mod body;
mod count;
mod headers;
mod locate;
mod lookup;
pub mod outcome;
pub mod plan;
mod resume;
pub mod trace;

pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use opentelemetry::KeyValue;

use crate::admission::Admitted;
use crate::error::ApiError;
use crate::fleet::Replica;
use crate::policy::{Dialect, Endpoint, PolicySettings, RouteReason};
use crate::sessions::gate::{Gate, Pass};
use crate::sessions::Heard;
use crate::state::AppState;
pub use attempt::Upstream;
use body::GuardedBody;
use lookup::{look_up, Hop, Lookup};
use outcome::{Holdings, LargeSlot, Outcome, OutcomeRecorder, Responded, Routed, Turn};
use plan::PlanInput;
use usage::UsageTap;

// Constants, so the names are checked once at compile time, not per request.
pub const HEADER_REPLICA: HeaderName = HeaderName::from_static("x-prefixgate-replica");
pub const HEADER_ROUTE: HeaderName = HeaderName::from_static("x-prefixgate-route");
pub const HEADER_PREDICTED_CACHED: HeaderName = HeaderName::from_static("x-prefixgate-predicted-cached-tokens");
/// On a new session that waited for room at the KV wall: how long, in ms.
pub const HEADER_HELD_MS: HeaderName = HeaderName::from_static("x-prefixgate-held-ms");

/// `POST|GET|DELETE /v1/{tail}`: everything under /v1 except `GET /v1/models`.
/// Errors come back in the shape of the API the client speaks.
pub async fn forward(
    req: HttpRequest,
    payload: web::Payload,
    upstream: web::Data<Upstream>,
    recorder: web::Data<OutcomeRecorder>,
) -> HttpResponse {
    // Borrowed from the request, not extracted: extraction clones the
    // state's `Arc`, a write to a cache line both workers share.
    let state = req.app_data::<web::Data<AppState>>().expect("app state");
    let endpoint = Endpoint::from_path(req.path());
    if let Some(refused) = refuse_client(state, &req, endpoint.dialect()) {
        return refused;
    }
    let trace = trace::RequestTrace::start(state, &req, endpoint);
    // Log lines and history events written inside a traced request carry
    // its trace id (`telemetry::WithTraceId`, `events.rs`). The future is
    // made in each arm, not once before: one made outside would be kept
    // beside its wrapped copy in the handler's state, and the handler's
    // future (allocated and moved on every request) grow by its size.
    let forwarded = match trace.context() {
        Some(cx) => {
            let h = Handles { state, upstream: &upstream, recorder: &recorder, trace: &trace };
            let forwarded = forward_request(&req, endpoint, payload, h);
            opentelemetry::context::FutureExt::with_context(forwarded, cx).await
        }
        None => {
            let h = Handles { state, upstream: &upstream, recorder: &recorder, trace: &trace };
            forward_request(&req, endpoint, payload, h).await
        }
    };
    match forwarded {
        Ok(resp) => resp,
        Err(e) => {
            let resp = e.response_for(endpoint.dialect());
            trace.failed(resp.status().as_u16(), || e.to_string());
            resp
        }
    }
}

/// The client check on `/v1` (API key, rate), run by its handlers rather
/// than a middleware: one layer less (a boxed future and a wrapped body) on
/// every request. A refusal is counted and answered in the client's API's
/// error shape.
pub fn refuse_client(state: &AppState, req: &HttpRequest, dialect: Dialect) -> Option<HttpResponse> {
    let e = state.access.check_client(req).err()?;
    state.metrics.rejected.get_or_create(&crate::metrics::ResultLabels { result: "client_access" }).inc();
    Some(e.response_for(dialect))
}

/// What every step of a request reaches: the gateway, this worker's
/// upstream client and recorder, and the request's trace.
#[derive(Clone, Copy)]
struct Handles<'a> {
    state: &'a AppState,
    upstream: &'a web::Data<Upstream>,
    recorder: &'a web::Data<OutcomeRecorder>,
    trace: &'a trace::RequestTrace,
}

/// One request, read and looked up: what its attempts send, and for whom.
struct Forwarding<'a> {
    h: Handles<'a>,
    req: &'a HttpRequest,
    body: web::Bytes,
    lookup: Lookup,
    settings: PolicySettings,
    who: crate::priority::Who,
    scope: crate::policy::tenancy::Scope,
}

/// Where a request's attempts stand (the retry rule: `attempt.rs`).
#[derive(Default)]
struct Retries {
    /// Replicas this request failed on, in order.
    tried: Vec<Arc<str>>,
    /// The first replica it failed over from, and whether this request was
    /// the one that marked it down (one event per transition).
    failed_from: Option<(Arc<str>, bool)>,
    /// The replica whose connection closed after the write once already.
    closed_once_on: Option<Arc<str>>,
    /// The next attempt, when it is the same replica once more.
    resend: Option<(Arc<Replica>, RouteReason)>,
}

impl Retries {
    /// After a retry-safe failure: a close after the write is re-sent to the
    /// same replica once, on another connection (an idle pooled connection
    /// it closed); anything else, or a second close, sends it elsewhere.
    fn failed(&mut self, replica: Arc<Replica>, reason: RouteReason, e: &attempt::AttemptError, took_down: bool) {
        let closed = e.failure == attempt::AttemptFailure::ClosedAfterWrite;
        if closed && self.closed_once_on.as_ref() != Some(&replica.id) {
            self.closed_once_on = Some(replica.id.clone());
            self.resend = Some((replica, reason));
        } else {
            self.tried.push(replica.id.clone());
            self.failed_from.get_or_insert((replica.id.clone(), took_down));
        }
    }
}

/// How long the client waited before its attempt went (the hold, a pause,
/// a large-context slot), and what the trace was last told.
#[derive(Default)]
struct Waited {
    total: Option<Duration>,
    said: Option<Duration>,
}

impl Waited {
    fn add(&mut self, waited: Duration) {
        self.total = Some(self.total.unwrap_or_default() + waited);
    }

    /// Said once, and again only if a retry waited more.
    fn say(&mut self, trace: &trace::RequestTrace) {
        if let Some(waited) = self.total.filter(|_| self.total != self.said) {
            trace.set(|| [KeyValue::new("prefixgate.held_ms", waited.as_millis() as i64)]);
            self.said = self.total;
        }
    }
}

/// The request path: read the body, look the request up once, then
/// `Forwarding::run`.
async fn forward_request(
    req: &HttpRequest,
    endpoint: Endpoint,
    payload: web::Payload,
    h: Handles<'_>,
) -> Result<HttpResponse, ApiError> {
    let config = &h.state.config;
    // Who waits at the wall (`priority.rs`): an unknown class is refused
    // before anything is read or queued.
    let header = |name: &str| priority_header(req, name);
    let who = crate::priority::resolve(&config.priority, &h.state.client_ids, header)
        .map_err(|e| ApiError::BadRequest(e.0))?;
    h.trace.set(|| {
        let client = opentelemetry::StringValue::from(who.client.clone());
        [KeyValue::new("prefixgate.priority", who.class.as_str()), KeyValue::new("prefixgate.client", client)]
    });
    let body = read_body(payload, config.limits.max_body_bytes).await?;
    let body = salted(body, endpoint, &config.identity, || h.state.client_ids.salt_of(&who.client));
    let settings = h.state.policy.get();
    let scope = crate::policy::tenancy::Scope::of(config.identity.scope, &who.client);
    let hop = Hop { state: h.state, upstream: h.upstream, recorder: h.recorder, trace: h.trace, scope };
    let lookup = look_up(req, endpoint, &body, hop, &settings).await?;
    h.trace.set(|| {
        let shape = &lookup.shape;
        let model = shape.model.as_ref().map(|m| KeyValue::new("gen_ai.request.model", m.clone()));
        [Some(KeyValue::new("prefixgate.dialect", shape.dialect.as_str())), model].into_iter().flatten()
    });
    Forwarding { h, req, body, lookup, settings, who, scope }.run().await
}

impl Forwarding<'_> {
    /// The client's request as its credentials go upstream.
    fn caller(&self) -> headers::Caller<'_> {
        headers::Caller { req: self.req, gateway_keys: !self.h.state.config.api_keys.is_empty() }
    }

    /// Through the session gate (`sessions/gate.rs`: a new session waits
    /// there while no replica has room for it), then attempts until a
    /// replica answers or nothing is left to try.
    async fn run(&self) -> Result<HttpResponse, ApiError> {
        let state = self.h.state;
        let report = |happened| self.h.recorder.session(happened, &self.who);
        let gate = Gate {
            sessions: &state.sessions,
            fleet: &state.fleet,
            store: state.shared_store_answers().then(|| state.store.as_ref()),
            preempt: state.config.priority.preempt,
            report: &report,
        };
        let mut retries = Retries::default();
        let ask = self.lookup.ask(self.settings.mode, &state.sessions, &self.who);
        let new_session = ask.is_some_and(|a| a.new);
        let mut pass = match ask {
            Some(ask) => {
                let _waiting = new_session.then(|| self.h.trace.child(state, "prefixgate.hold"));
                let plan = || self.next_target(&mut retries, true);
                // Boxed: a rare path whose future would otherwise grow every
                // request's (bench/hop-instructions.sh: a larger request future
                // cost each request ~1,000 instructions of allocator work).
                Some(Box::pin(gate.enter(ask, plan)).await?)
            }
            None => None,
        };
        let mut waited = Waited { total: pass.as_ref().and_then(|p| p.waited), said: None };
        let mut first_attempt = true;
        loop {
            let target = match pass.as_mut().and_then(|p| p.target.take()) {
                Some(target) => target,
                None => self.next_target(&mut retries, new_session)?,
            };
            let mut tokens = target.0.calibration.estimate(self.lookup.shape.prompt_bytes);
            if let Some(pass) = pass.as_ref().filter(|_| std::mem::take(&mut first_attempt)) {
                tokens = self.arrive(&gate, pass, &target.0, tokens, &mut waited).await;
            }
            let (replica, reason) = target;
            match self.attempt(&replica, tokens, pass.as_mut(), &mut waited).await? {
                Ok(out) => return Ok(self.answer(out, reason, &retries, waited.total)),
                Err(e) => {
                    let took_down =
                        self.h.recorder.attempt_failed(&replica, reason, &e, self.lookup.shape.stores_response);
                    if !e.retry_safe() {
                        return Err(e.into_api_error());
                    }
                    retries.failed(replica, reason, &e, took_down);
                }
            }
        }
    }

    /// The replica for the next attempt, and why: the same one once more, or a plan.
    fn next_target(&self, retries: &mut Retries, new_session: bool) -> Result<(Arc<Replica>, RouteReason), ApiError> {
        if let Some(again) = retries.resend.take() {
            return Ok(again);
        }
        let (state, lookup) = (self.h.state, &self.lookup);
        // The fleet is read while planning only (no guard across an await).
        let fleet = state.fleet.snapshot();
        let room = |r: &Replica| state.sessions.room_of(r);
        // A pinned turn moves only where its context fits the room (the
        // hold on or off: a move into a full pool evicts another session).
        let tokens = crate::tokens::estimate_tokens(lookup.shape.prompt_bytes);
        let link = lookup.shape.boundaries.first().map(|b| b.key);
        let fits = |r: &Replica| {
            let room = state.sessions.room_of(r);
            room.capacity.is_none() || room.fits(tokens)
        };
        let holds_shared = |id: &str| {
            lookup.shared.as_ref().is_some_and(|(key, latest)| &**latest == id || state.pins.holds(*key, id))
        };
        let input = PlanInput {
            mode: self.settings.mode,
            shape: &lookup.shape,
            pinned: lookup.pinned.as_ref(),
            named: lookup.named.as_deref(),
            holds_shared: lookup.shared.is_some().then_some(&holds_shared as &dyn Fn(&str) -> bool),
            spread: state.config.routing.spread,
            fits: lookup.pinned.is_some().then_some(&fits as &dyn Fn(&Replica) -> bool),
            stored: lookup.stored.as_ref().map(|(id, home)| (id.as_str(), &**home)),
            tried: &retries.tried,
            large: lookup.large,
            room: new_session.then_some(&room as &dyn Fn(&Replica) -> crate::sessions::Room),
            // As the gate admits it: its projection, if larger.
            session_tokens: match new_session {
                true => crate::sessions::projection::admitted_tokens(tokens, state.sessions.project(link), None),
                false => 0,
            },
        };
        let has_slot = |r: &Replica| r.large_slots.has_free_slot(r.spec().max_large_inflight);
        let route = plan::plan(&input, &fleet, has_slot, &state.spread)
            .map_err(|e| self.h.recorder.plan_failed(e, &retries.tried))?;
        let reason = if retries.failed_from.is_some() { RouteReason::Failover } else { route.reason };
        Ok((fleet[route.replica].clone(), reason))
    }

    /// A session's turn reaches its first replica: the engine's own count
    /// of it where that could change a decision (`count.rs`), then the
    /// gate's arrival (heard, its boundary, its pause). Returns its tokens.
    async fn arrive(
        &self,
        gate: &Gate<'_>,
        pass: &Pass<'_, RouteReason>,
        replica: &Arc<Replica>,
        mut tokens: u64,
        waited: &mut Waited,
    ) -> u64 {
        let (state, shape) = (self.h.state, &self.lookup.shape);
        let room = || state.sessions.room_of(replica);
        if count::worth_asking(state.sessions.settings(), replica, pass.session(), tokens, room) {
            let _counting = self.h.trace.child(state, "prefixgate.count");
            let counted = count::engine_count(self.h.upstream, replica, self.caller(), shape, &self.body);
            if let Some(count) = Box::pin(counted).await {
                tokens = count;
            }
        }
        // As its pins say: its previous turn's, else its session key's.
        let heard = || {
            let first = state.pins.get(pass.session());
            let latest = self.lookup.pinned.as_ref().map(|(_, p)| p).or(first.as_ref())?;
            Some(Heard::from_pins(latest, first.as_ref()))
        };
        if let Some(pause) = pass.arrive(gate, replica, tokens, heard) {
            let _waiting = self.h.trace.child(state, "prefixgate.pause");
            waited.add(Box::pin(pause.wait()).await);
        }
        tokens
    }

    /// One attempt on `replica`: its large-context slot, its session's turn
    /// begun, the request sent. Err: refused before sending; Ok(Err): the
    /// attempt failed (the retry rule decides).
    async fn attempt(
        &self,
        replica: &Arc<Replica>,
        tokens: u64,
        pass: Option<&mut Pass<'_, RouteReason>>,
        waited: &mut Waited,
    ) -> Result<Result<Sent, attempt::AttemptError>, ApiError> {
        let (state, recorder, shape) = (self.h.state, self.h.recorder, &self.lookup.shape);
        let started = Instant::now();
        let large = match self.lookup.large {
            true => {
                let _waiting = self.h.trace.child(state, "prefixgate.admission");
                let slot = Box::pin(admit(state, recorder, replica, &self.who)).await?;
                // A wait for a slot is a wait the client had, like the hold's.
                if started.elapsed() >= Duration::from_millis(1) {
                    waited.add(started.elapsed());
                }
                Some(slot)
            }
            false => None,
        };
        waited.say(self.h.trace);
        // The guard holds the replica from here on, and counts the prompt
        // tokens it will prefill (all but the prefix its pin says it holds).
        let cached = match &self.lookup.pinned {
            Some((m, pin)) if pin.replica == replica.id => replica.calibration.estimate(m.bytes),
            _ => 0,
        };
        let guard = replica.begin(self.lookup.large, tokens.saturating_sub(cached));
        // The conversation it belongs to, as the working set knows it: its
        // session's id (a pinned turn's is its pin's family), else where it would pin.
        let family = pass.as_ref().map(|p| p.session()).or(shape.pin_at);
        let running = recorder.running(&replica.id, family, tokens);
        // Resident from this turn on; idle only once it ended. The pins
        // announced below carry the same moment: the other instances take
        // it as the session's arrival, so all agree which one is youngest.
        let now_ms = crate::clock::now_ms();
        let turn = pass.map(|p| p.begin(&state.sessions, replica, tokens, now_ms));
        let pinned = self.lookup.pinned.as_ref();
        let pin_turn = Turn {
            pin_at: shape.pin_at,
            passed: shape.passed().into(),
            parent: pinned.map(|(m, _)| m.key),
            session: self.lookup.session,
            dialect: shape.dialect,
            est_tokens: tokens,
            now_ms,
        };
        recorder.routed(&Routed { replica: &replica.id, turn: pin_turn.clone(), pinned });
        let mut request = self.h.upstream.request(&replica.spec(), self.caller());
        // The engine continues the trace under this attempt's span (the
        // client's own traceparent names the gateway's server span's parent).
        let (span, carried) = self.h.trace.attempt(state, &replica.id);
        for (name, value) in carried {
            request = request.insert_header((name, value));
        }
        let held = Holdings { guard, large, running, turn };
        let continuable = self.continuable(replica);
        let body = match continuable {
            Some(resume::Continuable::Yes { ask_ids: true, .. }) => {
                resume::ask_for_ids(&self.body).unwrap_or_else(|| self.body.clone())
            }
            _ => self.body.clone(),
        };
        Ok(match attempt::send(request, body).await {
            Ok(resp) => {
                trace::attempt_ended(&span, Ok(resp.status().as_u16()));
                Ok(Sent { resp, held, started, turn: pin_turn, continuable })
            }
            Err(e) => {
                trace::attempt_ended(&span, Err((&e.message, e.retry_safe())));
                Err(e)
            }
        })
    }

    /// Whether this request's stream may be continued elsewhere should it
    /// break (`resume/`; None: not a stream, or `failover.continue_streams`
    /// is off).
    fn continuable(&self, replica: &Replica) -> Option<resume::Continuable> {
        let shape = &self.lookup.shape;
        (shape.streamed && self.h.state.config.failover.continue_streams)
            .then(|| resume::continuable(&shape.stream, shape.dialect, replica.calibration.asks_token_ids()))
    }

    /// A stream's continuation, should it break (`resume/continuation.rs`):
    /// its relay, or why it is refused; what its next leg is made from is
    /// kept, not built (`resume::Seed`).
    fn continuation(&self, continuable: resume::Continuable, on: &Arc<Replica>) -> resume::Continuation {
        let failover = &self.h.state.config.failover;
        let limits =
            resume::Limits { stall: Duration::from_millis(failover.stall_ms), max_legs: failover.max_continuations };
        let (relay, asked_ids) = match continuable {
            resume::Continuable::No(refused) => (Err(refused), false),
            resume::Continuable::Yes { way, ask_ids, usage } => {
                (Ok(resume::Relay::new(self.lookup.shape.dialect, way, ask_ids).with_client_usage(usage)), ask_ids)
            }
        };
        let seed = resume::Seed {
            req: self.req.clone(),
            body: self.body.clone(),
            mode: self.settings.mode,
            trace: self.h.trace.clone(),
        };
        resume::Continuation::new(relay, on, asked_ids, limits, seed)
    }

    /// The response head arrived: recorded, and streamed back to the client.
    fn answer(&self, sent: Sent, reason: RouteReason, retries: &Retries, waited: Option<Duration>) -> HttpResponse {
        let Sent { resp, held, started, turn, continuable } = sent;
        let continuation = continuable.map(|c| self.continuation(c, &held.guard.replica));
        let recorder = self.h.recorder;
        let replica = &held.guard.replica;
        let predicted_cached = recorder.responded(&Responded {
            replica,
            reason,
            success: resp.status().is_success(),
            ttfb: started.elapsed(),
            tried: &retries.tried,
            failed_from: retries.failed_from.as_ref(),
            turn: turn.clone(),
            pinned: self.lookup.pinned.as_ref(),
        });
        self.h.trace.set(|| {
            let predicted = predicted_cached.map(|p| KeyValue::new("prefixgate.predicted_cached_tokens", p as i64));
            let route = KeyValue::new("prefixgate.route", reason.as_str());
            let replica = KeyValue::new("prefixgate.replica", opentelemetry::StringValue::from(replica.id.clone()));
            [Some(route), Some(replica), predicted].into_iter().flatten()
        });
        let outcome = Outcome {
            recorder: recorder.clone().into_inner(),
            reason,
            status: resp.status().as_u16(),
            predicted_cached,
            started,
            prompt_bytes: self.lookup.shape.prompt_bytes,
            held,
            trace: self.h.trace.clone(),
            scope: self.scope,
            turn,
        };
        let idle = Duration::from_millis(self.h.state.config.timeouts.idle_stream_ms);
        let mut out = respond(resp, outcome, idle, self.lookup.shape.dialect, continuation);
        if let Some(waited) = waited {
            out.headers_mut().insert(HEADER_HELD_MS, HeaderValue::from(waited.as_millis() as u64));
        }
        out
    }
}

/// An attempt whose response head arrived, with what it holds until its body ends.
struct Sent {
    resp: attempt::UpstreamResponse,
    held: Holdings,
    started: Instant,
    turn: Turn,
    /// Whether its stream may be continued elsewhere should it break.
    continuable: Option<resume::Continuable>,
}

/// The body as forwarded: with `identity.cache_salt = "client"`, a request
/// to a dialect the engines salt (chat, completions, Responses, Messages)
/// that carries no `cache_salt` gets its client's (`tenancy.rs`): one
/// of the two edits the gateway makes to a body (the README lists both; the
/// other is continuation's `return_token_ids`).
fn salted(
    body: web::Bytes,
    endpoint: Endpoint,
    identity: &crate::config::IdentityConfig,
    salt: impl FnOnce() -> Arc<str>,
) -> web::Bytes {
    use crate::policy::tenancy::{with_cache_salt, CacheSalt};
    if identity.cache_salt == CacheSalt::None || endpoint == Endpoint::Other {
        return body;
    }
    match with_cache_salt(&body, &salt()) {
        Some(edited) => web::Bytes::from(edited),
        None => body,
    }
}

/// A header `priority::resolve` asks for. Its own names are made once:
/// `get` with a string that is no standard header's name builds the name
/// anew (an allocation each, three a request).
fn priority_header<'r>(req: &'r HttpRequest, name: &str) -> Option<&'r str> {
    use actix_web::http::header::HeaderName;
    static NAMES: std::sync::LazyLock<[HeaderName; 4]> = std::sync::LazyLock::new(|| {
        use crate::priority::{CLIENT_HEADER, PRIORITY_HEADER, SMG_HEADER};
        [PRIORITY_HEADER, SMG_HEADER, CLIENT_HEADER, "x-api-key"].map(HeaderName::from_static)
    });
    let value = match NAMES.iter().find(|n| n.as_str() == name) {
        Some(known) => req.headers().get(known),
        None => req.headers().get(name),
    };
    value.and_then(|v| v.to_str().ok())
}

/// Waits for a large-context slot on `replica`: this instance's FIFO queue
/// first, then the fleet-wide lease, all within `admission.wait_ms`.
async fn admit(
    state: &AppState,
    recorder: &OutcomeRecorder,
    replica: &Arc<Replica>,
    who: &crate::priority::Who,
) -> Result<LargeSlot, ApiError> {
    let r = replica.clone();
    let limit = Arc::new(move || r.spec().max_large_inflight);
    let cfg = &state.config.admission;
    let started = tokio::time::Instant::now();
    let wait = Duration::from_millis(cfg.wait_ms);
    let local = replica.large_slots.acquire(&replica.id, who, limit, wait, cfg.max_queue).await;
    let fleet = match (&local, replica.spec().max_large_inflight) {
        // A store that stopped answering is not asked: the local limit applies alone.
        (Ok(_), Some(n)) if state.shared_store_answers() => {
            let left = wait.saturating_sub(started.elapsed());
            state.leases.acquire(&state.store, &replica.id, n, left).await
        }
        _ => Ok((None, false)),
    };
    match (local, fleet) {
        (Ok((permit, how)), Ok((lease, waited))) => {
            if how == Admitted::AfterWaiting || waited {
                recorder.admission_waited(replica);
            }
            Ok(LargeSlot { permit, lease })
        }
        (Err(e), _) | (_, Err(e)) => {
            recorder.admission_rejected(replica);
            Err(e.into())
        }
    }
}

/// The whole request body, at most `limit` bytes. A body that arrives in
/// one chunk (most do) is that chunk itself: nothing is copied.
async fn read_body(mut payload: web::Payload, limit: usize) -> Result<web::Bytes, ApiError> {
    let mut first = web::Bytes::new();
    let mut joined: Option<web::BytesMut> = None;
    while let Some(chunk) = payload.next().await {
        let chunk = chunk?;
        let so_far = joined.as_ref().map_or(first.len(), |j| j.len());
        if so_far + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        match joined.as_mut() {
            Some(j) => j.extend_from_slice(&chunk),
            None if first.is_empty() => first = chunk,
            None => {
                let mut j = web::BytesMut::with_capacity(first.len() + chunk.len());
                j.extend_from_slice(&first);
                j.extend_from_slice(&chunk);
                joined = Some(j);
            }
        }
    }
    Ok(joined.map_or(first, web::BytesMut::freeze))
}

fn respond(
    resp: attempt::UpstreamResponse,
    outcome: Outcome,
    idle: Duration,
    dialect: Dialect,
    continuation: Option<resume::Continuation>,
) -> HttpResponse {
    let predicted_cached = outcome.predicted_cached;
    let status = resp.status();
    let mut out = HttpResponse::build(status);
    headers::copy_response_headers(resp.headers(), &mut out);
    out.insert_header((HEADER_REPLICA, outcome.replica().name_header.clone()));
    out.insert_header((HEADER_ROUTE, HeaderValue::from_static(outcome.reason.as_str())));
    if let Some(n) = predicted_cached {
        out.insert_header((HEADER_PREDICTED_CACHED, HeaderValue::from(n)));
    }
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let expected =
        resp.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let tap = status.is_success().then(|| UsageTap::new(dialect, sse, expected));
    // An SSE error reply (non-2xx) carries no [DONE]: only check successful streams.
    let sse_checked = sse && status.is_success();
    let framing = (idle, sse_checked, expected);
    let body = GuardedBody::new(resp, framing, tap, outcome, continuation.filter(|_| sse_checked));
    // The body's own size frames the reply: with a length, the HTTP encoder
    // writes Content-Length itself and never chunks, so a client sees a body
    // cut short as short, whatever its HTTP library does with chunked
    // encoding. (`streaming` would format the length into a header, parse it
    // back and format it again, and invent a Content-Type the upstream did
    // not send.)
    match expected {
        Some(len) => out.body(actix_web::body::SizedStream::new(len, body)),
        None => out.body(actix_web::body::BodyStream::new(body)),
    }
}

#[cfg(test)]
mod tests {
    use actix_web::{test::TestRequest, FromRequest};

    use super::*;

    /// The handler's payload, fed in the given chunks.
    async fn payload(chunks: &[&'static [u8]]) -> web::Payload {
        let (mut sender, h1) = actix_http::h1::Payload::create(false);
        for c in chunks {
            sender.feed_data(web::Bytes::from_static(c));
        }
        sender.feed_eof();
        let (req, _) = TestRequest::default().to_http_parts();
        web::Payload::from_request(&req, &mut actix_web::dev::Payload::from(h1)).await.unwrap()
    }

    #[actix_web::test]
    async fn a_body_is_read_whole_from_any_number_of_chunks_and_bounded() {
        let one = read_body(payload(&[b"{\"a\":1}"]).await, 100).await.unwrap();
        assert_eq!(&one[..], b"{\"a\":1}");
        let three = read_body(payload(&[b"{\"a\"", b":", b"1} "]).await, 100).await.unwrap();
        assert_eq!(&three[..], b"{\"a\":1} ");
        assert!(read_body(payload(&[]).await, 100).await.unwrap().is_empty());
        let at_limit = read_body(payload(&[b"12345", b"67890"]).await, 10).await.unwrap();
        assert_eq!(&at_limit[..], b"1234567890");
        let over_limit: [&[&'static [u8]]; 2] = [&[b"12345678901"], &[b"123456", b"78901"]];
        for chunks in over_limit {
            let over = read_body(payload(chunks).await, 10).await;
            assert!(matches!(over, Err(ApiError::BodyTooLarge { limit: 10 })), "{chunks:?}");
        }
    }
}
