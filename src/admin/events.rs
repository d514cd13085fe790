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
    /// Only this kind.
    pub kind: Option<EventKind>,
    /// Only events naming this replica (as source or destination).
    #[param(value_type = Option<crate::fleet::ReplicaId>)]
    pub replica: Option<String>,
    /// Only events at or after this RFC 3339 time.
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Page size (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// `next_cursor` of the previous page.
    #[param(minimum = 0)]
    pub cursor: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EventPage {
    pub items: Vec<Event>,
    /// Pass as `cursor` for older events; absent on the last page.
    pub next_cursor: Option<u64>,
    /// Where an event's trace is shown (`tracing.trace_url`, with
    /// `{trace_id}` to replace), when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_url: Option<String>,
}

#[utoipa::path(tag = "events", params(EventQuery), responses((status = 200, body = EventPage), (status = 400, body = ErrorBody)))]
#[get("/events")]
async fn list(s: web::Data<AppState>, q: web::Query<EventQuery>) -> Result<web::Json<EventPage>, ApiError> {
    let limit = super::page_limit(q.limit, 100)?;
    if let Some(r) = &q.replica {
        crate::fleet::validate_id(r).map_err(ApiError::BadRequest)?;
    }
    let since_ms = q.since.as_deref().map(parse_rfc3339).transpose()?;
    let before_id = q
        .cursor
        .map(|c| u64::try_from(c).map_err(|_| ApiError::BadRequest("cursor: must be at least 0".into())))
        .transpose()?;
    let filter = EventFilter { kind: q.kind, replica: q.replica.clone(), since_ms, before_id, limit };
    let items = s.events.query(&filter);
    let next_cursor = (items.len() == limit).then(|| items.last().map(|e| e.id)).flatten();
    Ok(web::Json(EventPage { items, next_cursor, trace_url: s.config.tracing.trace_url.clone() }))
}

/// An RFC 3339 timestamp (any offset) as milliseconds since the epoch;
/// times before the epoch are the epoch.
fn parse_rfc3339(s: &str) -> Result<u64, ApiError> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map_err(|e| ApiError::BadRequest(format!("since: {e} (expected an RFC 3339 time)")))?;
    Ok(u64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    #[test]
    fn since_takes_any_rfc3339_offset() {
        assert_eq!(super::parse_rfc3339("1970-01-01T00:00:01Z").unwrap(), 1000);
        assert_eq!(super::parse_rfc3339("1970-01-01T01:00:01.5+01:00").unwrap(), 1500);
        assert_eq!(super::parse_rfc3339("1960-01-01T00:00:00Z").unwrap(), 0);
        assert!(super::parse_rfc3339("yesterday").is_err());
    }
}
