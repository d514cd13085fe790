//! `/admin/v1/pins`: which replica holds which conversation prefix.

use actix_web::{delete, get, web, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::clock::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::pins::Pin;
use crate::policy::PrefixKey;
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(list).service(get_one).service(remove);
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PinView {
    /// The prefix key, 32 hex digits.
    #[schema(example = "4f1c0b7e9a2d3c5b6a7f8e9d0c1b2a39")]
    pub key: String,
    pub replica: String,
    pub created: String,
    pub last_used: String,
    pub turns: u32,
    pub est_tokens: u64,
    /// The API the conversation speaks.
    pub dialect: crate::policy::Dialect,
    /// Which kind of key this pin is: a prompt prefix, a `prompt_cache_key`,
    /// a session header, or a stored response's id.
    pub pinned_by: crate::pins::PinSource,
}

fn view(key: PrefixKey, p: &Pin) -> PinView {
    PinView {
        key: format!("{key:032x}"),
        replica: p.replica.to_string(),
        created: rfc3339(p.created_ms),
        last_used: rfc3339(p.last_used_ms),
        turns: p.turns,
        est_tokens: p.est_tokens,
        dialect: p.origin.dialect,
        pinned_by: p.origin.source,
    }
}

/// A pin's key on the wire: 32 hex digits. One schema for every path that
/// names a pin.
pub struct PinKey;

/// The start of a pin's key: up to 32 hex digits.
pub struct PinKeyPrefix;

fn hex_schema(pattern: &str, description: &str) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .pattern(Some(pattern))
        .description(Some(description))
        .into()
}

impl utoipa::PartialSchema for PinKey {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        hex_schema("^[0-9a-fA-F]{32}$", "A pin's key: 32 hex digits.")
    }
}

impl utoipa::ToSchema for PinKey {}

impl utoipa::PartialSchema for PinKeyPrefix {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        hex_schema("^[0-9a-fA-F]{0,32}$", "The start of a pin's key: up to 32 hex digits.")
    }
}

impl utoipa::ToSchema for PinKeyPrefix {}

#[derive(Debug, Deserialize, IntoParams)]
pub struct PinQuery {
    /// Only pins held by this replica.
    #[param(value_type = Option<crate::fleet::ReplicaId>)]
    pub replica: Option<String>,
    /// Only pins whose key starts with these hex digits.
    #[param(value_type = Option<PinKeyPrefix>)]
    pub key_prefix: Option<String>,
    #[serde(default)]
    #[param(minimum = 0)]
    pub offset: i32,
    /// Page size (default 50).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PinPage {
    pub total: usize,
    pub offset: usize,
    pub limit: usize,
    /// Most recently used first.
    pub items: Vec<PinView>,
}

#[utoipa::path(tag = "pins", params(PinQuery), responses((status = 200, body = PinPage), (status = 400, body = ErrorBody)))]
#[get("/pins")]
async fn list(s: web::Data<AppState>, q: web::Query<PinQuery>) -> Result<web::Json<PinPage>, ApiError> {
    let limit = super::page_limit(q.limit, 50)?;
    let prefix = q.key_prefix.as_deref().unwrap_or("").to_ascii_lowercase();
    if !prefix.chars().all(|c| c.is_ascii_hexdigit()) || prefix.len() > 32 {
        return Err(ApiError::BadRequest("key_prefix must be up to 32 hex digits".into()));
    }
    if let Some(r) = &q.replica {
        crate::fleet::validate_id(r).map_err(ApiError::BadRequest)?;
    }
    let offset = usize::try_from(q.offset).map_err(|_| ApiError::BadRequest("offset: must be at least 0".into()))?;
    // Off the workers: after a start it may first read the pages still on disk.
    let (pins, replica) = (s.pins.clone(), q.replica.clone());
    let (total, items) = web::block(move || pins.page(replica.as_deref(), &prefix, offset, limit))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(web::Json(PinPage { total, offset, limit, items: items.iter().map(|(k, p)| view(*k, p)).collect() }))
}

fn parse_key(key: &str) -> Result<PrefixKey, ApiError> {
    if key.len() != 32 {
        return Err(ApiError::BadRequest("a pin key is 32 hex digits".into()));
    }
    PrefixKey::from_str_radix(key, 16).map_err(|_| ApiError::BadRequest("a pin key is 32 hex digits".into()))
}

#[utoipa::path(tag = "pins", params(("key" = PinKey, Path)),
    responses((status = 200, body = PinView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
#[get("/pins/{key}")]
async fn get_one(s: web::Data<AppState>, key: web::Path<String>) -> Result<web::Json<PinView>, ApiError> {
    let k = parse_key(&key)?;
    let pin = s.pins.get(k).ok_or_else(|| ApiError::NotFound(format!("no pin {key}")))?;
    Ok(web::Json(view(k, &pin)))
}

#[utoipa::path(tag = "pins", params(("key" = PinKey, Path)),
    responses((status = 204, description = "deleted"), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
#[delete("/pins/{key}")]
async fn remove(s: web::Data<AppState>, key: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let key = parse_key(&key)?;
    super::act(&s, "delete_pin", move |op| async move { op.delete_pin(key).await }).await?;
    Ok(HttpResponse::NoContent().finish())
}
