//! `/admin/v1/events`: pin and failover history, newest first.

use actix_web::{get, web};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::error::{ApiError, ErrorBody};
use crate::events::{Event, EventFilter, EventKind};
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list);
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct EventQuery {
    /// Only this kind (e.g. `failover`).
    pub kind: Option<String>,
    /// Only events naming this replica (as source or destination).
    pub replica: Option<String>,
    /// Only events at or after this RFC 3339 time.
    pub since: Option<String>,
    /// Page size (default 100, at most 1000).
    pub limit: Option<usize>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EventPage {
    pub items: Vec<Event>,
    /// Pass as `cursor` for older events; absent on the last page.
    pub next_cursor: Option<u64>,
}

#[utoipa::path(tag = "events", params(EventQuery), responses((status = 200, body = EventPage), (status = 400, body = ErrorBody)))]
#[get("/events")]
async fn list(s: web::Data<AppState>, q: web::Query<EventQuery>) -> Result<web::Json<EventPage>, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let kind = q.kind.as_deref().map(str::parse::<EventKind>).transpose().map_err(ApiError::BadRequest)?;
    let since_ms = q
        .since
        .as_deref()
        .map(|s| humantime::parse_rfc3339_weak(s).map(crate::clock::unix_ms))
        .transpose()
        .map_err(|e| ApiError::BadRequest(format!("since: {e} (expected RFC 3339)")))?;
    let items = s.events.query(&EventFilter { kind, replica: q.replica.clone(), since_ms, before_id: q.cursor, limit });
    let next_cursor = (items.len() == limit).then(|| items.last().map(|e| e.id)).flatten();
    Ok(web::Json(EventPage { items, next_cursor }))
}
