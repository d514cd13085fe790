//! Forwarding `/v1/*` to a replica: the only place that sends client traffic
//! upstream. Flow: body read (bounded) -> shape extracted -> policy decides ->
//! request forwarded byte-for-byte -> response streamed back -> outcome
//! recorded (pins, counters, metrics, usage).
//!
//! Failover: a connection failure *before any response byte* marks the
//! replica down at once and the same request is retried elsewhere (the
//! OpenAI endpoints are stateless; a request that never reached an engine is
//! safe to re-send). Once the response head arrived, nothing is retried.

mod body;
mod headers;
pub mod usage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::http::header::{self, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse};
use awc::error::SendRequestError;
use futures_util::StreamExt;

use crate::admission::{Admitted, Permit};
use crate::capacity::{CapacityTracker, RunningTicket};
use crate::error::ApiError;
use crate::events::EventKind;
use crate::fleet::{Health, InflightGuard, Replica};
use crate::gateway::Gateway;
use crate::metrics::{FailoverLabels, RequestLabels, ResultLabels, RouteLabels};
use crate::policy::{self, Candidate, Endpoint, Mode, RouteReason};
use body::{BodyEnd, BodyOutcome, GuardedBody};
use usage::UsageTap;

pub const HEADER_REPLICA: &str = "x-prefixgate-replica";
pub const HEADER_ROUTE: &str = "x-prefixgate-route";
pub const HEADER_PREDICTED_CACHED: &str = "x-prefixgate-predicted-cached-tokens";

/// One awc client per actix worker (awc is `!Send`), built in the app factory.
pub struct Upstream(pub awc::Client);

/// awc's connector with TCP_NODELAY on every upstream socket. Without it,
/// awc's separate writes of head and body meet Nagle's algorithm and the
/// peer's delayed ACK: ~40 ms added to every request on loopback.
pub fn connector(
    connect_timeout: Duration,
) -> awc::Connector<
    impl actix_service::Service<
            actix_tls::connect::ConnectInfo<awc::http::Uri>,
            Response = actix_tls::connect::Connection<awc::http::Uri, tokio::net::TcpStream>,
            Error = actix_tls::connect::ConnectError,
        > + Clone,
> {
    use actix_service::ServiceExt;
    let tcp = actix_tls::connect::Connector::new(actix_tls::connect::Resolver::default()).service();
    let tcp = tcp.map(|conn: actix_tls::connect::Connection<awc::http::Uri, tokio::net::TcpStream>| {
        let _ = conn.io_ref().set_nodelay(true);
        conn
    });
    awc::Connector::new().connector(tcp).timeout(connect_timeout)
}

impl Upstream {
    pub fn new(gw: &Gateway) -> Upstream {
        let t = &gw.config.timeouts;
        let connector = connector(Duration::from_millis(t.connect_ms))
            // No pool cap: a thousand concurrent streams is a normal day.
            .limit(0);
        Upstream(
            awc::Client::builder()
                .connector(connector)
                .no_default_headers()
                .disable_redirects()
                // awc's default of 5 s would kill a slow first token; this
                // bounds sending plus the response head only.
                .timeout(Duration::from_millis(t.response_head_ms))
                .finish(),
        )
    }
}

