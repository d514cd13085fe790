//! `/admin/v1/timeline`: the fleet over time, as this instance sampled it
//! (`timeline.rs`). With several instances, each serves its own.

use actix_web::{get, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;
use crate::timeline::TimelineView;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(get_timeline);
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct TimelineQuery {
    /// How far back, seconds (default 900; at most `timeline.window_secs`).
    #[param(minimum = 1, maximum = 604800)]
    pub window_s: Option<u64>,
}

/// Per replica, a value per sample: resident session tokens, capacity and
/// the learned wall; the warm share of prompt tokens; time to first token
/// p50 and p90; in flight; paused turns by class; failovers. Fleet-wide:
/// held sessions by class.
#[utoipa::path(tag = "capacity", params(TimelineQuery), responses((status = 200, body = TimelineView), (status = 400, body = ErrorBody)))]
#[get("/timeline")]
async fn get_timeline(
    s: web::Data<AppState>,
    q: web::Query<TimelineQuery>,
) -> Result<web::Json<TimelineView>, ApiError> {
    let window_s = match q.window_s.unwrap_or(900) {
        w @ 1..=604_800 => w,
        w => return Err(ApiError::BadRequest(format!("window_s: {w} is not between 1 and 604800"))),
    };
    let instance = s.store.instance().unwrap_or("this");
    Ok(web::Json(s.timeline.view(instance, crate::clock::now_ms(), window_s)))
}
