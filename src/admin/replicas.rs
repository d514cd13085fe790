//! `/admin/v1/replicas`: the fleet. Secrets (upstream API keys) are
//! write-only: responses say whether one is set, never what it is.

use std::time::Duration;

use actix_web::{delete, get, patch, post, web, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use super::act;
use crate::clock::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::fleet::{validate_id, AdminState, Health, Replica, ReplicaId, ReplicaSpec, ReplicaUrl};
use crate::operator::ReplicaPatch;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list)
        .service(get_one)
        .service(add)
        .service(update)
        .service(remove)
        .service(drain)
        .service(resume)
        .service(disable)
        .service(enable)
        .service(remove_pins);
}

/// A replica as the API shows it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReplicaView {
    #[schema(value_type = ReplicaId)]
    pub id: String,
    /// Where it comes from: `static` (the config file), `api`, or the
    /// discovery source that found it (`dns:...`, `dns+srv:...`, `file:...`).
    pub source: String,
    /// When a discovered replica left its source (it drains, then is removed).
    pub left_source_at: Option<String>,
    /// Share of spread traffic relative to the other replicas.
    pub weight: u32,
    pub labels: std::collections::BTreeMap<String, String>,
    #[schema(value_type = ReplicaUrl)]
    pub url: String,
    /// Whether an upstream API key is set (the key itself is never returned).
    pub api_key_set: bool,
    pub health_path: String,
    pub max_large_inflight: Option<u32>,
    /// KV capacity in tokens: declared, or read from the replica's metrics.
    pub kv_tokens: Option<u64>,
    pub admin_state: AdminState,
    pub health: Health,
    pub inflight: i64,
    pub large_inflight: i64,
    pub pins: usize,
    /// Attempts sent to this replica since the gateway started (a request
    /// that failed over counts on every replica it tried).
    pub attempts_total: u64,
    pub last_check: Option<String>,
    pub last_error: Option<String>,
    pub models: Vec<String>,
    /// Calibrated prompt bytes per token for this replica.
    pub bytes_per_token: f64,
    /// Its engine counts session turns' prompts before they run (`POST
    /// /tokenize`): false once it refused, or for a while after a count failed.
    pub engine_counts: bool,
    /// Estimated tokens of active families plus running requests.
    pub working_set_tokens: u64,
    /// Large requests waiting for an admission slot.
    pub admission_queue: usize,
}

pub fn view(s: &AppState, r: &Replica) -> ReplicaView {
    view_with_pins(r, &s.pins.count_by_replica())
}

/// `pin_counts` is read once per response.
fn view_with_pins(r: &Replica, pin_counts: &std::collections::HashMap<std::sync::Arc<str>, usize>) -> ReplicaView {
    let spec = r.spec();
    let probe = r.probe_state();
    let pins = pin_counts.get(&r.id).copied().unwrap_or(0);
    let cap = r.capacity.figures();
    ReplicaView {
        id: r.id.to_string(),
        source: r.source.label().to_string(),
        left_source_at: r.left_source_ms().map(rfc3339),
        weight: spec.weight(),
        labels: spec.labels.clone(),
        url: spec.url.clone(),
        api_key_set: spec.api_key.is_some(),
        health_path: spec.health_path().to_string(),
        max_large_inflight: spec.max_large_inflight,
        kv_tokens: cap.kv_tokens,
        admin_state: r.admin(),
        health: r.health(),
        inflight: r.inflight(),
        large_inflight: r.large_inflight(),
        pins,
        attempts_total: r.attempts(),
        last_check: probe.last_check_ms.map(rfc3339),
        last_error: probe.last_error,
        models: r.models().as_ref().clone(),
        bytes_per_token: r.calibration.bytes_per_token(),
        engine_counts: r.calibration.engine_counts(crate::clock::now_ms()),
        working_set_tokens: cap.working_set_tokens,
        admission_queue: r.large_slots.queued(),
    }
}

fn checked_id(id: &str) -> Result<&str, ApiError> {
    validate_id(id).map_err(ApiError::BadRequest)?;
    Ok(id)
}