/// `POST|GET /v1/{tail}`: everything under /v1 except `GET /v1/models`.
pub async fn forward(
    req: HttpRequest,
    payload: web::Payload,
    gw: web::Data<Gateway>,
    upstream: web::Data<Upstream>,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(payload, gw.config.limits.max_body_bytes).await?;
    let settings = gw.policy();
    let endpoint = Endpoint::from_path(req.path());
    let shape = policy::identity::extract(endpoint, &body, settings.identity).map_err(|e| {
        gw.metrics.rejected.get_or_create(&ResultLabels { result: "bad_request".into() }).inc();
        ApiError::BadRequest(e.0)
    })?;
    // The large/small decision uses the documented default ratio: it is
    // made before a replica (and its calibrated ratio) is chosen.
    let large = crate::tokens::estimate_tokens(shape.prompt_bytes) >= gw.config.admission.large_context_tokens;

    let mut tried: Vec<Arc<str>> = Vec::new();
    // The first replica this request failed over from, and whether this
    // request was the one that marked it down (one event per transition).
    let mut failed_from: Option<(Arc<str>, bool)> = None;
    loop {
        let fleet = gw.fleet.snapshot();
        if let Some(model) = shape.model.as_deref() {
            if !fleet.is_empty() && !fleet.iter().any(|r| r.serves(model)) {
                gw.metrics.rejected.get_or_create(&ResultLabels { result: "model_not_found".into() }).inc();
                return Err(ApiError::ModelNotFound(model.to_string()));
            }
        }
        let candidates: Vec<Candidate> = fleet
            .iter()
            .map(|r| Candidate {
                id: &r.id,
                routable: r.routable() && shape.model.as_deref().is_none_or(|m| r.serves(m)) && !tried.contains(&r.id),
                spare: !large || gw.admission.has_free_slot(&r.id, r.spec().max_large_inflight),
            })
            .collect();
        let Some(decision) = policy::decide(settings.mode, &shape, &candidates, |k| gw.pins.replica_of(k), &gw.spread)
        else {
            gw.metrics.rejected.get_or_create(&ResultLabels { result: "no_replica".into() }).inc();
            for from in &tried {
                let labels = FailoverLabels { from: from.to_string(), to: "none".into() };
                gw.metrics.failovers.get_or_create(&labels).inc();
            }
            return Err(ApiError::NoReplica);
        };
        if settings.mode == Mode::Shape && shape.multi_unit && tried.is_empty() {
            let result = if decision.matched.is_some() { "hit" } else { "miss" };
            gw.metrics.pin_lookups.get_or_create(&ResultLabels { result: result.into() }).inc();
        }
        let replica = fleet[decision.replica].clone();
        let reason = if failed_from.is_some() { RouteReason::Failover } else { decision.reason };
        let started = Instant::now();
        let permit = if large { Some(admit(&gw, &replica).await?) } else { None };
        let guard = replica.begin(large);
        let est_tokens = gw.capacity.estimate(&replica.id, shape.prompt_bytes);
        // The matched pin, read once: its family (for the working set) and
        // its home (to tell a warm turn from a moved conversation).
        let matched_pin = decision.matched.and_then(|m| gw.pins.get(m.key));
        let family = matched_pin.as_ref().map(|p| p.family).or(shape.pin_at);
        let ticket = CapacityTracker::begin(&gw.clone().into_inner(), &replica.id, family, est_tokens);
        let spec = replica.spec();
        let request = headers::upstream_request(&upstream.0, &req, &spec, !gw.config.api_keys.is_empty());
        match request.send_body(body.clone()).await {
            Ok(resp) => {
                let ttfb = started.elapsed();
                for from in &tried {
                    let labels = FailoverLabels { from: from.to_string(), to: replica.id.to_string() };
                    gw.metrics.failovers.get_or_create(&labels).inc();
                }
                if let Some((from, true)) = failed_from.take() {
                    gw.events.record(
                        EventKind::Failover,
                        Some(&from),
                        Some(&replica.id),
                        "connection failed before any response byte; retried",
                    );
                }
                let status = resp.status();
                let mut predicted_cached = None;
                if status.is_success() {
                    if let Some(pin_at) = shape.pin_at {
                        let parent = decision.matched.map(|m| m.key);
                        match matched_pin.as_ref().map(|p| &*p.replica) {
                            Some(home) if home == &*replica.id => {
                                predicted_cached = decision.matched.map(|m| gw.capacity.estimate(&replica.id, m.bytes));
                            }
                            // The baselines move conversations on every turn by design;
                            // history records the moves the shape policy had to make.
                            Some(home) if matches!(reason, RouteReason::Repinned | RouteReason::Failover) => {
                                gw.events.record(
                                    EventKind::PinMoved,
                                    Some(home),
                                    Some(&replica.id),
                                    format!("{} route", reason.as_str()),
                                );
                            }
                            _ => {}
                        }
                        gw.pins.record(pin_at, &replica.id, parent, est_tokens, crate::clock::now_ms());
                    }
                }
                let labels = RouteLabels { replica: replica.id.to_string(), route: reason.as_str().into() };
                gw.metrics.upstream_ttfb.get_or_create(&labels).observe(ttfb.as_secs_f64());
                let outcome = Outcome {
                    gw: gw.into_inner(),
                    replica: replica.clone(),
                    reason,
                    status: status.as_u16(),
                    started,
                    prompt_bytes: shape.prompt_bytes,
                    _held: (guard, permit, ticket),
                };
                return Ok(respond(resp, outcome, predicted_cached));
            }
            Err(e) if is_connection_failure(&e) => {
                drop((guard, permit, ticket));
                tracing::warn!(replica = %replica.id, "connection failed, failing over: {e}");
                let transitioned = mark_down(&replica, &e.to_string());
                tried.push(replica.id.clone());
                failed_from.get_or_insert((replica.id.clone(), transitioned));
            }
            Err(SendRequestError::Timeout) => {
                record_status(&gw, &replica, reason, "504");
                return Err(ApiError::UpstreamTimeout);
            }
            Err(e) => {
                record_status(&gw, &replica, reason, "502");
                return Err(ApiError::Upstream(e.to_string()));
            }
        }
    }
}

