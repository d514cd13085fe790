//! The request path's side of the hold (`sessions/`): which request is a
//! session's turn and which starts a new one, the room each replica has,
//! the wait itself, and what it leaves in history and metrics.
//!
//! A new session is a conversation-shaped request (several messages, or a
//! session key) that nothing pins yet: an agent's first turn. One-shots and
//! batch members are not sessions: they keep the counter spread, unheld.
//! Turns of a resident session (pinned, named by its key, or a stored
//! response's chain) are never held in the queue of new sessions: they
//! pause only when their replica is crossed and they are the first to give
//! way there (`pause_if_over`: the lowest class, the client with the most
//! sessions, the youngest), so the others stay warm; or when a waiting
//! session of a higher class took their room between turns (`preempt_for`).

use std::time::Duration;

use super::lookup::Lookup;
use crate::error::ApiError;
use crate::events::EventKind;
use crate::fleet::Replica;
use crate::policy::{Mode, PolicySettings, PrefixKey};
use crate::priority::{Class, Who};
use crate::sessions::room::{verdict, Verdict};
use crate::sessions::{Held, Reservation};
use std::sync::Arc;

use crate::sessions::Room;
use crate::state::AppState;

/// What a request is to the sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTurn {
    /// The session's id: its prefix family, its key's, or its first pin's.
    pub id: PrefixKey,
    /// Nothing pins it yet: placed by room, and held at the wall.
    pub new: bool,
}

/// The session `lookup` is a turn of, if any.
pub fn session_of(lookup: &Lookup, settings: &PolicySettings, state: &AppState) -> Option<SessionTurn> {
    if let Some((_, pin)) = &lookup.pinned {
        return Some(SessionTurn { id: pin.family, new: false });
    }
    if let Some((id, _)) = &lookup.stored {
        return Some(SessionTurn { id: lookup.scope.key(crate::policy::sessions::response_key(id)), new: false });
    }
    if let Some(s) = lookup.session {
        let new = lookup.named.is_none() && !state.sessions.is_resident(s.key);
        return Some(SessionTurn { id: s.key, new: new && settings.mode == Mode::Shape });
    }
    let shape = &lookup.shape;
    match (shape.multi_unit, shape.pin_at) {
        (true, Some(first)) => Some(SessionTurn { id: first, new: settings.mode == Mode::Shape }),
        _ => None,
    }
}

/// The rooms of the replicas a new session could go to (routable, serving its model).
fn candidate_rooms(state: &AppState, model: Option<&str>) -> Vec<Room> {
    let fleet = state.fleet.snapshot();
    fleet
        .iter()
        .filter(|r| r.routable() && model.is_none_or(|m| r.serves(m)))
        .map(|r| state.sessions.room_of(r))
        .collect()
}

/// Preempts lower-class sessions between turns for a waiting session of
/// `who`'s class (`Sessions::preempt_for`); history and metrics record
/// each. True when any was.
fn preempt_for(state: &AppState, model: Option<&str>, tokens: u64, who: &Who) -> bool {
    preempt(state, model, tokens, who.class, None, &who_said(who))
}

/// Preempts lower-class residents for a waiting session of `class` and
/// `tokens` (`Sessions::preempt_for`; `boundary`: a session at its turn
/// boundary now); history and metrics record each. `for_whom`: the waiting
/// session, in words.
fn preempt(
    state: &AppState,
    model: Option<&str>,
    tokens: u64,
    class: Class,
    boundary: Option<PrefixKey>,
    for_whom: &str,
) -> bool {
    let candidates: Vec<Arc<Replica>> =
        state.fleet.snapshot().iter().filter(|r| r.routable() && model.is_none_or(|m| r.serves(m))).cloned().collect();
    let preempted = state.sessions.preempt_for(&candidates, class, tokens, boundary);
    for (replica, class) in &preempted {
        state.metrics.sessions_preempted.get_or_create(&crate::metrics::ClassLabels::of(*class)).inc();
        let detail = format!(
            "a {} session gave its room, between its turns, to a waiting session of ~{tokens} tokens ({for_whom}); its next turn waits for room",
            class.as_str(),
        );
        tracing::info!(replica = %replica, class = class.as_str(), "a session was preempted at its turn boundary");
        state.events.record(EventKind::SessionPreempted, Some(replica), None, detail);
    }
    !preempted.is_empty()
}

