//! `/admin/v1/discovery`: the discovery sources, each with its last read.

use actix_web::{get, web};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::discovery::SourceStatus;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list);
}

#[utoipa::path(tag = "discovery",
    description = "The discovery sources this instance reads (each instance reads its own), with the last read's \
                   time and result and the replicas the source lists. A stale source failed its last reads: its \
                   replicas are the last good answer's.",
    responses((status = 200, body = Vec<SourceStatus>)))]
#[get("/discovery")]
async fn list(s: web::Data<AppState>) -> web::Json<Vec<SourceStatus>> {
    web::Json(s.discovery.statuses())
}
