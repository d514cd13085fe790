//! The admin REST API (`/admin/v1`), its OpenAPI spec and Swagger UI, and
//! `/metrics`, all on the admin listener. One file per resource; each route
//! is registered once, through utoipa-actix-web, so a route cannot exist
//! without its OpenAPI entry.

mod capacity;
mod discovery;
mod events;
mod instances;
mod pins;
mod policy;
mod replicas;
mod sessions;
mod timeline;
pub mod web_ui;

use actix_web::{web, App, HttpResponse};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_actix_web::{scope, AppExt};
use utoipa_swagger_ui::SwaggerUi;

use crate::error::ApiError;
use crate::operator::Operator;
use crate::state::AppState;
use std::sync::Arc;

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
    // Named only in path and query parameters, which utoipa does not collect.
    components(schemas(pins::PinKey, pins::PinKeyPrefix)),
    tags(
        (name = "replicas", description = "The fleet: add, update, drain, disable, remove"),
        (name = "pins", description = "Conversation pins: which replica holds which prefix"),
        (name = "events", description = "History: failovers, pin moves, drains, health changes"),
        (name = "policy", description = "The routing mode and identity block sizes"),
        (name = "capacity", description = "KV working set against capacity, the sessions at the KV wall, the fleet over time"),
        (name = "instances", description = "Gateway instances sharing the fleet (a shared store)"),
        (name = "discovery", description = "Sources replicas are found in (DNS, SRV, files)")
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

/// The answers any operation can give besides its own: 401 (bad or missing
/// token) and 429 (rate limit or lockout) everywhere; 400 where a path,
/// query or body is parsed; 413 and 415 where a JSON body is read. Declared
/// once here so that no operation can forget them.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let error = |what: &str| {
            ResponseBuilder::new()
                .description(what)
                .content(
                    "application/json",
                    ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build(),
                )
                .build()
        };
        for item in openapi.paths.paths.values_mut() {
            for op in
                [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch].into_iter().flatten()
            {
                let has_params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
                let has_body = op.request_body.is_some();
                let mut add = |status: &str, what: &str| {
                    op.responses.responses.entry(status.to_string()).or_insert_with(|| error(what).into());
                };
                add("401", "Missing or invalid admin token");
                add("429", "Too many requests (rate limit, or locked out after failed logins); see Retry-After");
                if has_params || has_body {
                    add("400", "Malformed path, query or body");
                }
                if has_body {
                    add("413", "Body larger than 64 KiB");
                    add("415", "Body is not application/json");
                }
            }
        }
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
        .configure(sessions::routes)
        .configure(timeline::routes)
        .configure(instances::routes)
        .configure(discovery::routes)
}

/// The OpenAPI document, as served at `/openapi.json` and committed under `openapi/`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let (_, mut api) = App::new().into_utoipa_app().openapi(ApiDoc::openapi()).service(api_scope()).split_for_parts();
    // After the routes are in: the common answers go on every operation.
    CommonResponses.modify(&mut api);
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
    let (app, mut api) = App::new()
        .into_utoipa_app()
        .openapi(ApiDoc::openapi())
        .app_data(web::Data::from(state.access.clone()))
        .app_data(state)
        .app_data(json_config())
        .app_data(query_config())
        .app_data(path_config())
        .service(api_scope())
        .split_for_parts();
    CommonResponses.modify(&mut api);
    app.wrap(actix_web::middleware::from_fn(crate::access::guard_admin))
        .app_data(web::PayloadConfig::new(64 * 1024))
        .route("/metrics", web::get().to(metrics))
        .service(SwaggerUi::new("/swagger-ui/{_:.*}").url("/openapi.json", api))
        .configure(web_ui::routes)
        .default_service(web::to(no_route))
}

/// Runs an operator action as a task of its own. An action persists first
/// (a Redis round trip, an fsync) and awaits the store, so the admin
/// listener's worker goes on with other requests (a scrape, the UI)
/// meanwhile. Each store call is bounded by the store's own timeouts; an
/// action that started is not cut in half (persist, then apply) when its
/// client goes away: the task runs to its end whether or not its handler
/// is still there to read the answer, since a half-done action would leave
/// memory and the store disagreeing.
///
/// With tracing on, the action is a span (`prefixgate.admin.NAME`), current
/// while it runs: the history events it records carry its trace id.
pub(crate) async fn act<T, Fut>(
    s: &AppState,
    name: &'static str,
    action: impl FnOnce(Arc<Operator>) -> Fut,
) -> Result<T, ApiError>
where
    T: 'static,
    Fut: std::future::Future<Output = Result<T, crate::domain_error::DomainError>> + 'static,
{
    let span =
        crate::telemetry::operation_span(s.telemetry.tracer(), || (format!("prefixgate.admin.{name}"), Vec::new()));
    let running = action(s.operator.clone());
    let done = match span {
        Some(cx) => actix_web::rt::spawn(opentelemetry::context::FutureExt::with_context(running, cx)).await,
        None => actix_web::rt::spawn(running).await,
    };
    Ok(done.map_err(|e| ApiError::Internal(format!("the action did not run: {e}")))??)
}

