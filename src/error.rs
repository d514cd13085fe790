//! One error type for everything a client or operator can be told, mapped to
//! an HTTP status and OpenAI's error JSON: `{"error":{"message","type","code"}}`.
//! The status of each variant is an exhaustive match: a new variant forces a
//! decision.

use std::time::Duration;

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("request body is larger than the {limit}-byte limit")]
    BodyTooLarge { limit: usize },
    #[error("the model '{0}' does not exist or is not served by any replica")]
    ModelNotFound(String),
    #[error("no replica is available to serve this request; retry shortly")]
    NoReplica,
    #[error("{message}")]
    Overloaded { message: String, retry_after: Duration },
    /// A stored response lives on one replica, and that replica cannot serve it now.
    #[error("response '{id}' is stored on replica '{replica}', which {why}; it cannot be served by another replica")]
    StoredResponseUnavailable { id: String, replica: String, why: String, gone: bool },
    #[error("the replica did not answer in time")]
    UpstreamTimeout,
    #[error("the replica failed: {0}")]
    Upstream(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("method {0} is not allowed here (see the Allow header)")]
    MethodNotAllowed(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("too many requests; retry after {} s", retry_after.as_secs().max(1))]
    RateLimited { retry_after: Duration },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error("{0}")]
    Timeout(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// OpenAI's error envelope.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub code: Option<String>,
}

impl ApiError {
    /// (status, OpenAI `type`, `code`)
    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        use ApiError::*;
        match self {
            BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request"),
            BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "body_too_large"),
            ModelNotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found"),
            NoReplica => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "no_routable_replica"),
            Overloaded { .. } => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "admission_queue_full"),
            StoredResponseUnavailable { gone: true, .. } => {
                (StatusCode::NOT_FOUND, "invalid_request_error", "response_replica_removed")
            }
            StoredResponseUnavailable { gone: false, .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "response_replica_unavailable")
            }
            UpstreamTimeout => (StatusCode::GATEWAY_TIMEOUT, "upstream_error", "upstream_timeout"),
            Upstream(_) => (StatusCode::BAD_GATEWAY, "upstream_error", "upstream_failed"),
            UnsupportedMediaType(_) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", "unsupported_media_type")
            }
            MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed"),
            Unauthorized(_) => (StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key"),
            RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "rate_limited"),
            NotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "not_found"),
            Conflict(_) => (StatusCode::CONFLICT, "invalid_request_error", "conflict"),
            Unprocessable(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request_error", "invalid_value"),
            Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout_error", "timeout"),
            Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error"),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::NoReplica | ApiError::StoredResponseUnavailable { gone: false, .. } => {
                Some(Duration::from_secs(1))
            }
            ApiError::Overloaded { retry_after, .. } | ApiError::RateLimited { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let (_, kind, code) = self.parts();
        ErrorBody { error: ErrorDetail { message: self.to_string(), kind: kind.into(), code: Some(code.into()) } }
    }
}

/// Anthropic's error envelope: `{"type":"error","error":{"type","message"}}`.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AnthropicErrorBody {
    #[serde(rename = "type")]
    pub kind: String,
    pub error: AnthropicErrorDetail,
}

#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct AnthropicErrorDetail {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

impl ApiError {
    /// The error as Anthropic's API would phrase it (their `type` follows the status).
    pub fn anthropic_body(&self) -> AnthropicErrorBody {
        let kind = match self.parts().0.as_u16() {
            400 | 405 | 415 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        AnthropicErrorBody {
            kind: "error".into(),
            error: AnthropicErrorDetail { kind: kind.into(), message: self.to_string() },
        }
    }

    /// The response in the error shape of the API the client speaks.
    pub fn response_for(&self, dialect: crate::policy::Dialect) -> HttpResponse {
        let mut res = self.error_response();
        if dialect == crate::policy::Dialect::Messages {
            let body = serde_json::to_vec(&self.anthropic_body()).expect("serializable");
            res = res.set_body(actix_web::body::BoxBody::new(body));
        }
        res
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.parts().0
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status_code());
        if let Some(after) = self.retry_after() {
            // Whole seconds, rounded up: Retry-After has no sub-second form.
            let secs = after.as_millis().div_ceil(1000).max(1);
            res.insert_header((header::RETRY_AFTER, secs.to_string()));
        }
        res.json(self.body())
    }
}

/// The HTTP edge of the domain's refusals: each to its status and code.
impl From<crate::domain_error::DomainError> for ApiError {
    fn from(e: crate::domain_error::DomainError) -> ApiError {
        use crate::domain_error::DomainError::*;
        match e {
            NotFound(m) => ApiError::NotFound(m),
            Conflict(m) => ApiError::Conflict(m),
            Invalid(m) => ApiError::Unprocessable(m),
            Timeout(m) => ApiError::Timeout(m),
            Overloaded { message, retry_after } => ApiError::Overloaded { message, retry_after },
            Store(e) => ApiError::Internal(e),
        }
    }
}

impl From<actix_web::error::PayloadError> for ApiError {
    // The size limit is enforced while reading (BodyTooLarge with the real
    // limit); what arrives here is a client that broke off or sent bad framing.
    fn from(e: actix_web::error::PayloadError) -> Self {
        ApiError::BadRequest(format!("could not read the request body: {e}"))
    }
}

/// A stream's error event as each API writes it (a stream that broke
/// after its first byte ends with it: the SDKs raise it).
pub fn stream_error_event(dialect: crate::policy::Dialect, message: &str) -> String {
    match dialect {
        crate::policy::Dialect::Messages => {
            let e = serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}});
            format!("event: error\ndata: {e}\n\n")
        }
        crate::policy::Dialect::Responses => {
            let e = serde_json::json!({"type": "error", "code": "upstream_stream_failed", "message": message, "param": null});
            format!("event: error\ndata: {e}\n\n")
        }
        _ => {
            let e = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": "upstream_stream_failed"}});
            format!("data: {e}\n\n")
        }
    }
}
