//! What a request is, looked up once before any attempt: its shape, its
//! session, and every pin that names a home for it.

use std::sync::Arc;

use actix_web::HttpRequest;

use crate::error::ApiError;
use crate::pins::Pin;
use crate::policy::tenancy::Scope;
use crate::policy::{self, conversation, Boundary, Dialect, Endpoint, Mode, PolicySettings, PrefixKey};
use crate::sessions::gate::Ask;
use crate::state::AppState;

use super::attempt::Upstream;
use super::outcome::OutcomeRecorder;
use super::{headers, locate, trace};

/// `/v1/responses/{id}` and everything below it name a stored response.
fn stored_response_in_path(path: &str) -> Option<&str> {
    let id = path.strip_prefix("/v1/responses/")?.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// What a request is, looked up once before any attempt: its shape and
/// every pin that names a home for it.
pub(super) struct Lookup {
    pub(super) shape: policy::RequestShape,
    pub(super) session: Option<conversation::SessionKey>,
    /// Counts against `max_large_inflight`.
    pub(super) large: bool,
    /// The longest pinned prefix of the request: the conversation it continues.
    pub(super) pinned: Option<(Boundary, Pin)>,
    /// The longest prompt it shares with conversations it does not
    /// continue (`policy::continues`), and the latest replica to serve it;
    /// its holders (`PinTable::holds`) are preferred among equals.
    pub(super) shared: Option<(PrefixKey, Arc<str>)>,
    /// Where the request's session key points.
    pub(super) named: Option<Arc<str>>,
    /// A stored response the request names, and the replica holding it.
    pub(super) stored: Option<(String, Arc<str>)>,
    /// The tenant its keys belong to (`identity.scope`).
    pub(super) scope: Scope,
}

/// What the lookup reaches: the gateway, this worker's upstream client and
/// recorder, the request's trace, and the tenant its keys belong to.
#[derive(Clone, Copy)]
pub(super) struct Hop<'a> {
    pub(super) state: &'a AppState,
    pub(super) upstream: &'a Upstream,
    pub(super) recorder: &'a OutcomeRecorder,
    pub(super) trace: &'a trace::RequestTrace,
    pub(super) scope: Scope,
}

pub(super) async fn look_up(
    req: &HttpRequest,
    endpoint: Endpoint,
    body: &[u8],
    hop: Hop<'_>,
    settings: &PolicySettings,
) -> Result<Lookup, ApiError> {
    let Hop { state, recorder, scope, .. } = hop;
    let config = &state.config;
    let bad_request = |e: policy::ShapeError| {
        recorder.rejected("bad_request");
        ApiError::BadRequest(e.0)
    };
    let mut shape = policy::identity::extract(endpoint, body, settings.identity).map_err(bad_request)?;
    scope.shape(&mut shape);
    let stored_in_path = stored_response_in_path(req.path());
    // Responses from other paths (GET /v1/responses/{id}, ...) still speak their API.
    if stored_in_path.is_some() {
        shape.dialect = Dialect::Responses;
    }
    // Scoped: the header list is not kept in the request's future.
    let session = {
        let headers = headers::RequestHeaders::of(req);
        let header = |name: &str| headers.get(name);
        conversation::session_key(shape.model.as_deref(), shape.cache_key.as_deref(), header, &config.sessions.headers)
            .map_err(bad_request)?
            .map(|s| conversation::SessionKey { key: scope.key(s.key), ..s })
    };
    // The large/small decision uses the documented default ratio: it is
    // made before a replica (and its calibrated ratio) is chosen.
    let large = crate::tokens::estimate_tokens(shape.prompt_bytes) >= config.admission.large_context_tokens;
    // A single unit (one message, one prompt) continues nothing.
    let longest_pinned = || {
        if !shape.multi_unit {
            return (None, None);
        }
        let ends_at = shape.pin_index().unwrap_or(shape.boundaries.len() - 1);
        let found = state.pins.lookup_longest(&shape.boundaries, &shape.leads, ends_at);
        (found.continued, found.shared.map(|(b, pin)| (b.key, pin.replica)))
    };
    let named_home = || session.and_then(|s| state.pins.replica_of(s.key));
    let ((mut pinned, mut shared), mut named) = (longest_pinned(), named_home());
    // Unknown here is not unknown to the fleet: with instances behind a load
    // balancer, a turn can outrun its previous turn's announcement. (Only
    // asked while a shared store answers: one instance has nothing to read.)
    if state.shared_store_answers() {
        let mut unknown = Vec::new();
        if shape.multi_unit && pinned.is_none() {
            unknown.extend(shape.boundaries.iter().chain(shape.leads.iter().flatten()).map(|b| b.key));
        }
        if let Some(s) = session.filter(|_| named.is_none()) {
            unknown.push(s.key);
        }
        if locate::pins_in_shared_store(state, unknown).await {
            ((pinned, shared), named) = (longest_pinned(), named_home());
        }
    }
    if settings.mode == Mode::Shape && shape.multi_unit {
        recorder.pin_lookup(pinned.is_some());
    }
    let stored = stored_response(hop, req, &shape, stored_in_path).await.map_err(bad_request)?;
    Ok(Lookup { shape, session, large, pinned, shared, named, stored, scope })
}

