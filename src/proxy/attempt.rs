//! One attempt: the request built for one replica (`Upstream`, the client
//! side of the hop) and sent, up to its response head.
//! The error says whether a re-send is safe, as Pingora's errors do. The
//! retry rule, stated once (docs/operations.md, "Failover", says the same):
//!
//! | what happened | re-sent? | the replica |
//! |---|---|---|
//! | connection refused, reset or failed before the request was written | yes, to another replica | marked down at once |
//! | connection closed after the request was written, before any response byte | yes: once to the same replica on another connection, then to another replica | not marked down by this (the prober decides) |
//! | no response head within `timeouts.response_head_ms` | no: 504 | |
//! | a malformed response | no: 502 | |
//! | any response byte reached the client | never | |
//! | a stream broke after its first byte | it is continued elsewhere: token for token where the engine gave ids, else from its text (`resume/`) | |
//!
//! Why a close after the write is re-sent: it is what a client sees when the
//! replica closed an idle pooled connection just as the request went out
//! (the replica never read it: re-sending on a fresh connection is
//! harmless, and marking a healthy replica down for it would not be), and
//! when a replica died after reading the request (it answers nothing, and
//! the next attempt on it is refused). A timeout is not re-sent: the engine
//! may be generating, and generation is not idempotent.
//!
//! The one case where a re-send is not harmless: a Responses request that
//! stores its response (`store`, true unless the client says false) may
//! have been stored by a replica that then closed without answering. It is
//! re-sent all the same (the client never saw that response's id, so
//! nothing can reach it; refusing would only hand the client the retry),
//! and the history records that the replica may hold an unreachable stored
//! response.

use std::sync::Arc;
use std::time::Duration;

use actix_web::error::ParseError;
use actix_web::web;
use awc::error::{ConnectError, SendRequestError};

use super::headers;
use crate::error::ApiError;
use crate::fleet::ReplicaSpec;

/// One awc client per actix worker (awc is `!Send`), built in the app
/// factory, with what this worker derived from the replicas once.
pub struct Upstream {
    pub(super) client: awc::Client,
    pub(super) replicas: headers::PerReplica,
}

impl Upstream {
    pub fn new(t: &crate::config::Timeouts) -> Upstream {
        let connector = crate::connector::connector(Duration::from_millis(t.connect_ms))
            // No pool cap: a thousand concurrent streams is a normal day.
            .limit(0);
        let client = awc::Client::builder()
            .connector(connector)
            .no_default_headers()
            .disable_redirects()
            // awc's default of 5 s would kill a slow first token; this
            // bounds sending plus the response head only.
            .timeout(Duration::from_millis(t.response_head_ms))
            .finish();
        Upstream { client, replicas: headers::PerReplica::default() }
    }

    /// A JSON `POST` to `path` on the replica `spec` (a continued stream's
    /// next leg and the tokenizer asks before it, `resume/leg.rs`; the
    /// engine's count, `count.rs`), with the credentials `req` carries there.
    pub(super) fn post_json(
        &self,
        spec: &Arc<ReplicaSpec>,
        caller: headers::Caller<'_>,
        path: &'static str,
    ) -> awc::ClientRequest {
        let target = self.replicas.target(spec, &actix_web::http::Uri::from_static(path));
        headers::replica_request(&self.client, actix_web::http::Method::POST, target, caller, spec)
            .insert_header((actix_web::http::header::CONTENT_TYPE, "application/json"))
    }

    /// The upstream request for `req` on the replica `spec`.
    pub(super) fn request(&self, spec: &Arc<ReplicaSpec>, caller: headers::Caller<'_>) -> awc::ClientRequest {
        headers::upstream_request(&self.client, self.replicas.target(spec, caller.req.uri()), caller, spec)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// The request never reached the replica (refused, reset or failed
    /// before it was written).
    Connect,
    /// The connection closed after the request was written, before any
    /// response byte.
    ClosedAfterWrite,
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
        matches!(self.failure, AttemptFailure::Connect | AttemptFailure::ClosedAfterWrite)
    }

    /// The status recorded in metrics for an attempt that ended here.
    pub fn status_label(&self) -> &'static str {
        match self.failure {
            AttemptFailure::Connect => "connect_failed",
            AttemptFailure::ClosedAfterWrite => "closed_after_write",
            AttemptFailure::Timeout => "504",
            AttemptFailure::Upstream => "502",
        }
    }

    pub fn into_api_error(self) -> ApiError {
        match self.failure {
            AttemptFailure::Timeout => ApiError::UpstreamTimeout,
            AttemptFailure::Connect | AttemptFailure::ClosedAfterWrite | AttemptFailure::Upstream => {
                ApiError::Upstream(self.message)
            }
        }
    }
}

impl From<SendRequestError> for AttemptError {
    fn from(e: SendRequestError) -> Self {
        let failure = match e {
            // awc's name for "the connection ended where the response head should be".
            SendRequestError::Connect(ConnectError::Disconnected) => AttemptFailure::ClosedAfterWrite,
            // Reset while the head was awaited: the same, seen as an I/O error.
            SendRequestError::Response(ParseError::Io(_)) => AttemptFailure::ClosedAfterWrite,
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
