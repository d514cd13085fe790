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
mod hold;
mod locate;
mod lookup;
pub mod outcome;
pub mod plan;
pub mod trace;
mod upstream;
pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use opentelemetry::KeyValue;

use crate::admission::{Admitted, Permit};
use crate::error::ApiError;
use crate::fleet::Replica;
use crate::policy::{Dialect, Endpoint, PolicySettings, RouteReason};
use crate::sessions::Heard;
use crate::state::AppState;
use body::GuardedBody;
use lookup::{look_up, Hop, Lookup};
use outcome::{Outcome, OutcomeRecorder, Responded, Routed, Turn};
use plan::PlanInput;
pub use upstream::Upstream;
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
            let forwarded = forward_request(&req, endpoint, payload, state, upstream, recorder, &trace);
            opentelemetry::context::FutureExt::with_context(forwarded, cx).await
        }
        None => forward_request(&req, endpoint, payload, state, upstream, recorder, &trace).await,
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

/// The replica for the next attempt, and why: the same one once more, or a plan.
fn next_target(
    state: &AppState,
    settings: &PolicySettings,
    lookup: &Lookup,
    retries: &mut Retries,
    recorder: &OutcomeRecorder,
    new_session: bool,
) -> Result<(Arc<Replica>, RouteReason), ApiError> {
    if let Some(again) = retries.resend.take() {
        return Ok(again);
    }
    // The fleet is read while planning only (no guard across an await).
    let fleet = state.fleet.snapshot();
    let room = |r: &Replica| state.sessions.room_of(r);
    let input = PlanInput {
        mode: settings.mode,
        shape: &lookup.shape,
        pinned: lookup.pinned.as_ref(),
        named: lookup.named.as_deref(),
        stored: lookup.stored.as_ref().map(|(id, home)| (id.as_str(), &**home)),
        tried: &retries.tried,
        large: lookup.large,
        room: new_session.then_some(&room as &dyn Fn(&Replica) -> crate::sessions::Room),
    };
    let has_slot = |r: &Replica| r.large_slots.has_free_slot(r.spec().max_large_inflight);
    let route =
        plan::plan(&input, &fleet, has_slot, &state.spread).map_err(|e| recorder.plan_failed(e, &retries.tried))?;
    let reason = if retries.failed_from.is_some() { RouteReason::Failover } else { route.reason };
    Ok((fleet[route.replica].clone(), reason))
}

