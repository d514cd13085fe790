//! Where a request may go: the candidates (from a fleet snapshot) and the
//! policy's decision. No I/O, no clock; the one thing written is the spread
//! counter, advanced for a spread decision only. The caller records what
//! came of it.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::fleet::Replica;
use crate::pins::Pin;
use crate::policy::{self, Boundary, Candidate, Mode, RequestShape, RouteReason, SpreadCounter};
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
    pub pinned: Option<&'a (Boundary, Pin)>,
    /// The replica the request's session key points at.
    pub named: Option<&'a str>,
    /// Whether a replica holds the longest prompt the request shares with
    /// conversations it does not continue (none: it shares none).
    pub holds_shared: Option<&'a dyn Fn(&str) -> bool>,
    /// How a request that continues nothing is placed.
    pub spread: policy::Spread,
    /// A pinned turn: whether it would fit a replica's room at the KV
    /// wall, should it move there (`policy::moves`). None: it fits anywhere.
    pub fits: Option<&'a dyn Fn(&Replica) -> bool>,
    /// A stored response the request names (`previous_response_id` or the
    /// path), and the replica that holds it: the only one that can serve it.
    pub stored: Option<(&'a str, &'a str)>,
    /// Replicas this request already failed on.
    pub tried: &'a [Arc<str>],
    /// True when the request counts against `max_large_inflight`; then
    /// `has_free_slot` says which replicas could start it at once.
    pub large: bool,
    /// A new session (`sessions`): the room each replica has for it. Where
    /// it fits every replica's room, it is placed as any spread
    /// (`routing.spread`); else it goes where the most room is, ties and
    /// unknown capacities to the spread.
    pub room: Option<&'a dyn Fn(&Replica) -> Room>,
    /// With `room`: the new session's footprint, as the hold admits it
    /// (its projection, `sessions::projection::admitted_tokens`).
    pub session_tokens: u64,
}

impl<'a> PlanInput<'a> {
    /// A request planned on its shape alone: no pin, session key, stored
    /// response, room or large slot (a next leg's replica; what the tests
    /// add to).
    pub fn on_shape(mode: Mode, spread: policy::Spread, shape: &'a RequestShape, tried: &'a [Arc<str>]) -> Self {
        PlanInput {
            mode,
            shape,
            pinned: None,
            named: None,
            holds_shared: None,
            spread,
            fits: None,
            stored: None,
            tried,
            large: false,
            room: None,
            session_tokens: 0,
        }
    }
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
    // A move is only weighed when the home has more work queued than the
    // turn has cached (`policy::moves`): only then are rooms asked.
    let might_move = input.pinned.is_some_and(|(m, pin)| {
        let home = fleet.iter().find(|r| r.id == pin.replica);
        home.is_some_and(|h| h.work.outstanding() > crate::tokens::estimate_tokens(m.bytes))
    });
    let mut candidates: SmallVec<[Candidate; 16]> = fleet
        .iter()
        .zip(&serving)
        .map(|(r, &serves)| Candidate {
            id: &r.id,
            routable: crate::sessions::gate::may_go_to(r, serves, input.tried),
            spare: !input.large || has_free_slot(r),
            weight: r.spec().weight(),
            load: r.work.outstanding(),
            holds_shared: input.holds_shared.is_some_and(|holds| holds(&r.id)),
            prefill_tps: r.residents.pace().prefill_tps,
            has_room: !might_move || input.fits.is_none_or(|fits| fits(r)),
        })
        .collect();
    if let (Mode::Shape, Some(room)) = (input.mode, input.room) {
        // Only the routable compete for room; the others stay out as they are.
        let routable: SmallVec<[usize; 16]> = (0..candidates.len()).filter(|i| candidates[*i].routable).collect();
        let rooms: SmallVec<[Room; 16]> = routable.iter().map(|i| room(&fleet[*i])).collect();
        // Where it fits anywhere, load places it (`routing.spread`); at the
        // wall, the most room does.
        let fits_anywhere = rooms.iter().all(|r| r.capacity.is_none() || r.fits(input.session_tokens));
        let best = most_room(&rooms);
        for (k, i) in routable.iter().enumerate() {
            candidates[*i].routable = best.contains(&k) || (fits_anywhere && input.spread == policy::Spread::Load);
        }
    }
    let pinned = input.pinned.map(|(m, pin)| (*m, &*pin.replica));
    let decision = policy::decide(input.mode, input.spread, input.shape, &candidates, pinned, input.named)
        .ok_or(PlanError::NoReplica)?;
    Ok(Route { replica: decision.candidate(&candidates, input.spread, || counter.next()), reason: decision.reason })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{AdminState, ReplicaSpec};