/// A resident session's next turn is arriving: its turn boundary, whether
/// or not its last turn's stream end was seen (an agent sends its next turn
/// on the last chunk). A held session of a higher class takes its room now,
/// if that frees enough (`priority.preempt`), rather than waiting for a
/// moment between its turns that a streaming agent never leaves; this turn
/// then pauses (`pause_if_over`). A turn that started is never cut.
pub fn yield_at_boundary(state: &AppState, replica: &Replica, session: PrefixKey, model: Option<&str>) {
    if !state.config.priority.preempt || state.sessions.settings().max_wait_ms == 0 {
        return;
    }
    let Some((class, tokens)) = state.sessions.next_held() else { return };
    let mine = replica.residents.get(session).map(|r| r.class);
    if mine.is_some_and(|mine| class > mine) {
        preempt(state, model, tokens, class, Some(session), &format!("class {}", class.as_str()));
    }
}

/// A session's first link (system prompt, instructions, tools): what its
/// projection is kept by (`sessions/projection.rs`).
pub fn first_link(lookup: &Lookup) -> Option<PrefixKey> {
    lookup.shape.boundaries.first().map(|b| b.key)
}

/// The tokens a new session of `now` tokens is admitted against: what its
/// first link's sessions (else the fleet's) grew to, at most the largest
/// candidate's capacity (`projection::admitted_tokens`).
pub fn admitted_tokens(state: &AppState, lookup: &Lookup, now: u64) -> u64 {
    let projected = state.sessions.project(first_link(lookup));
    let largest = candidate_rooms(state, lookup.shape.model.as_deref()).iter().filter_map(|r| r.capacity).max();
    crate::sessions::projection::admitted_tokens(now, projected, largest)
}

/// Pauses this turn of resident session `session` on `replica` while the
/// sessions there outgrew its KV and it is the youngest (`Sessions::pause_if_over`);
/// history and metrics record a pause. Returns how long it paused.
pub async fn pause_if_over(
    state: &AppState,
    replica: &Replica,
    session: PrefixKey,
    tokens: u64,
    who: &Who,
) -> Option<Duration> {
    let (preempted, class) = replica.residents.get(session).map_or((false, who.class), |r| (r.preempted, r.class));
    let paused = state.sessions.pause_if_over(replica, session, tokens).await?;
    state.metrics.session_turns_paused.get_or_create(&crate::metrics::ClassLabels::of(class)).inc();
    let why = match preempted {
        true => "a session of a higher class had taken its room",
        false => "the sessions here outgrew its KV and it was the first to give way",
    };
    state.events.record(
        EventKind::SessionPaused,
        Some(&replica.id),
        None,
        format!("a turn of ~{tokens} tokens ({}) paused {} ms: {why}", who_said(who), paused.as_millis()),
    );
    Some(paused)
}

/// A request's class and client, as history records them.
pub fn who_said(who: &Who) -> String {
    format!("class {}, client {}", who.class.as_str(), who.client)
}

/// Longest a placement waits on a shared store (reading the fleet's loads,
/// admitting a session); past it, this instance's own view decides.
const STORE_BUDGET: Duration = Duration::from_millis(250);

/// Reads every instance's session loads from a shared store into the
/// sessions' view (no-op without one; a slow or dead store leaves the last
/// read, and the request goes on).
pub async fn read_fleet_loads(state: &AppState) {
    if !state.shared_store_answers() {
        return;
    }
    let fleet = state.fleet.snapshot_owned();
    let read = state.sessions.read_fleet_loads(state.store.as_ref(), &fleet);
    // Not waited for beyond the budget: the last read stands.
    let _ = tokio::time::timeout(STORE_BUDGET, read).await;
}

/// Places new session `session` through a shared store: among `target`
/// (this instance's pick, first) and every other replica it could as well
/// go to (routable, serving its model, not tried yet, with a large slot
/// free when it is large), the one with the most room and then the fewest
/// sessions fleet-wide in the store's own count (`Store::place_session`),
/// within capacity when `enforce` (the hold on). Two instances that each
/// pick by their own counter and their own, a flush old, view of the
/// others' sessions would otherwise put their new sessions on one replica
/// of two. None: no room left (another instance took the last first).
/// Without a shared store that answers in time, `target`: this instance's
/// view decides.
pub async fn place_in_store(
    state: &AppState,
    lookup: &Lookup,
    target: &Arc<Replica>,
    tried: &[Arc<str>],
    session: PrefixKey,
    tokens: u64,
    enforce: bool,
) -> Option<Arc<Replica>> {
    if !state.shared_store_answers() {
        return Some(target.clone());
    }
    let target_room = state.sessions.room_of(target);
    let mut choices = vec![(target.clone(), target_room)];
    let fleet = state.fleet.snapshot_owned();
    let model = lookup.shape.model.as_deref();
    let eligible = |r: &Replica| {
        r.routable()
            && !tried.contains(&r.id)
            && model.is_none_or(|m| r.serves(m))
            && (!lookup.large || r.large_slots.has_free_slot(r.spec().max_large_inflight))
    };
    for r in fleet.iter().filter(|r| r.id != target.id && eligible(r)) {
        choices.push((r.clone(), state.sessions.room_of(r)));
    }
    let candidates: Vec<(String, Option<u64>)> =
        choices.iter().map(|(r, room)| (r.id.to_string(), room.capacity)).collect();
    let footprint = target_room.footprint(tokens);
    let ttl = state.sessions.settings().idle_ms + crate::sessions::STORE_SLACK_MS;
    let session = format!("{session:032x}");
    let asked = state.store.place_session(&candidates, &session, footprint, ttl, enforce);
    match tokio::time::timeout(STORE_BUDGET, asked).await {
        Ok(Ok(placed)) => placed.map(|i| choices[i].0.clone()),
        _ => Some(target.clone()),
    }
}