/// The request path: look the request up once, then plan and attempt until
/// a replica answers or nothing is left to try.
async fn forward_request(
    req: &HttpRequest,
    endpoint: Endpoint,
    payload: web::Payload,
    state: &AppState,
    upstream: web::Data<Upstream>,
    recorder: web::Data<OutcomeRecorder>,
    trace: &trace::RequestTrace,
) -> Result<HttpResponse, ApiError> {
    let config = &state.config;
    // Who waits at the wall (`priority.rs`): an unknown class is refused
    // before anything is read or queued.
    let header = |name: &str| priority_header(req, name);
    let who = crate::priority::resolve(&config.priority, header).map_err(|e| ApiError::BadRequest(e.0))?;
    trace.set(|| {
        let client = opentelemetry::StringValue::from(who.client.clone());
        [KeyValue::new("prefixgate.priority", who.class.as_str()), KeyValue::new("prefixgate.client", client)]
    });
    let body = salted(read_body(payload, config.limits.max_body_bytes).await?, endpoint, &config.identity, &who);
    let settings = state.policy.get();
    let scope = crate::policy::tenancy::Scope::of(config.identity.scope, &who.client);
    let hop = Hop { state, upstream: &upstream, recorder: &recorder, trace, scope };
    let lookup = look_up(req, endpoint, &body, hop, &settings).await?;
    let Lookup { shape, session, large, pinned, .. } = &lookup;
    trace.set(|| {
        let model = shape.model.as_ref().map(|m| KeyValue::new("gen_ai.request.model", m.clone()));
        [Some(KeyValue::new("prefixgate.dialect", shape.dialect.as_str())), model].into_iter().flatten()
    });
    // A new session waits here while no replica has room for it (the KV
    // wall, `sessions/`); a turn of a resident one may pause below, before
    // its first attempt, when its replica is crossed.
    let of_session = hold::session_of(&lookup, &settings, state);
    let new_session = of_session.is_some_and(|s| s.new);
    let mut retries = Retries::default();
    // A new session's reservation counts against the room until its first
    // turn is resident (below).
    let (mut placed, (mut held_for, mut reservation)) = match of_session.filter(|s| s.new) {
        Some(s) => {
            let _waiting = trace.child(state, "prefixgate.hold");
            // Boxed: a rare path whose future would otherwise grow every
            // request's (bench/hop-instructions.sh: a larger request future
            // cost each request ~1,000 instructions of allocator work).
            Box::pin(place_new_session(state, &settings, &lookup, &mut retries, &recorder, s.id, &who)).await?
        }
        None => (None, (None, None)),
    };
    let mut first_attempt = true;
    let mut held_said: Option<Duration> = None;
    loop {
        let (replica, reason) = match placed.take() {
            Some(target) => target,
            None => next_target(state, &settings, &lookup, &mut retries, &recorder, new_session)?,
        };
        let mut est_tokens = replica.calibration.estimate(shape.prompt_bytes);
        let room = || state.sessions.room_of(&replica);
        let worth =
            |s: &hold::SessionTurn| count::worth_asking(state.sessions.settings(), &replica, s.id, est_tokens, room);
        if first_attempt && of_session.as_ref().is_some_and(worth) {
            // The engine's own count of this turn, before it runs (`count.rs`).
            let _counting = trace.child(state, "prefixgate.count");
            let keys = !config.api_keys.is_empty();
            let counted = count::engine_count(&upstream, &replica, req, keys, shape.dialect, &body, shape.prompt_bytes);
            if let Some(count) = Box::pin(counted).await {
                est_tokens = count;
            }
        }
        if std::mem::take(&mut first_attempt) {
            // A session resident nowhere here (served by another instance
            // until now) is resident from its first turn on, as every
            // instance counts it. The replica's own record is asked first:
            // the sessions' index is one lock for every request. (One
            // resident on another replica moves at `begin_turn`, with all
            // it learned.)
            let here = |id| replica.residents.contains(id);
            let now = crate::clock::now_ms();
            if let Some(s) = of_session.filter(|s| !s.new && !here(s.id) && !state.sessions.is_resident(s.id)) {
                // As its pins say: its previous turn's, else its session key's.
                let first = state.pins.get(s.id);
                let heard = match pinned.as_ref().map(|(_, p)| p).or(first.as_ref()) {
                    Some(latest) => Heard::from_pins(latest, first.as_ref()),
                    None => Heard { tokens: est_tokens, arrived_ms: now, ..Heard::default() },
                };
                // Resident at its previous turn's context as of now: this
                // turn, beginning, says what it added (and, its second,
                // that it continued).
                let heard = Heard { tokens: heard.tokens.min(est_tokens), last_ms: now, ..heard };
                state.sessions.seen_elsewhere(&replica, s.id, heard);
            }
            // Its turn boundary: a held session of a higher class may take its room now.
            if let Some(s) = of_session.filter(|s| !s.new) {
                hold::yield_at_boundary(state, &replica, s.id, shape.model.as_deref());
            }
            // A resident session's turn pauses here, before it starts, while
            // its replica's sessions outgrew the KV and it is the youngest there.
            if let Some(s) = of_session.filter(|s| !s.new && state.sessions.must_pause(&replica, s.id, est_tokens, now))
            {
                let _waiting = trace.child(state, "prefixgate.pause");
                if let Some(paused) = Box::pin(hold::pause_if_over(state, &replica, s.id, est_tokens, &who)).await {
                    held_for = Some(held_for.unwrap_or_default() + paused);
                }
            }
        }
        let started = Instant::now();
        let permit = match large {
            true => {
                let _waiting = trace.child(state, "prefixgate.admission");
                let permit = Box::pin(admit(state, &recorder, &replica, &who)).await?;
                // A wait for a slot is a wait the client had, like the hold's.
                let waited = started.elapsed();
                if waited >= Duration::from_millis(1) {
                    held_for = Some(held_for.unwrap_or_default() + waited);
                }
                Some(permit)
            }
            false => None,
        };
        // Said once, and again only if a retry waited more.
        if let Some(waited) = held_for.filter(|_| held_for != held_said) {
            trace.set(|| [KeyValue::new("prefixgate.held_ms", waited.as_millis() as i64)]);
            held_said = held_for;
        }
        // The guard holds the replica from here on (one reference, not two).
        let guard = replica.begin(*large);
        let replica = &guard.replica;
        // The conversation it belongs to, as the working set knows it: its
        // session's id (a pinned turn's is its pin's family), else where it would pin.
        let family = of_session.map(|s| s.id).or(shape.pin_at);
        let ticket = recorder.running(&replica.id, family, est_tokens);
        // Resident from this turn on; idle only once it ended. The pins
        // announced below carry the same moment: the other instances take
        // it as the session's arrival, so all agree which one is youngest
        // (the one whose turns pause when the replica is crossed).
        let now_ms = crate::clock::now_ms();
        let turn = of_session.map(|s| {
            let link = hold::first_link(&lookup);
            state.sessions.begin_turn(replica, s.id, link, est_tokens, &who, now_ms)
        });
        drop(reservation.take());
        let pin_turn = Turn {
            pin_at: shape.pin_at,
            pinned: pinned.as_ref(),
            session: *session,
            dialect: shape.dialect,
            est_tokens,
            now_ms,
        };
        recorder.routed(&Routed { replica: &replica.id, turn: pin_turn });
        let mut request = upstream.request(&replica.spec(), req, !config.api_keys.is_empty());
        // The engine continues the trace under this attempt's span (the
        // client's own traceparent names the gateway's server span's parent).
        let (attempt_span, carried) = trace.attempt(state, &replica.id);
        for (name, value) in carried {
            request = request.insert_header((name, value));
        }
        match attempt::send(request, body.clone()).await {
            Ok(resp) => {
                trace::attempt_ended(&attempt_span, Ok(resp.status().as_u16()));
                let predicted_cached = recorder.responded(&Responded {
                    replica,
                    reason,
                    success: resp.status().is_success(),
                    ttfb: started.elapsed(),
                    tried: &retries.tried,
                    failed_from: retries.failed_from.as_ref(),
                    turn: pin_turn,
                });
                trace.set(|| {
                    let predicted =
                        predicted_cached.map(|p| KeyValue::new("prefixgate.predicted_cached_tokens", p as i64));
                    let route = KeyValue::new("prefixgate.route", reason.as_str());
                    let replica =
                        KeyValue::new("prefixgate.replica", opentelemetry::StringValue::from(replica.id.clone()));
                    [Some(route), Some(replica), predicted].into_iter().flatten()
                });
                let outcome = Outcome {
                    recorder: recorder.into_inner(),
                    reason,
                    status: resp.status().as_u16(),
                    predicted_cached,
                    started,
                    prompt_bytes: shape.prompt_bytes,
                    held: (guard, permit, ticket, turn),
                    trace: trace.clone(),
                    scope,
                };
                let idle = Duration::from_millis(config.timeouts.idle_stream_ms);
                let name = outcome.replica().name_header.clone();
                let mut out = respond(resp, outcome, name, predicted_cached, idle, shape.dialect);
                if let Some(waited) = held_for {
                    out.headers_mut().insert(HEADER_HELD_MS, HeaderValue::from(waited.as_millis() as u64));
                }
                return Ok(out);
            }
            Err(e) => {
                trace::attempt_ended(&attempt_span, Err((&e.message, e.retry_safe())));
                let replica = replica.clone();
                drop((guard, permit, ticket, turn));
                let took_down = recorder.attempt_failed(&replica, reason, &e, shape.stores_response);
                if !e.retry_safe() {
                    return Err(e.into_api_error());
                }
                retries.failed(replica, reason, &e, took_down);
            }
        }
    }
}

