//! One attempt: the request sent to one replica, up to its response head.
//! The error says whether a retry elsewhere is safe, as Pingora's errors do:
//! only a connection that never carried the request (refused, reset while
//! connecting or sending) may be re-sent; a timeout or a broken response may
//! have reached an engine, and generation is not idempotent.

use actix_web::web;
use awc::error::SendRequestError;

use crate::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// The request never reached the replica.
    Connect,
    /// No response head within `timeouts.response_head_ms`.
    Timeout,
    /// Anything else after the request went out (a malformed response, ...).
    Upstream,
}

#[derive(Debug)]
pub struct AttemptError {
    pub failure: AttemptFailure,
    pub message: String,
}

impl AttemptError {
    pub fn retry_safe(&self) -> bool {
        self.failure == AttemptFailure::Connect
    }

    /// The status recorded in metrics for an attempt that ended here.
    pub fn status_label(&self) -> &'static str {
        match self.failure {
            AttemptFailure::Connect => "connect_failed",
            AttemptFailure::Timeout => "504",
            AttemptFailure::Upstream => "502",
        }
    }

    pub fn into_api_error(self) -> ApiError {
        match self.failure {
            AttemptFailure::Timeout => ApiError::UpstreamTimeout,
            AttemptFailure::Connect | AttemptFailure::Upstream => ApiError::Upstream(self.message),
        }
    }
}

impl From<SendRequestError> for AttemptError {
    fn from(e: SendRequestError) -> Self {
        let failure = match e {
            SendRequestError::Connect(_) | SendRequestError::Send(_) => AttemptFailure::Connect,
            SendRequestError::Timeout => AttemptFailure::Timeout,
            _ => AttemptFailure::Upstream,
        };
        AttemptError { failure, message: e.to_string() }
    }
}

/// A response head, its body still to come.
pub type UpstreamResponse = awc::ClientResponse<actix_web::dev::Decompress<actix_web::dev::Payload>>;

/// Sends the upstream request (`headers::upstream_request`) with the
/// client's body, byte for byte.
pub async fn send(request: awc::ClientRequest, body: web::Bytes) -> Result<UpstreamResponse, AttemptError> {
    request.send_body(body).await.map_err(AttemptError::from)
}