/// What a new session's admission gives the request: how long it waited
/// (if it did), and its reservation of room until its first turn is
/// resident.
pub type Admission = (Option<Duration>, Option<Reservation>);

/// Holds a new session of about `tokens` while no candidate has room for
/// it (off with `sessions.max_wait_ms = 0`). Returns how long it waited,
/// when it did (history and metrics record it), and its reservation.
pub async fn hold_if_full(state: &AppState, lookup: &Lookup, tokens: u64, who: &Who) -> Result<Admission, ApiError> {
    // Placement by room reads every instance's sessions, the hold on or off.
    read_fleet_loads(state).await;
    let hold = state.sessions.settings();
    if hold.max_wait_ms == 0 {
        // Nothing waits, but placement by room counts it until it is resident.
        return Ok((None, Some(state.sessions.reserve_unheld(tokens))));
    }
    let model = lookup.shape.model.as_deref();
    let min_tokens =
        |rooms: &[Room]| hold.hold_min_tokens.unwrap_or_else(|| crate::sessions::room::default_min_tokens(rooms));
    // The rooms as they will be once the sessions admitted before this one
    // are resident (`reserved`: their tokens).
    let judge = |reserved: &[u64]| {
        let mut rooms = candidate_rooms(state, model);
        crate::sessions::room::reserve(&mut rooms, reserved);
        verdict(&rooms, tokens, min_tokens(&rooms))
    };
    if let Some(reservation) = state.sessions.admit_at_once(who, tokens, |reserved| judge(reserved) == Verdict::Admit) {
        return Ok((None, Some(reservation)));
    }
    let first = judge(&[]);
    if first == Verdict::HoldAlone {
        tracing::warn!(
            tokens,
            "a new session is larger than any replica's KV: it waits for an empty replica and runs alone"
        );
    }
    // The held gauge is read from the queue at scrape: a waiter dropped
    // here (its client went away) leaves nothing to undo.
    // At the head with no room: lower classes between turns give theirs.
    let preempt = state.config.priority.preempt && who.class > Class::Background;
    let admit = |reserved: &[u64]| {
        judge(reserved) == Verdict::Admit
            || (preempt && preempt_for(state, model, tokens, who) && judge(reserved) == Verdict::Admit)
    };
    let held = state.sessions.hold(who, tokens, admit).await;
    let (held, reservation) = match held {
        Ok(held) => held,
        Err(e) => {
            state.metrics.rejected.get_or_create(&crate::metrics::ResultLabels { result: "session_queue_full" }).inc();
            return Err(e.into());
        }
    };
    let waited = held.waited();
    state.metrics.session_hold.get_or_create(&crate::metrics::ClassLabels::of(who.class)).observe(waited.as_secs_f64());
    state.sessions.record_wait(held);
    let alone = if first == Verdict::HoldAlone { " (larger than any replica: it runs alone)" } else { "" };
    match held {
        Held::Placed(_) => {
            state.events.record(
                EventKind::SessionHeld,
                None,
                None,
                format!(
                    "a new session of ~{tokens} tokens ({}) waited {} ms for room{alone}",
                    who_said(who),
                    waited.as_millis()
                ),
            );
        }
        Held::OverCapacity(_) => {
            state.metrics.sessions_over_capacity.inc();
            tracing::warn!(
                tokens,
                waited_ms = waited.as_millis() as u64,
                "no room opened: a new session admitted over capacity"
            );
            state.events.record(
                EventKind::SessionOverCapacity,
                None,
                None,
                format!(
                    "a new session of ~{tokens} tokens ({}) waited {} ms (sessions.max_wait_ms) without room and was admitted over capacity{alone}",
                    who_said(who),
                    waited.as_millis()
                ),
            );
        }
    }
    Ok((Some(waited), Some(reservation)))
}