/// An unknown method on a known path is a 405 with `Allow` (what HTTP and
/// contract testers expect); anything else a 404. The table of paths and
/// methods is the OpenAPI document itself, so it cannot drift from the routes.
async fn no_route(req: actix_web::HttpRequest) -> Result<HttpResponse, ApiError> {
    use std::sync::LazyLock;
    static ROUTES: LazyLock<Vec<(Vec<String>, Vec<&'static str>)>> = LazyLock::new(|| {
        openapi()
            .paths
            .paths
            .iter()
            .map(|(path, item)| {
                let methods = [
                    ("GET", item.get.is_some()),
                    ("PUT", item.put.is_some()),
                    ("POST", item.post.is_some()),
                    ("DELETE", item.delete.is_some()),
                    ("PATCH", item.patch.is_some()),
                ];
                let allowed = methods.iter().filter(|(_, on)| *on).map(|(m, _)| *m).collect();
                (path.split('/').map(str::to_string).collect(), allowed)
            })
            .collect()
    });
    let segments: Vec<&str> = req.path().split('/').collect();
    let matches = |template: &[String]| {
        template.len() == segments.len() && template.iter().zip(&segments).all(|(t, s)| t.starts_with('{') || t == s)
    };
    match ROUTES.iter().find(|(template, _)| matches(template)) {
        Some((_, allowed)) => Ok(HttpResponse::MethodNotAllowed()
            .insert_header((actix_web::http::header::ALLOW, allowed.join(", ")))
            .json(ApiError::MethodNotAllowed(req.method().to_string()).body())),
        None => Err(ApiError::NotFound("no such admin route".into())),
    }
}

/// Bad JSON is a 400 in the one error shape, not actix's plain-text default.
fn json_config() -> web::JsonConfig {
    const LIMIT: usize = 64 * 1024;
    web::JsonConfig::default().limit(LIMIT).error_handler(|e, _| {
        use actix_web::error::JsonPayloadError;
        match e {
            JsonPayloadError::OverflowKnownLength { .. } | JsonPayloadError::Overflow { .. } => {
                ApiError::BodyTooLarge { limit: LIMIT }
            }
            JsonPayloadError::ContentType => {
                ApiError::UnsupportedMediaType("the body must be JSON (Content-Type: application/json)".into())
            }
            e => ApiError::BadRequest(format!("invalid JSON body: {e}")),
        }
        .into()
    })
}

fn query_config() -> web::QueryConfig {
    web::QueryConfig::default().error_handler(|e, _| ApiError::BadRequest(format!("invalid query string: {e}")).into())
}

fn path_config() -> web::PathConfig {
    web::PathConfig::default().error_handler(|e, _| ApiError::BadRequest(format!("invalid path: {e}")).into())
}

async fn metrics(s: web::Data<AppState>) -> HttpResponse {
    let report = s.capacity.report(&s.fleet.capacity_inputs(s.capacity.since_ms(crate::clock::now_ms())));
    let pins = s.pins.count_by_replica();
    let fleet = s.fleet.snapshot();
    let replicas: Vec<crate::metrics::ReplicaGauges> = fleet
        .iter()
        // Counters a dashboard divides by: present from the start, at zero.
        .inspect(|r| r.series.from_zero(&s.metrics))
        .map(|r| {
            let resident = crate::sessions::Sessions::resident(r);
            crate::metrics::ReplicaGauges {
                id: r.id.to_string(),
                inflight: r.inflight(),
                large_inflight: r.large_inflight(),
                pins: pins.get(&r.id).copied().unwrap_or(0),
                up: r.routable(),
                queued: r.large_slots.queued(),
                bytes_per_token: r.calibration.bytes_per_token(),
                resident_sessions: resident.sessions,
                room_tokens: s.sessions.room_shown(r),
                resident_tokens: resident.counted_tokens,
                wall_tokens: r.residents.evidence.wall(),
            }
        })
        .collect();
    s.metrics.refresh_gauges(&replicas, &report);
    s.metrics.events_unwritten.set(s.event_writer.backlog() as i64);
    s.metrics.pin_pages_on_disk.set(s.pins.pages_left() as i64);
    let dropped = &s.metrics.events_unwritten_dropped;
    dropped.inc_by(s.events.unwritten_dropped().saturating_sub(dropped.get()));
    let paused = fleet.iter().map(|r| crate::sessions::Sessions::paused_by_class(r)).fold([0; 3], |mut sum, p| {
        sum.iter_mut().zip(p).for_each(|(s, p)| *s += p);
        sum
    });
    let held = s.sessions.held_by_class();
    for (i, class) in crate::priority::Class::ALL.into_iter().enumerate() {
        let labels = crate::metrics::ClassLabels::of(class);
        s.metrics.held_sessions.get_or_create(&labels).set(held[i] as i64);
        s.metrics.paused_turns.get_or_create(&labels).set(paused[i] as i64);
    }
    let spans = &s.metrics.spans_dropped;
    spans.inc_by(s.telemetry.dropped().saturating_sub(spans.get()));
    s.metrics.store_up.set(i64::from(s.store_up.load(std::sync::atomic::Ordering::Acquire)));
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(s.metrics.encode())
}

/// A page size: `default` when absent, else 1 to 1000 (as documented).
fn page_limit(limit: Option<usize>, default: usize) -> Result<usize, ApiError> {
    match limit.unwrap_or(default) {
        n @ 1..=1000 => Ok(n),
        n => Err(ApiError::BadRequest(format!("limit: {n} is not between 1 and 1000"))),
    }
}

#[cfg(test)]
mod tests {
    use crate::fleet::patterns;

    #[test]
    fn the_documented_patterns_are_the_ones_the_server_enforces() {
        let spec = super::openapi_json();
        for p in [patterns::ID, patterns::URL, patterns::HEALTH_PATH, patterns::API_KEY] {
            let quoted = serde_json::to_string(p).unwrap();
            assert!(spec.contains(&format!("\"pattern\": {quoted}")), "{p} is not in the OpenAPI document");
        }
    }
}
