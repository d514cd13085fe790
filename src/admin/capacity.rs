//! `/admin/v1/capacity`: working set against KV capacity, per replica and
//! for the fleet, with a verdict in plain words.

use actix_web::{get, web};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::capacity::CapacityReport;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(get_capacity);
}

/// A read: computed from the current state, changing nothing (warning
/// events come from the background evaluation, once per transition).
#[utoipa::path(tag = "capacity", responses((status = 200, body = CapacityReport)))]
#[get("/capacity")]
async fn get_capacity(s: web::Data<AppState>) -> web::Json<CapacityReport> {
    web::Json(s.capacity.report(&s.fleet.capacity_inputs(&s.calibration), crate::clock::now_ms()))
}
