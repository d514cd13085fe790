//! `/admin/v1/instances`: the gateway instances sharing this fleet (a shared
//! store), from their heartbeats; with an embedded store, just this one.

use actix_web::{get, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_actix_web::service_config::ServiceConfig;

use crate::clock::rfc3339;
use crate::error::ApiError;
use crate::operator::INSTANCE_TIMEOUT_MS;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list);
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct InstanceView {
    /// The instance's name (`store.instance`; default: host and process id).
    pub instance: String,
    /// True when its heartbeat is fresh (written within the last 2 s).
    pub alive: bool,
    pub last_seen: String,
    /// True for the instance answering this request.
    pub this: bool,
    /// Requests it has in flight, per replica.
    pub inflight: std::collections::BTreeMap<String, i64>,
    pub admin_url: Option<String>,
}

#[utoipa::path(tag = "instances", responses((status = 200, body = Vec<InstanceView>), (status = 500, body = crate::error::ErrorBody)))]
#[get("/instances")]
async fn list(s: web::Data<AppState>) -> Result<web::Json<Vec<InstanceView>>, ApiError> {
    let now = crate::clock::now_ms();
    let Some(me) = s.store.instance().map(str::to_string) else {
        let inflight = s.fleet.snapshot().iter().map(|r| (r.id.to_string(), r.inflight())).collect();
        let this = InstanceView {
            instance: "this".into(),
            alive: true,
            last_seen: rfc3339(now),
            this: true,
            inflight,
            admin_url: None,
        };
        return Ok(web::Json(vec![this]));
    };
    let beats = s.store.instances().await.map_err(|e| ApiError::Internal(e.to_string()))?;
    let mut views: Vec<InstanceView> = beats
        .into_iter()
        .map(|b| InstanceView {
            alive: now.saturating_sub(b.at_ms) <= INSTANCE_TIMEOUT_MS,
            last_seen: rfc3339(b.at_ms),
            this: b.instance == me,
            instance: b.instance,
            inflight: b.inflight,
            admin_url: b.admin_url,
        })
        .collect();
    views.sort_by(|a, b| b.alive.cmp(&a.alive).then(a.instance.cmp(&b.instance)));
    Ok(web::Json(views))
}