    fn fleet(ids: &[&str]) -> Vec<Arc<Replica>> {
        ids.iter().map(|id| Arc::new(Replica::new(ReplicaSpec::new(id, "http://x"), AdminState::Active))).collect()
    }

    /// Where a new session of `prompt_bytes` goes among `fleet`, with the
    /// rooms `taken` (tokens of 10,000), placed by `spread`; large, with a
    /// free large slot only on `slot`, when one is named.
    fn new_session(
        fleet: &[Arc<Replica>],
        taken: &[u64],
        prompt_bytes: usize,
        spread: policy::Spread,
        slot: Option<&str>,
        tried: &[Arc<str>],
        n: u64,
    ) -> String {
        let shape = RequestShape { multi_unit: true, pin_at: Some(1), prompt_bytes, ..Default::default() };
        let room = |r: &Replica| {
            let i = fleet.iter().position(|f| f.id == r.id).unwrap();
            Room { capacity: Some(10_000), taken: taken[i], slot_tokens: None }
        };
        let input = PlanInput {
            large: slot.is_some(),
            room: Some(&room),
            session_tokens: crate::tokens::estimate_tokens(prompt_bytes),
            ..PlanInput::on_shape(Mode::Shape, spread, &shape, tried)
        };
        let route = plan(&input, fleet, |r| slot == Some(&*r.id), &SpreadCounter::starting_at(n)).unwrap();
        fleet[route.replica].id.to_string()
    }

    /// A new large session, placed by the counter: with load placement, a
    /// session that fits everywhere is placed by load, not room (the next test).
    fn new_large_session(fleet: &[Arc<Replica>], taken: &[u64], slot: &str, tried: &[Arc<str>], n: u64) -> String {
        new_session(fleet, taken, 4_000, policy::Spread::Counter, Some(slot), tried, n)
    }

    #[test]
    fn a_free_large_slot_is_a_preference_among_the_most_room_never_a_reason_to_go_where_the_room_is_not() {
        let f = fleet(&["a", "b", "c"]);
        for n in 0..6 {
            // a has the most room; only b has a slot free: a, where the large
            // request then waits for its slot at admission.
            assert_eq!(new_large_session(&f, &[2_000, 5_000, 5_000], "b", &[], n), "a");
            // a and b tie on room: the one with a slot free, whatever the counter.
            assert_eq!(new_large_session(&f, &[2_000, 2_000, 5_000], "b", &[], n), "b");
            // The rule (`may_go_to`): never one this request failed on.
            assert_eq!(new_large_session(&f, &[2_000, 5_000, 9_000], "b", &[Arc::from("a")], n), "b");
        }
    }

    #[test]
    fn with_load_placement_a_new_session_that_fits_everywhere_goes_to_the_least_work_not_the_most_room() {
        let f = fleet(&["a", "b"]);
        f[1].work_for_tests(5_000);
        let place = |prompt_bytes| new_session(&f, &[6_000, 1_000], prompt_bytes, policy::Spread::Load, None, &[], 0);
        // 1,000 tokens fit both: a, with less room but no work queued.
        assert_eq!(place(4_000), "a");
        // 5,000 tokens fit only b's room: the room decides.
        assert_eq!(place(20_000), "b");
    }
}
