//! The admin REST API (`/admin/v1`), its OpenAPI spec and Swagger UI, and
//! `/metrics`, all on the admin listener. One file per resource; each route
//! is registered once, through utoipa-actix-web, so a route cannot exist
//! without its OpenAPI entry.

mod capacity;
mod events;
mod pins;
mod policy;
mod replicas;
pub mod web_ui;

use actix_web::{web, App, HttpResponse};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_actix_web::{scope, AppExt};
use utoipa_swagger_ui::SwaggerUi;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "prefixgate admin API",
        description = "Manage the replicas behind prefixgate, inspect conversation pins and history, and steer the routing policy. \
                       Send `Authorization: Bearer <admin_token>` when a token is configured.",
        license(name = "Apache-2.0")
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "replicas", description = "The fleet: add, update, drain, disable, remove"),
        (name = "pins", description = "Conversation pins: which replica holds which prefix"),
        (name = "events", description = "History: failovers, pin moves, drains, health changes"),
        (name = "policy", description = "The routing mode and identity block sizes"),
        (name = "capacity", description = "KV working set against capacity")
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn api_scope() -> scope::Scope<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    scope::scope("/admin/v1")
        .configure(replicas::routes)
        .configure(pins::routes)
        .configure(events::routes)
        .configure(policy::routes)
        .configure(capacity::routes)
}

/// The OpenAPI document, as served at `/openapi.json` and committed under `openapi/`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let (_, api) = App::new().into_utoipa_app().openapi(ApiDoc::openapi()).service(api_scope()).split_for_parts();
    api
}

pub fn openapi_json() -> String {
    openapi().to_pretty_json().expect("the spec serializes") + "\n"
}

pub fn create_admin_app(
    state: web::Data<AppState>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let (app, api) = App::new()
        .into_utoipa_app()
        .openapi(ApiDoc::openapi())
        .app_data(web::Data::from(state.access.clone()))
        .app_data(web::Data::from(state.operator.clone()))
        .app_data(state)
        .app_data(json_config())
        .app_data(query_config())
        .app_data(path_config())
        .service(api_scope())
        .split_for_parts();
    app.wrap(actix_web::middleware::from_fn(crate::access::guard_admin))
        .app_data(web::PayloadConfig::new(64 * 1024))
        .route("/metrics", web::get().to(metrics))
        .service(SwaggerUi::new("/swagger-ui/{_:.*}").url("/openapi.json", api))
        .configure(web_ui::routes)
        .default_service(web::to(|| async { Err::<HttpResponse, _>(ApiError::NotFound("no such admin route".into())) }))
}

/// Bad JSON is a 400 in the one error shape, not actix's plain-text default.
fn json_config() -> web::JsonConfig {
    web::JsonConfig::default()
        .limit(64 * 1024)
        .error_handler(|e, _| ApiError::BadRequest(format!("invalid JSON body: {e}")).into())
}

fn query_config() -> web::QueryConfig {
    web::QueryConfig::default().error_handler(|e, _| ApiError::BadRequest(format!("invalid query string: {e}")).into())
}

fn path_config() -> web::PathConfig {
    web::PathConfig::default().error_handler(|e, _| ApiError::BadRequest(format!("invalid path: {e}")).into())
}

async fn metrics(s: web::Data<AppState>) -> HttpResponse {
    let report = s.capacity.report(&s.fleet, &s.calibration, crate::clock::now_ms());
    s.metrics.refresh_gauges(&s.fleet, &s.pins, &s.admission, &s.calibration, &report);
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(s.metrics.encode())
}

/// Milliseconds since the epoch as an RFC 3339 timestamp.
fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}
