//! Finding the replica that holds a stored response this instance does not
//! know (Responses API: `previous_response_id`, or a path under
//! `/v1/responses/{id}`).
//!
//! Why it happens: a client's follow-up can reach this instance before the
//! instance that served the response announced its id (a load balancer picks
//! any instance, and the follow-up comes right after the body ends); or this
//! instance lost its pins (a restart without a shared store, several
//! instances without Redis). Forwarding such a request to whichever replica
//! the spread picks ends a Codex-style conversation with a 404 one time in N.
//!
//! What is done, in order, each step bounded:
//! 1. a shared store is asked for the pin (`store.read_through_ms`): it may
//!    have been persisted while its announcement was missed;
//! 2. the replicas that serve the model are asked, in parallel,
//!    `GET /v1/responses/{id}` (`timeouts.locate_response_ms`); the first to
//!    answer 200 holds it (engines keep stored responses per process, and
//!    their ids are random: no two replicas answer to one id);
//! 3. nobody has it: the request is forwarded as it is, and the client gets
//!    the engine's own 404. The id is not asked about again for
//!    `timeouts.unknown_response_ms` (`unknown_ids.rs`): each replica sees
//!    at most one lookup per id in that window.
//!
//! An id reaches here only once checked (`conversation::check_response_id`:
//! letters, digits, `_`, `-`), so it is one path segment of the lookup.
//!
//! A found answer is recorded as a pin (and announced), so the next
//! follow-up needs no asking. No step needs a shared store: step 2 works for
//! one instance, or several without Redis.

use std::sync::Arc;
use std::time::Duration;

use actix_web::http::Method;
use actix_web::http::Uri;
use actix_web::HttpRequest;
use futures_util::future::{select_ok, FutureExt};

use super::attempt::Upstream;
use super::outcome::OutcomeRecorder;
use crate::metrics::ResultLabels;
use crate::policy::conversation::response_key;
use crate::policy::PrefixKey;
use crate::state::AppState;

/// The replica holding the stored response `id`, if anyone does.
/// Its pin is the request's tenant's (`scope`): a client scoped apart
/// never finds another's in the store. Found, it is recorded (`recorder`).
pub async fn stored_response(
    (state, upstream, recorder): (&AppState, &Upstream, &OutcomeRecorder),
    scope: crate::policy::tenancy::Scope,
    req: &HttpRequest,
    id: &str,
    model: Option<&str>,
) -> Option<Arc<str>> {
    let key = scope.key(response_key(id));
    let found = match in_shared_store(state, key).await {
        Some(home) => Some(("store", home)),
        None if state.unknown_responses.claim(id, crate::clock::now_ms()) => {
            ask_replicas(state, upstream, req, id, model).await.map(|home| ("replica", home))
        }
        None => None,
    };
    if found.is_some() {
        state.unknown_responses.found(id);
    }
    let result = found.as_ref().map_or("unknown", |(how, _)| how);
    state.metrics.stored_response_lookups.get_or_create(&ResultLabels { result }).inc();
    let (how, home) = found?;
    tracing::debug!(replica = %home, "located a stored response unknown here (found in the {how})");
    recorder.stored_response(key, &home);
    Some(home)
}

/// A turn that outran the announcement of the pins it continues (another
/// instance answered its previous turn a moment ago, and this one has not
/// applied the message yet): the shared store, written before the message
/// went out (`Store::publish_pins`), is read for `keys` within
/// `store.read_through_ms`, and what it holds is applied here as if heard.
/// Returns whether anything was found.
pub async fn pins_in_shared_store(state: &AppState, keys: Vec<PrefixKey>) -> bool {
    if keys.is_empty() || !state.shared_store_answers() {
        return false;
    }
    let budget = Duration::from_millis(state.config.store.read_through_ms);
    let found: Vec<_> = match tokio::time::timeout(budget, state.store.pins_at(&keys)).await {
        Ok(Ok(pins)) => keys.into_iter().zip(pins).filter(|(_, pin)| pin.is_some()).collect(),
        _ => Vec::new(),
    };
    let result = if found.is_empty() { "missed" } else { "found" };
    state.metrics.pin_read_through.get_or_create(&ResultLabels { result }).inc();
    let any = !found.is_empty();
    state.operator.apply_pins(found);
    any
}

/// Step 1: the shared store's copy, within the read-through budget.
async fn in_shared_store(state: &AppState, key: PrefixKey) -> Option<Arc<str>> {
    if !state.shared_store_answers() {
        return None;
    }
    let budget = Duration::from_millis(state.config.store.read_through_ms);
    // Not waited for beyond the budget (a slow store costs this request nothing more).
    match tokio::time::timeout(budget, state.store.pins_at(&[key])).await {
        Ok(Ok(mut pins)) => pins.pop().flatten().map(|pin| pin.replica),
        _ => None,
    }
}

/// Step 2: every replica that could hold it is asked at once; the first 200 wins.
async fn ask_replicas(
    state: &AppState,
    upstream: &Upstream,
    req: &HttpRequest,
    id: &str,
    model: Option<&str>,
) -> Option<Arc<str>> {
    let path: Uri = format!("/v1/responses/{id}").parse().ok()?;
    let gateway_keys = !state.config.api_keys.is_empty();
    let asks: Vec<_> = state
        .fleet
        .snapshot()
        .iter()
        // A draining replica still serves the responses it stored.
        .filter(|r| r.admin() != crate::fleet::AdminState::Disabled && r.health() != crate::fleet::Health::Down)
        .filter(|r| model.is_none_or(|m| r.serves(m)))
        .map(|r| {
            let spec = r.spec();
            // Host and credentials as the request itself would carry them (`headers.rs`).
            let target = upstream.replicas.target(&spec, &path);
            let caller = super::headers::Caller { req, gateway_keys };
            let ask = super::headers::replica_request(&upstream.client, Method::GET, target, caller, &spec);
            let name = r.id.clone();
            async move {
                // The body is not read: the status answers the question, and
                // dropping the response closes that connection.
                match ask.send().await {
                    Ok(resp) if resp.status().is_success() => Ok(name),
                    _ => Err(()),
                }
            }
            .boxed_local()
        })
        .collect();
    if asks.is_empty() {
        return None;
    }
    let budget = Duration::from_millis(state.config.timeouts.locate_response_ms);
    match tokio::time::timeout(budget, select_ok(asks)).await {
        Ok(Ok((home, _))) => Some(home),
        _ => None,
    }
}
