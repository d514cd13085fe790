//! `/admin/v1/replicas`: the fleet. Secrets (upstream API keys) are
//! write-only: responses say whether one is set, never what it is.

use std::time::Duration;

use actix_web::{delete, get, patch, post, web, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use super::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::fleet::{validate_id, AdminState, Health, Replica, ReplicaSpec};
use crate::gateway::Gateway;

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
    #[schema(example = "gpu-0")]
    pub id: String,
    #[schema(example = "http://10.0.0.5:8000")]
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
    pub served_total: u64,
    pub last_check: Option<String>,
    pub last_error: Option<String>,
    pub models: Vec<String>,
    /// Calibrated prompt bytes per token for this replica.
    pub bytes_per_token: f64,
    /// Estimated tokens of active families plus running requests.
    pub working_set_tokens: u64,
    /// Large requests waiting for an admission slot.
    pub admission_queue: usize,
}

pub fn view(gw: &Gateway, r: &Replica) -> ReplicaView {
    view_with_pins(gw, r, &gw.pins.count_by_replica())
}

/// `pin_counts` is computed once per response: counting is a scan of the table.
fn view_with_pins(
    gw: &Gateway,
    r: &Replica,
    pin_counts: &std::collections::HashMap<std::sync::Arc<str>, usize>,
) -> ReplicaView {
    let spec = r.spec();
    let probe = r.probe.lock().expect("probe lock").clone();
    let pins = pin_counts.get(&r.id).copied().unwrap_or(0);
    let cap = gw.capacity.replica(&r.id);
    ReplicaView {
        id: r.id.to_string(),
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
        served_total: r.served(),
        last_check: probe.last_check_ms.map(rfc3339),
        last_error: probe.last_error,
        models: r.models().as_ref().clone(),
        bytes_per_token: cap.bytes_per_token,
        working_set_tokens: cap.working_set_tokens,
        admission_queue: gw.admission.queued(&r.id),
    }
}

fn checked_id(id: &str) -> Result<&str, ApiError> {
    validate_id(id).map_err(ApiError::BadRequest)?;
    Ok(id)
}

#[utoipa::path(tag = "replicas", responses((status = 200, body = Vec<ReplicaView>)))]
#[get("/replicas")]
async fn list(gw: web::Data<Gateway>) -> web::Json<Vec<ReplicaView>> {
    let counts = gw.pins.count_by_replica();
    web::Json(gw.fleet.snapshot().iter().map(|r| view_with_pins(&gw, r, &counts)).collect())
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path, description = "replica id")),
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[get("/replicas/{id}")]
async fn get_one(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.replica(checked_id(&id)?)?;
    Ok(web::Json(view(&gw, &r)))
}

/// A replica to add.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "gpu-2", "url": "http://10.0.0.7:8000", "max_large_inflight": 1, "kv_tokens": 122636}))]
pub struct NewReplica {
    pub id: String,
    pub url: String,
    pub api_key: Option<String>,
    pub health_path: Option<String>,
    pub max_large_inflight: Option<u32>,
    pub kv_tokens: Option<u64>,
}