/// The stored response a request names (its path's, or its
/// `previous_response_id`), and the replica holding it. One unknown here is
/// looked for (`locate.rs`); one nobody holds is forwarded like anything
/// else, and the engine that does not know it answers for itself.
async fn stored_response(
    hop: Hop<'_>,
    req: &HttpRequest,
    shape: &policy::RequestShape,
    in_path: Option<&str>,
) -> Result<Option<(String, Arc<str>)>, policy::ShapeError> {
    if let Some(id) = in_path {
        conversation::check_response_id("path: the response id", id)?;
    }
    if let Some(id) = shape.previous_response.as_deref() {
        conversation::check_response_id("previous_response_id", id)?;
    }
    let Some(id) = shape.previous_response.as_deref().or(in_path) else { return Ok(None) };
    let (state, scope) = (hop.state, hop.scope);
    let home = match state.pins.replica_of(scope.key(conversation::response_key(id))) {
        Some(home) => Some(home),
        None => {
            let _looking = hop.trace.child(state, "prefixgate.locate");
            let reaches = (state, hop.upstream, hop.recorder);
            locate::stored_response(reaches, scope, req, id, shape.model.as_deref()).await
        }
    };
    Ok(home.map(|home| (id.to_string(), home)))
}

impl Lookup {
    /// The session this request is a turn of, as the gate asks it (None:
    /// not a session: a one-shot or a batch member keeps the counter
    /// spread, unheld). A new session is a conversation-shaped request
    /// (several messages, or a session key) that nothing pins yet: an
    /// agent's first turn. Turns of a resident session (pinned, named by
    /// its key, or a stored response's chain) are never held with them.
    pub(super) fn ask<'a>(
        &'a self,
        mode: Mode,
        known: &crate::sessions::Sessions,
        who: &'a crate::priority::Who,
    ) -> Option<Ask<'a>> {
        let (session, new) = if let Some((_, pin)) = &self.pinned {
            (pin.family, false)
        } else if let Some((id, _)) = &self.stored {
            (self.scope.key(conversation::response_key(id)), false)
        } else if let Some(s) = self.session {
            (s.key, self.named.is_none() && !known.is_resident(s.key) && mode == Mode::Shape)
        } else {
            match (self.shape.multi_unit, self.shape.pin_at) {
                (true, Some(first)) => (first, mode == Mode::Shape),
                _ => return None,
            }
        };
        Some(Ask {
            session,
            new,
            link: self.shape.boundaries.first().map(|b| b.key),
            tokens: crate::tokens::estimate_tokens(self.shape.prompt_bytes),
            model: self.shape.model.as_deref(),
            who,
        })
    }
}
