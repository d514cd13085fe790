//! `/admin/v1/capacity`: working set against KV capacity, per replica and
//! for the fleet, with a verdict in plain words.

use actix_web::{get, web};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::capacity::CapacityReport;
use crate::gateway::Gateway;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(get_capacity);
}

#[utoipa::path(tag = "capacity", responses((status = 200, body = CapacityReport)))]
#[get("/capacity")]
async fn get_capacity(gw: web::Data<Gateway>) -> web::Json<CapacityReport> {
    web::Json(crate::capacity::evaluate(&gw))
}
