//! The client side of the hop: one awc client per worker and what it
//! derived from each replica (target URL, headers), kept apart from the
//! handler so the lookup and the attempts can take it as an argument.

use std::sync::Arc;
use std::time::Duration;

use crate::fleet::ReplicaSpec;

use super::headers;

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

    /// A `POST /tokenize` to the replica `spec` (`count.rs`), with the
    /// credentials `req` carries there (`headers::replica_request`).
    pub(super) fn tokenize_request(&self, spec: &Arc<ReplicaSpec>, caller: headers::Caller<'_>) -> awc::ClientRequest {
        let target = self.replicas.target(spec, &actix_web::http::Uri::from_static("/tokenize"));
        headers::replica_request(&self.client, actix_web::http::Method::POST, target, caller, spec)
    }

    /// The upstream request for `req` on the replica `spec`.
    pub(super) fn request(&self, spec: &Arc<ReplicaSpec>, caller: headers::Caller<'_>) -> awc::ClientRequest {
        headers::upstream_request(&self.client, self.replicas.target(spec, caller.req.uri()), caller, spec)
    }
}