/// The body as forwarded: with `identity.cache_salt = "client"`, a request
/// to a dialect the engines salt (chat, completions, Responses, Messages)
/// that carries no `cache_salt` gets its client's (`tenancy.rs`). The one
/// edit the gateway makes to a body; every other body goes byte for byte.
fn salted(
    body: web::Bytes,
    endpoint: Endpoint,
    identity: &crate::config::IdentityConfig,
    who: &crate::priority::Who,
) -> web::Bytes {
    use crate::policy::tenancy::{cache_salt_for, with_cache_salt, CacheSalt};
    if identity.cache_salt == CacheSalt::None || endpoint == Endpoint::Other {
        return body;
    }
    match with_cache_salt(&body, &cache_salt_for(&who.client)) {
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

/// A new session's first target: held while no replica has room (`hold.rs`),
/// then placed where the most room is (ties broken fleet-wide by the fewest
/// sessions), and (with a shared store) admitted there atomically: another
/// instance that took the last room first sends it back to wait. Returns
/// the target and how long it waited, if it did.
async fn place_new_session(
    state: &AppState,
    settings: &PolicySettings,
    lookup: &Lookup,
    retries: &mut Retries,
    recorder: &OutcomeRecorder,
    session: crate::policy::PrefixKey,
    who: &crate::priority::Who,
) -> Result<(Option<(Arc<Replica>, RouteReason)>, hold::Admission), ApiError> {
    // Admitted against what it will hold, not only its first turn.
    let tokens = hold::admitted_tokens(state, lookup, crate::tokens::estimate_tokens(lookup.shape.prompt_bytes));
    let max_wait = Duration::from_millis(state.sessions.settings().max_wait_ms);
    let started = Instant::now();
    let mut waited: Option<Duration> = None;
    loop {
        let (w, reservation) = hold::hold_if_full(state, lookup, tokens, who).await?;
        if let Some(w) = w {
            waited = Some(waited.unwrap_or_default() + w);
        }
        if !state.shared_store_answers() {
            // This instance's view decides: chosen and placed in one step.
            let _placing = state.sessions.placing();
            let (target, reason) = next_target(state, settings, lookup, retries, recorder, true)?;
            if let Some(r) = &reservation {
                r.place(&target.id);
            }
            return Ok((Some((target, reason)), (waited, reservation)));
        }
        let (target, reason) = next_target(state, settings, lookup, retries, recorder, true)?;
        // Past the wait (or with the hold off), placed without a capacity check.
        let enforce = !max_wait.is_zero() && started.elapsed() < max_wait;
        if let Some(placed) =
            hold::place_in_store(state, lookup, &target, &retries.tried, session, tokens, enforce).await
        {
            if let Some(r) = &reservation {
                r.place(&placed.id);
            }
            return Ok((Some((placed, reason)), (waited, reservation)));
        }
        tracing::debug!(replica = %target.id, "another instance took the last room first: waiting again");
        tokio::time::sleep(crate::sessions::RECHECK).await;
    }
}

/// A large request's slots: its place in this instance's queue, and (with a
/// shared store) its fleet-wide lease. Both are released when dropped.
type LargeSlot = (Permit, Option<crate::leases::FleetLease>);

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
            Ok((permit, lease))
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
    resp: awc::ClientResponse<
        impl futures_util::Stream<Item = Result<web::Bytes, actix_web::error::PayloadError>> + Unpin + 'static,
    >,
    outcome: Outcome,
    replica_name: HeaderValue,
    predicted_cached: Option<u64>,
    idle: Duration,
    dialect: Dialect,
) -> HttpResponse {
    let status = resp.status();
    let mut out = HttpResponse::build(status);
    headers::copy_response_headers(resp.headers(), &mut out);
    out.insert_header((HEADER_REPLICA, replica_name));
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
    let body = GuardedBody::new(resp, idle, sse_checked, expected, tap, outcome);
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