/// Waits for a large-context slot on `replica` (FIFO, bounded).
async fn admit(gw: &web::Data<Gateway>, replica: &Arc<Replica>) -> Result<Permit, ApiError> {
    let r = replica.clone();
    let limit = Arc::new(move || r.spec().max_large_inflight);
    let cfg = &gw.config.admission;
    let labels = crate::metrics::replica_label(&replica.id);
    match gw.admission.acquire(&replica.id, limit, Duration::from_millis(cfg.wait_ms), cfg.max_queue).await {
        Ok((permit, how)) => {
            if how == Admitted::AfterWaiting {
                gw.metrics.admission_waits.get_or_create(&labels).inc();
            }
            Ok(permit)
        }
        Err(e) => {
            gw.metrics.admission_rejections.get_or_create(&labels).inc();
            Err(e)
        }
    }
}

/// Refused, reset or timed-out connections: the request never reached an engine.
fn is_connection_failure(e: &SendRequestError) -> bool {
    matches!(e, SendRequestError::Connect(_) | SendRequestError::Send(_))
}

/// Demotes a replica after a connection failure; the health checker brings it
/// back after `rise` good probes. True when this call took it down.
fn mark_down(replica: &Replica, why: &str) -> bool {
    let was = replica.set_health(Health::Down);
    let mut probe = replica.probe.lock().expect("probe lock");
    probe.ok_streak = 0;
    probe.last_error = Some(why.to_string());
    was != Health::Down
}

fn record_status(gw: &Gateway, replica: &Replica, reason: RouteReason, status: &str) {
    gw.metrics
        .requests
        .get_or_create(&RequestLabels {
            replica: replica.id.to_string(),
            route: reason.as_str().into(),
            status: status.into(),
        })
        .inc();
}

async fn read_body(mut payload: web::Payload, limit: usize) -> Result<web::Bytes, ApiError> {
    let mut buf = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// Records the outcome when the body ends, however it ends.
struct Outcome {
    gw: Arc<Gateway>,
    replica: Arc<Replica>,
    reason: RouteReason,
    status: u16,
    started: Instant,
    prompt_bytes: usize,
    /// Released when the body ends, however it ends.
    _held: (InflightGuard, Option<Permit>, RunningTicket),
}

impl BodyEnd for Outcome {
    fn finish(&mut self, outcome: BodyOutcome, usage: Option<&UsageTap>) {
        let m = &self.gw.metrics;
        let route = self.reason.as_str().to_string();
        let status = match outcome {
            BodyOutcome::Complete => self.status.to_string(),
            BodyOutcome::UpstreamFailed => "upstream_failed".into(),
            BodyOutcome::IdleTimeout => "idle_timeout".into(),
            BodyOutcome::ClientGone => "client_gone".into(),
        };
        let labels = RouteLabels { replica: self.replica.id.to_string(), route: route.clone() };
        m.request_duration.get_or_create(&labels).observe(self.started.elapsed().as_secs_f64());
        m.requests.get_or_create(&RequestLabels { replica: labels.replica.clone(), route, status }).inc();
        if outcome == BodyOutcome::Complete && (200..300).contains(&self.status) {
            let measured = usage.and_then(UsageTap::usage);
            let result = if measured.is_some() { "measured" } else { "unmeasured" };
            m.usage_measured.get_or_create(&ResultLabels { result: result.into() }).inc();
            if let Some(u) = measured {
                self.gw.capacity.calibrate(&self.replica.id, self.prompt_bytes, u.prompt_tokens);
                m.prompt_tokens.get_or_create(&labels).inc_by(u.prompt_tokens);
                m.cached_tokens.get_or_create(&labels).inc_by(u.cached_tokens.unwrap_or(0));
            }
        }
    }
}

fn respond(
    resp: awc::ClientResponse<
        impl futures_util::Stream<Item = Result<web::Bytes, actix_web::error::PayloadError>> + Unpin + 'static,
    >,
    outcome: Outcome,
    predicted_cached: Option<u64>,
) -> HttpResponse {
    let status = resp.status();
    let mut out = HttpResponse::build(status);
    headers::copy_response_headers(resp.headers(), &mut out);
    out.insert_header((HEADER_REPLICA, HeaderValue::from_str(&outcome.replica.id).expect("slug is a valid header")));
    out.insert_header((HEADER_ROUTE, outcome.reason.as_str()));
    if let Some(n) = predicted_cached {
        out.insert_header((HEADER_PREDICTED_CACHED, n.to_string()));
    }
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let idle = Duration::from_millis(outcome.gw.config.timeouts.idle_stream_ms);
    let tap = status.is_success().then(|| UsageTap::new(sse));
    let expected =
        resp.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    // An SSE error reply (non-2xx) carries no [DONE]: only check successful streams.
    let sse_checked = sse && status.is_success();
    if let Some(len) = expected {
        // Keep the upstream's framing: a client then sees a body cut short
        // as short, whatever its HTTP library does with chunked encoding.
        out.no_chunking(len);
    }
    out.streaming(GuardedBody::new(resp, idle, sse_checked, expected, tap, outcome))
}
