//! `/admin/v1/sessions`: the sessions at the KV wall as this instance sees
//! them: resident ones per replica (running, idle, paused) and the held.

use actix_web::{get, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use crate::error::{ApiError, ErrorBody};
use crate::sessions::SessionView;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list);
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct SessionQuery {
    /// Most sessions listed (default 200).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
}

/// Resident sessions by replica, then the held in the order they go. With
/// several instances, each lists the sessions it knows: its own turns and
/// those the others' pins told it of (`served_here: false`).
#[utoipa::path(tag = "capacity", params(SessionQuery), responses((status = 200, body = Vec<SessionView>), (status = 400, body = ErrorBody)))]
#[get("/sessions")]
async fn list(s: web::Data<AppState>, q: web::Query<SessionQuery>) -> Result<web::Json<Vec<SessionView>>, ApiError> {
    let limit = super::page_limit(q.limit, 200)?;
    Ok(web::Json(s.sessions.view(crate::clock::now_ms(), limit)))
}