#[utoipa::path(tag = "replicas", request_body = NewReplica,
    responses((status = 201, body = ReplicaView), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
#[post("/replicas")]
async fn add(gw: web::Data<Gateway>, body: web::Json<NewReplica>) -> Result<HttpResponse, ApiError> {
    let b = body.into_inner();
    let mut spec = ReplicaSpec::new(&b.id, &b.url);
    spec.api_key = b.api_key.filter(|k| !k.is_empty());
    spec.health_path = b.health_path;
    spec.max_large_inflight = b.max_large_inflight;
    spec.kv_tokens = b.kv_tokens;
    let r = gw.add_replica(spec)?;
    Ok(HttpResponse::Created().json(view(&gw, &r)))
}

/// Fields to change; absent fields keep their value.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"max_large_inflight": 2}))]
pub struct ReplicaPatch {
    pub url: Option<String>,
    /// Sets the upstream API key (write-only).
    pub api_key: Option<String>,
    /// Removes the upstream API key.
    #[serde(default)]
    pub clear_api_key: bool,
    pub health_path: Option<String>,
    pub max_large_inflight: Option<u32>,
    #[serde(default)]
    pub clear_max_large_inflight: bool,
    pub kv_tokens: Option<u64>,
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path)), request_body = ReplicaPatch,
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
#[patch("/replicas/{id}")]
async fn update(
    gw: web::Data<Gateway>,
    id: web::Path<String>,
    body: web::Json<ReplicaPatch>,
) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.replica(checked_id(&id)?)?;
    let p = body.into_inner();
    let mut spec = (*r.spec()).clone();
    if let Some(url) = p.url {
        spec.url = crate::fleet::normalize_url(&url);
    }
    if p.clear_api_key {
        spec.api_key = None;
    }
    if let Some(k) = p.api_key.filter(|k| !k.is_empty()) {
        spec.api_key = Some(k);
    }
    if let Some(h) = p.health_path {
        spec.health_path = Some(h);
    }
    if p.clear_max_large_inflight {
        spec.max_large_inflight = None;
    }
    if let Some(m) = p.max_large_inflight {
        spec.max_large_inflight = Some(m);
    }
    if let Some(k) = p.kv_tokens {
        spec.kv_tokens = Some(k);
    }
    let r = gw.update_replica(spec)?;
    Ok(web::Json(view(&gw, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path)),
    responses((status = 204, description = "removed, with its pins"), (status = 404, body = ErrorBody)))]
#[delete("/replicas/{id}")]
async fn remove(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    gw.remove_replica(checked_id(&id)?)?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct DrainQuery {
    /// Return only when nothing is in flight any more.
    #[serde(default)]
    pub wait: bool,
    /// Seconds to wait with `wait=true` (default 60).
    pub timeout: Option<u64>,
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path), DrainQuery),
    description = "Stops new requests (pinned conversations are re-pinned elsewhere); in-flight requests finish. \
                   With `wait=true` answers once nothing is in flight: 504 at the timeout, 409 if resumed meanwhile.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 504, body = ErrorBody)))]
#[post("/replicas/{id}/drain")]
async fn drain(
    gw: web::Data<Gateway>,
    id: web::Path<String>,
    q: web::Query<DrainQuery>,
) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.set_admin(checked_id(&id)?, AdminState::Draining)?;
    if q.wait {
        gw.wait_drained(&r, Duration::from_secs(q.timeout.unwrap_or(60).min(3600))).await?;
    }
    Ok(web::Json(view(&gw, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path)), description = "Undoes a drain.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
#[post("/replicas/{id}/resume")]
async fn resume(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.replica(checked_id(&id)?)?;
    if r.admin() == AdminState::Disabled {
        return Err(ApiError::Conflict(format!("replica '{id}' is disabled; use enable")));
    }
    let r = gw.set_admin(&id, AdminState::Active)?;
    Ok(web::Json(view(&gw, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path)), description = "Demotes a replica by hand; sticky until enable.",
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[post("/replicas/{id}/disable")]
async fn disable(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.set_admin(checked_id(&id)?, AdminState::Disabled)?;
    Ok(web::Json(view(&gw, &r)))
}

#[utoipa::path(tag = "replicas", params(("id" = String, Path)),
    responses((status = 200, body = ReplicaView), (status = 404, body = ErrorBody)))]
#[post("/replicas/{id}/enable")]
async fn enable(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<web::Json<ReplicaView>, ApiError> {
    let r = gw.set_admin(checked_id(&id)?, AdminState::Active)?;
    Ok(web::Json(view(&gw, &r)))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Removed {
    pub removed: usize,
}

#[utoipa::path(tag = "pins", params(("id" = String, Path)), description = "Deletes every pin held by the replica.",
    responses((status = 200, body = Removed), (status = 404, body = ErrorBody)))]
#[delete("/replicas/{id}/pins")]
async fn remove_pins(gw: web::Data<Gateway>, id: web::Path<String>) -> Result<web::Json<Removed>, ApiError> {
    gw.replica(checked_id(&id)?)?;
    Ok(web::Json(Removed { removed: gw.pins.remove_replica(&id) }))
}