#[utoipa::path(tag = "replicas", responses((status = 200, body = Vec<ReplicaView>)))]
#[get("/replicas")]
async fn list(s: web::Data<AppState>) -> web::Json<Vec<ReplicaView>> {
    let counts = s.pins.count_by_replica();
    web::Json(s.fleet.snapshot().iter().map(|r| view_with_pins(r, &counts)).collect())
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")),
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[get("/replicas/{id}")]
async fn get_one(s: web::Data<AppState>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = s.operator.replica(checked_id(&id)?)?;
    Ok(web::Json(view(&s, &r)))
}

/// A replica to add.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "gpu-2", "url": "http://10.0.0.7:8000", "max_large_inflight": 1, "kv_tokens": 122636}))]
pub struct NewReplica {
    pub id: ReplicaId,
    pub url: ReplicaUrl,
    /// Upstream API key (write-only; empty means none).
    #[schema(schema_with = crate::fleet::api_key_schema)]
    pub api_key: Option<String>,
    #[schema(schema_with = crate::fleet::health_path_schema)]
    pub health_path: Option<String>,
    #[serde(default, deserialize_with = "crate::json_int::opt_int32")]
    #[schema(minimum = 0, maximum = 2147483647)]
    pub max_large_inflight: Option<u32>,
    #[serde(default, deserialize_with = "crate::json_int::opt_int64")]
    #[schema(minimum = 0, maximum = 9223372036854775807_i64)]
    pub kv_tokens: Option<u64>,
}

#[utoipa::path(tag = "replicas", request_body = NewReplica,
    responses((status = 201, body = ReplicaView), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
#[post("/replicas")]
async fn add(s: web::Data<AppState>, body: web::Json<NewReplica>) -> Result<HttpResponse, ApiError> {
    let b = body.into_inner();
    // The documented format applies to what the client sent, before normalizing.
    crate::fleet::validate_url(&b.url.0).map_err(ApiError::Unprocessable)?;
    let mut spec = ReplicaSpec::new(&b.id.0, &b.url.0);
    spec.api_key = b.api_key.filter(|k| !k.is_empty());
    spec.health_path = b.health_path;
    spec.max_large_inflight = b.max_large_inflight;
    spec.kv_tokens = b.kv_tokens;
    let r = act(&s, "add_replica", move |op| async move { op.add_replica(spec).await }).await?;
    Ok(HttpResponse::Created().json(view(&s, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")), request_body = ReplicaPatch,
    description = "A discovered replica's settings are its source's: changing them here answers 409.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
#[patch("/replicas/{id}")]
async fn update(
    s: web::Data<AppState>,
    id: web::Path<String>,
    body: web::Json<ReplicaPatch>,
) -> Result<web::Json<ReplicaView>, ApiError> {
    let (id, patch) = (checked_id(&id)?.to_string(), body.into_inner());
    let r = act(&s, "update_replica", move |op| async move { op.update_replica(&id, patch).await }).await?;
    Ok(web::Json(view(&s, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")),
    description = "A discovered replica belongs to its source: deleting it answers 409 (disable it, or change the source).",
    responses((status = 204, description = "removed, with its pins (ids of responses it stored are kept until they expire, so a follow-up hears its replica is gone)"), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
#[delete("/replicas/{id}")]
async fn remove(s: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id = checked_id(&id)?.to_string();
    act(&s, "remove_replica", move |op| async move { op.remove_replica(&id).await }).await?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct DrainQuery {
    /// Return only when nothing is in flight any more.
    #[serde(default)]
    pub wait: bool,
    /// Seconds to wait with `wait=true` (default 60, at most 3600).
    #[param(minimum = 0, maximum = 3600)]
    pub timeout: Option<u64>,
    /// Hand over: the replica's streams that may go on elsewhere (README,
    /// "Streams that outlive their replica") move to other replicas at
    /// their next event, so `wait=true` returns in seconds, not when the
    /// longest stream ends. Every instance sharing the store hands its
    /// streams over; `wait` waits for this instance's.
    #[serde(default)]
    pub handoff: bool,
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id"), DrainQuery),
    description = "Stops new requests (pinned conversations are re-pinned elsewhere); in-flight requests finish \
                   (with `handoff=true`, streams that may go on move to other replicas now). \
                   With `wait=true` answers once nothing is in flight: 504 at the timeout, 409 if resumed meanwhile.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 504, body = ErrorBody)))]
#[post("/replicas/{id}/drain")]
async fn drain(
    s: web::Data<AppState>,
    id: web::Path<String>,
    q: web::Query<DrainQuery>,
) -> Result<web::Json<ReplicaView>, ApiError> {
    let timeout = q.timeout.unwrap_or(60);
    if timeout > 3600 {
        return Err(ApiError::BadRequest("timeout: at most 3600 seconds".into()));
    }
    let id = checked_id(&id)?.to_string();
    let r = act(&s, "drain", move |op| async move { op.drain(&id).await }).await?;
    if q.handoff {
        r.hand_off();
        // Other instances' streams on it move too (a shared store tells them).
        if let Err(e) = s.store.announce_handoff(&r.id).await {
            tracing::warn!(replica = %r.id, "the hand-over could not be announced to other instances: {e}");
        }
    }
    if q.wait {
        s.operator.wait_drained(&r, Duration::from_secs(timeout)).await?;
    }
    Ok(web::Json(view(&s, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")), description = "Undoes a drain.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
#[post("/replicas/{id}/resume")]
async fn resume(s: web::Data<AppState>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let id = checked_id(&id)?.to_string();
    let r = act(&s, "resume", move |op| async move { op.resume(&id).await }).await?;
    Ok(web::Json(view(&s, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")), description = "Demotes a replica by hand; sticky until enable.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[post("/replicas/{id}/disable")]
async fn disable(s: web::Data<AppState>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let id = checked_id(&id)?.to_string();
    let r = act(&s, "disable", move |op| async move { op.disable(&id).await }).await?;
    Ok(web::Json(view(&s, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = ReplicaId, Path, description = "replica id")),
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[post("/replicas/{id}/enable")]
async fn enable(s: web::Data<AppState>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let id = checked_id(&id)?.to_string();
    let r = act(&s, "enable", move |op| async move { op.enable(&id).await }).await?;
    Ok(web::Json(view(&s, &r)))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Removed {
    pub removed: usize,
}

#[utoipa::path(tag = "pins", params(("id" = ReplicaId, Path, description = "replica id")), description = "Deletes every pin held by the replica.",
    responses((status = 200, body = Removed), (status = 404, body = ErrorBody)))]
#[delete("/replicas/{id}/pins")]
async fn remove_pins(s: web::Data<AppState>, id: web::Path<String>) -> Result<web::Json<Removed>, ApiError> {
    let id = checked_id(&id)?.to_string();
    Ok(web::Json(Removed {
        removed: act(&s, "delete_replica_pins", move |op| async move { op.delete_replica_pins(&id).await }).await?,
    }))
}
