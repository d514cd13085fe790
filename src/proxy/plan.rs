//! Where a request may go: the candidates (from a fleet snapshot) and the
//! policy's decision. No I/O, no clock; the one thing written is the spread
//! counter, advanced for a spread decision only. The caller records what
//! came of it.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::fleet::Replica;
use crate::pins::Pin;
use crate::policy::{self, Candidate, Mode, PrefixMatch, RequestShape, RouteReason, SpreadCounter};
use crate::sessions::room::{most_room, Room};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// No replica serves the requested model (with a non-empty fleet).
    ModelNotFound(String),
    /// Nothing routable is left (all down, draining, or already tried).
    NoReplica,
    /// The request names a stored response whose replica cannot serve it.
    StoredResponse { id: String, replica: String, why: &'static str, gone: bool },
}

/// Where the request goes: an index into the fleet snapshot, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub replica: usize,
    pub reason: RouteReason,
}

/// What a plan needs to know about the request besides its shape.
pub struct PlanInput<'a> {
    pub mode: Mode,
    pub shape: &'a RequestShape,
    /// The longest pinned prefix of the request, looked up once per request.
    pub pinned: Option<&'a (PrefixMatch, Pin)>,
    /// The replica the request's session key points at.
    pub named: Option<&'a str>,
    /// A stored response the request names (`previous_response_id` or the
    /// path), and the replica that holds it: the only one that can serve it.
    pub stored: Option<(&'a str, &'a str)>,
    /// Replicas this request already failed on.
    pub tried: &'a [Arc<str>],
    /// True when the request counts against `max_large_inflight`; then
    /// `has_free_slot` says which replicas could start it at once.
    pub large: bool,
    /// A new session (`sessions`): the room each replica has for it. It goes
    /// where the most room is; ties and unknown capacities to the counter.
    pub room: Option<&'a dyn Fn(&Replica) -> Room>,
}

pub fn plan(
    input: &PlanInput,
    fleet: &[Arc<Replica>],
    has_free_slot: impl Fn(&Replica) -> bool,
    counter: &SpreadCounter,
) -> Result<Route, PlanError> {
    if let Some((id, home)) = input.stored {
        return stored_response(id, home, fleet, input.tried);
    }
    let model = input.shape.model.as_deref();
    // Each replica's model list is read once (on the stack for fleets of up
    // to 16 replicas: no allocation per request).
    let serving: SmallVec<[bool; 16]> = fleet.iter().map(|r| model.is_none_or(|m| r.serves(m))).collect();
    if let Some(m) = model {
        if !fleet.is_empty() && !serving.contains(&true) {
            return Err(PlanError::ModelNotFound(m.to_string()));
        }
    }
    let mut candidates: SmallVec<[Candidate; 16]> = fleet
        .iter()
        .zip(&serving)
        .map(|(r, &serves)| Candidate {
            id: &r.id,
            routable: serves && r.routable() && !input.tried.contains(&r.id),
            spare: !input.large || has_free_slot(r),
            weight: r.spec().weight(),
        })
        .collect();
    if let (Mode::Shape, Some(room)) = (input.mode, input.room) {
        // Only the routable compete for room; the others stay out as they are.
        let routable: SmallVec<[usize; 16]> = (0..candidates.len()).filter(|i| candidates[*i].routable).collect();
        let rooms: SmallVec<[Room; 16]> = routable.iter().map(|i| room(&fleet[*i])).collect();
        let best = most_room(&rooms);
        for (k, i) in routable.iter().enumerate() {
            candidates[*i].routable = best.contains(&k);
        }
    }
    let pinned = input.pinned.map(|(m, pin)| (*m, &*pin.replica));
    let decision =
        policy::decide(input.mode, input.shape, &candidates, pinned, input.named).ok_or(PlanError::NoReplica)?;
    Ok(Route { replica: decision.candidate(&candidates, || counter.next()), reason: decision.reason })
}

/// A stored response goes to its replica or nowhere: it exists only there.
/// Draining does not stop it (the drain completes when such follow-ups stop);
/// disabled, down, removed or refusing connections does, with a clear error.
fn stored_response(id: &str, home: &str, fleet: &[Arc<Replica>], tried: &[Arc<str>]) -> Result<Route, PlanError> {
    let unavailable =
        |why, gone| PlanError::StoredResponse { id: id.to_string(), replica: home.to_string(), why, gone };
    let Some(i) = fleet.iter().position(|r| &*r.id == home) else {
        return Err(unavailable("has been removed from the fleet", true));
    };
    let r = &fleet[i];
    if tried.iter().any(|t| &**t == home) {
        return Err(unavailable("refused the connection", false));
    }
    if r.admin() == crate::fleet::AdminState::Disabled {
        return Err(unavailable("is disabled by an operator", false));
    }
    if r.health() == crate::fleet::Health::Down {
        return Err(unavailable("is down (failing health checks)", false));
    }
    Ok(Route { replica: i, reason: RouteReason::Response })
}
