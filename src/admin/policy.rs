//! `/admin/v1/policy`: the routing mode and identity block sizes; a change
//! takes effect on the next request and persists.

use actix_web::{get, put, web};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::error::{ApiError, ErrorBody};
use crate::policy::{CurrentPolicy, PolicySettings};
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(get_policy).service(put_policy);
}

#[utoipa::path(tag = "policy", responses((status = 200, body = PolicySettings)))]
#[get("/policy")]
async fn get_policy(s: web::Data<AppState>) -> web::Json<PolicySettings> {
    web::Json(CurrentPolicy::get(&s.policy))
}

#[utoipa::path(tag = "policy", request_body(content = PolicySettings,
        example = json!({"mode": "shape", "identity": {"block_bytes": 1024, "block_tokens": 256}})),
    responses((status = 200, body = PolicySettings), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)))]
#[put("/policy")]
async fn put_policy(
    s: web::Data<AppState>,
    body: web::Json<PolicySettings>,
) -> Result<web::Json<PolicySettings>, ApiError> {
    let next = body.into_inner();
    Ok(web::Json(super::act(&s, "set_policy", move |op| async move { op.set_policy(next).await }).await?))
}
