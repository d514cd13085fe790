//! One entry and one exit for a session's turn at the KV wall.
//!
//! - `Gate::enter` takes what the turn asks. A new session waits here while
//!   no replica has room for what it will hold (`hold.rs`), is placed (by
//!   the planner the caller passes, then, with a shared store, admitted
//!   there atomically) and keeps its room reserved until its first turn is
//!   resident. A turn of a resident session passes at once.
//! - `Pass::arrive` is the turn reaching its replica, before it starts: a
//!   session served elsewhere until now is heard of (resident here from
//!   this turn, as every instance counts it); its turn boundary is where a
//!   held session of a higher class may take its room; and it pauses when
//!   the sessions there outgrew the KV and it is the one to give way.
//! - `Pass::begin` starts the turn; dropping the `SessionTurn` ends it.
//!
//! What happened comes back as values (`Happened`, given to the `report`
//! the caller passes the moment it happens), which the request path records
//! as events and metrics with its other outcomes. The gate takes no HTTP
//! error, no events and no metrics: it can be driven, clock and all, in a
//! unit test.

use std::sync::Arc;
use std::time::Duration;

use super::room::{self, Entry, Room};
use super::{Counting, Footprint, Heard, Reservation, SessionTurn, Sessions, WaitEnded, RECHECK};
use crate::domain_error::DomainError;
use crate::fleet::{Fleet, Replica};
use crate::policy::PrefixKey;
use crate::priority::{Class, Who};
use crate::store::Store;

/// What the gate sees of the gateway: the sessions, the fleet, a shared
/// store that answers (None: this instance's view decides), whether a
/// higher class may take a lower one's room, and where what happened goes.
pub struct Gate<'a> {
    pub sessions: &'a Arc<Sessions>,
    pub fleet: &'a Fleet,
    pub store: Option<&'a dyn Store>,
    /// `priority.preempt`.
    pub preempt: bool,
    pub report: &'a dyn Fn(Happened),
}

/// What a turn asks of the gate.
#[derive(Clone, Copy)]
pub struct Ask<'a> {
    /// The session's id: its prefix family, its key's, or its first pin's.
    pub session: PrefixKey,
    /// Nothing pins it yet: held at the wall, and placed by room.
    pub new: bool,
    /// Its first link (system prompt, instructions, tools): what its
    /// projection is kept by (`projection.rs`).
    pub link: Option<PrefixKey>,
    /// Its context with this turn, estimated from its bytes, tokens.
    pub tokens: u64,
    pub model: Option<&'a str>,
    /// Its class and client.
    pub who: &'a Who,
}

/// What the gate did, as it happens (the request path records each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Happened {
    /// A new session of ~`tokens` waited for room; `over_capacity`: none
    /// opened within `max_wait_ms` and it went anyway; `alone`: it is
    /// larger than any replica and runs alone.
    Held { tokens: u64, waited: Duration, over_capacity: bool, alone: bool },
    /// A new session was refused: `max_held` sessions already wait.
    QueueFull,
    /// A session of `class` on `replica` gave its room, between its turns,
    /// to a waiting session of `for_class` and ~`for_tokens`.
    Preempted { replica: Arc<str>, class: Class, for_class: Class, for_tokens: u64 },
    /// A turn of ~`tokens` of a `class` session paused on `replica` before
    /// it started; `preempted`: a higher class had taken its room.
    Paused { replica: Arc<str>, tokens: u64, waited: Duration, class: Class, preempted: bool },
}

/// A turn through the gate: where a new session was placed, how long it
/// waited, and its reservation until its first turn is resident.
pub struct Pass<'a, T> {
    ask: Ask<'a>,
    /// A new session's replica, and the planner's word on it (taken by the
    /// first attempt).
    pub target: Option<(Arc<Replica>, T)>,
    /// How long the session waited for room, if it did.
    pub waited: Option<Duration>,
    reservation: Option<Reservation>,
}

/// A turn that must pause before it starts (`Pass::arrive`).
pub struct Pause<'g> {
    gate: &'g Gate<'g>,
    replica: &'g Replica,
    session: PrefixKey,
    tokens: u64,
    class: Class,
    came_ms: u64,
}

/// Where a new session may go, and any request: a routable replica that
/// serves its model (`serves_model`) and that this request has not failed
/// on. The one rule the planner, placement in a shared store and
/// preemption use. A free large-context slot is a preference, not a rule:
/// among the replicas with the most room the planner prefers one with a
/// slot free (`policy::decide`), and a large request on a replica without
/// one waits for it at admission rather than going where the room is not.
pub fn may_go_to(r: &Replica, serves_model: bool, tried: &[Arc<str>]) -> bool {
    serves_model && r.routable() && !tried.contains(&r.id)
}

impl<'a> Gate<'a> {
    /// The replicas a new session of `model` may go to now.
    fn candidates(&self, model: Option<&str>) -> Vec<Arc<Replica>> {
        let fleet = self.fleet.snapshot();
        fleet.iter().filter(|r| may_go_to(r, model.is_none_or(|m| r.serves(m)), &[])).cloned().collect()
    }

    fn rooms(&self, model: Option<&str>, counting: Counting) -> Vec<Room> {
        self.candidates(model).iter().map(|r| self.sessions.room_counting(r, counting)).collect()
    }

    /// A turn enters. A new session waits while no candidate has room, then
    /// goes where `plan` (the planner, called with the placement's lock
    /// held) and the shared store place it. Refused only when the queue is full.
    pub async fn enter<T, E: From<DomainError>>(
        &self,
        ask: Ask<'a>,
        mut plan: impl FnMut() -> Result<(Arc<Replica>, T), E>,
    ) -> Result<Pass<'a, T>, E> {
        let mut pass = Pass { ask, target: None, waited: None, reservation: None };
        if !ask.new {
            return Ok(pass);
        }
        let max_wait = Duration::from_millis(self.sessions.settings().max_wait_ms);
        let started = tokio::time::Instant::now();
        loop {
            let (footprint, may_pause) = self.footprint(&ask);
            let (waited, reservation, counting) = self.hold_if_full(&ask, footprint, may_pause).await?;
            let tokens = footprint.at(counting);
            if let Some(w) = waited {
                pass.waited = Some(pass.waited.unwrap_or_default() + w);
            }
            let Some(store) = self.store else {
                // This instance's view decides: chosen and placed in one step.
                let _placing = self.sessions.placing();
                let (target, said) = plan()?;
                reservation.place(&target.id);
                pass.target = Some((target, said));
                pass.reservation = Some(reservation);
                return Ok(pass);
            };
            let (target, said) = plan()?;
            // Past the wait (or with the hold off), placed without a capacity
            // check; and a session admitted to pause later, whose room the
            // store (counting every session whole) would not see.
            let enforce = !max_wait.is_zero() && started.elapsed() < max_wait && counting == Counting::Whole;
            if let Some(placed) = self.place_in_store(store, &ask, &target, tokens, enforce).await {
                reservation.place(&placed.id);
                pass.target = Some((placed, said));
                pass.reservation = Some(reservation);
                return Ok(pass);
            }
            tracing::debug!(replica = %target.id, "another instance took the last room first: waiting again");
            tokio::time::sleep(RECHECK).await;
        }
    }

    /// What a new session is counted at until it is resident (`Footprint`):
    /// what it will grow to (its projection, at most the largest
    /// candidate's capacity) against the residents counted whole, or its
    /// first turn against their next turns. And whether the second may
    /// admit it: it is projected to outgrow its first turn, the hold is on,
    /// and it fits nowhere at its peak now. Admitted that way, it pauses at
    /// the crossing when that costs less than holding it whole
    /// (`cheaper_to_pause`, asked at every look while it waits). Judged
    /// only against the residents counted whole, a newcomer never fits once
    /// they are counted at their projections, and the choice is never asked.
    fn footprint(&self, ask: &Ask<'_>) -> (Footprint, bool) {
        let rooms = self.rooms(ask.model, Counting::Whole);
        let largest = rooms.iter().filter_map(|r| r.capacity).max();
        let projected = super::projection::admitted_tokens(ask.tokens, self.sessions.project(ask.link), largest);
        let footprint = Footprint { whole: projected, next_turn: ask.tokens.min(projected) };
        let hold = self.sessions.settings();
        if projected <= ask.tokens || hold.max_wait_ms == 0 {
            return (footprint, false);
        }
        let min_tokens = hold.hold_min_tokens.unwrap_or_else(|| room::default_min_tokens(&rooms));
        (footprint, room::entry(&rooms, projected, min_tokens) == Entry::Hold)
    }

    /// On the candidate with the most room for the new session beside the
    /// residents' next turns (a pool of tokens: on slots a session never
    /// grows into another's), whether admitting it to pause later beats
    /// holding it.
    fn cheaper_to_pause(&self, ask: &Ask<'_>) -> bool {
        let sessions = self.sessions;
        let room = |r: &Arc<Replica>| sessions.room_counting(r, Counting::NextTurn);
        let candidates = self.candidates(ask.model);
        let fits_now = |r: &&Arc<Replica>| r.slot_tokens().is_none() && room(r).fits(ask.tokens);
        let Some(best) = candidates.iter().filter(fits_now).max_by_key(|r| room(r).left()) else {
            return false;
        };
        let Some(capacity) = room(best).capacity else { return false };
        let learned = sessions.project_growth(ask.link).unwrap_or(0);
        let growth = |g: u64| if g > 0 { g } else { learned };
        let mut residents: Vec<room::Growing> = best
            .residents
            .snapshot()
            .iter()
            .filter(|(_, r)| !r.preempted)
            .map(|(_, r)| room::Growing { tokens: r.next_turn_tokens(), growth: growth(r.growth()) })
            .collect();
        let placed = sessions.placed_on(best);
        residents.extend(placed.iter().map(|p| room::Growing { tokens: p.next_turn, growth: learned }));
        let new = room::Growing { tokens: ask.tokens, growth: learned };
        room::admit_and_pause(capacity, &residents, new, best.residents.pace())
    }

    /// Holds a new session while no candidate has room for it (off with
    /// `sessions.max_wait_ms = 0`): room for it counted whole, or, when
    /// `may_pause`, beside the residents' next turns where pausing it later
    /// costs less. Returns how long it waited, when it did, its
    /// reservation, and which way it was admitted.
    async fn hold_if_full(
        &self,
        ask: &Ask<'_>,
        footprint: Footprint,
        may_pause: bool,
    ) -> Result<(Option<Duration>, Reservation, Counting), DomainError> {
        // Placement by room reads every instance's sessions, the hold on or off.
        if let Some(store) = self.store {
            super::sync::read_loads(self.sessions, store, &self.fleet.snapshot_owned()).await;
        }
        let hold = self.sessions.settings();
        if hold.max_wait_ms == 0 {
            // Nothing waits, but placement by room counts it until it is resident.
            return Ok((None, self.sessions.reserve_unheld(footprint), Counting::Whole));
        }
        let min_tokens = |rooms: &[Room]| hold.hold_min_tokens.unwrap_or_else(|| room::default_min_tokens(rooms));
        // The rooms as they will be once the sessions admitted before this
        // one are resident (`reserved`), counted as `counting` says.
        let judge = |counting: Counting, reserved: &[Footprint]| {
            let mut rooms = self.rooms(ask.model, counting);
            room::reserve(&mut rooms, &Footprint::all_at(reserved, counting));
            room::entry(&rooms, footprint.at(counting), min_tokens(&rooms))
        };
        let admitted_as = std::cell::Cell::new(Counting::Whole);
        let fits = |reserved: &[Footprint]| {
            let counting = match judge(Counting::Whole, reserved) == Entry::Admit {
                true => Counting::Whole,
                false
                    if may_pause
                        && judge(Counting::NextTurn, reserved) == Entry::Admit
                        && self.cheaper_to_pause(ask) =>
                {
                    Counting::NextTurn
                }
                false => return false,
            };
            admitted_as.set(counting);
            true
        };
        let who = ask.who;
        if let Some(reservation) = self.sessions.admit_at_once(who, footprint, fits) {
            return Ok((None, reservation, admitted_as.get()));
        }
        let alone = judge(Counting::Whole, &[]) == Entry::HoldAlone;
        if alone {
            tracing::warn!(
                tokens = footprint.whole,
                "a new session is larger than any replica's KV: it waits for an empty replica and runs alone"
            );
        }
        // At the head with no room: lower classes between turns give theirs.
        let preempt = self.preempt && who.class > Class::Background;
        let tokens = footprint.whole;
        let admit = |reserved: &[Footprint]| {
            fits(reserved) || (preempt && self.preempt_for(ask.model, tokens, who.class, None) && fits(reserved))
        };
        let (ended, reservation) = match self.sessions.hold(who, footprint, admit).await {
            Ok(held) => held,
            Err(e) => {
                (self.report)(Happened::QueueFull);
                return Err(e);
            }
        };
        self.sessions.record_wait(ended);
        let over_capacity = matches!(ended, WaitEnded::OverCapacity(_));
        let tokens = footprint.at(admitted_as.get());
        (self.report)(Happened::Held { tokens, waited: ended.waited(), over_capacity, alone });
        Ok((Some(ended.waited()), reservation, admitted_as.get()))
    }

    /// Preempts lower-class residents for a waiting session of `class` and
    /// `tokens` (`Sessions::preempt_for`; `boundary`: a session at its turn
    /// boundary now). True when any was.
    fn preempt_for(&self, model: Option<&str>, tokens: u64, class: Class, boundary: Option<PrefixKey>) -> bool {
        let preempted = self.sessions.preempt_for(&self.candidates(model), class, tokens, boundary);
        for (replica, victim) in &preempted {
            tracing::info!(replica = %replica, class = victim.as_str(), "a session was preempted at its turn boundary");
            (self.report)(Happened::Preempted {
                replica: replica.clone(),
                class: *victim,
                for_class: class,
                for_tokens: tokens,
            });
        }
        !preempted.is_empty()
    }

    /// Places new session `ask` through the shared store: among `target`
    /// (this instance's pick, first) and every other replica it may go to,
    /// the one with the most room and then the fewest sessions fleet-wide
    /// in the store's own count (`Store::place_session`), within capacity
    /// when `enforce` (the hold on). Two instances that each pick by their
    /// own counter and their own, a flush old, view of the others' sessions
    /// would otherwise put their new sessions on one replica of two. None:
    /// no room left (another instance took the last first). A store that
    /// does not answer in time leaves `target`: this instance's view decides.
    async fn place_in_store(
        &self,
        store: &dyn Store,
        ask: &Ask<'_>,
        target: &Arc<Replica>,
        tokens: u64,
        enforce: bool,
    ) -> Option<Arc<Replica>> {
        let target_room = self.sessions.room_of(target);
        let mut choices = vec![(target.clone(), target_room)];
        for r in self.candidates(ask.model).into_iter().filter(|r| r.id != target.id) {
            let room = self.sessions.room_of(&r);
            choices.push((r, room));
        }
        let candidates: Vec<(String, Option<u64>)> =
            choices.iter().map(|(r, room)| (r.id.to_string(), room.capacity)).collect();
        let footprint = target_room.footprint(tokens);
        let ttl = self.sessions.settings().idle_ms + super::STORE_SLACK_MS;
        let session = format!("{:032x}", ask.session);
        let asked = store.place_session(&candidates, &session, footprint, ttl, enforce);
        match tokio::time::timeout(super::STORE_BUDGET, asked).await {
            Ok(Ok(placed)) => placed.map(|i| choices[i].0.clone()),
            _ => Some(target.clone()),
        }
    }

    /// A resident session's next turn is arriving on `replica`: its turn
    /// boundary, whether or not its last turn's stream end was seen (an
    /// agent sends its next turn on the last chunk). A held session of a
    /// higher class takes its room now, if that frees enough, rather than
    /// waiting for a moment between its turns that a streaming agent never
    /// leaves; this turn then pauses. A turn that started is never cut.
    fn yield_at_boundary(&self, replica: &Replica, session: PrefixKey, model: Option<&str>) {
        if !self.preempt || self.sessions.settings().max_wait_ms == 0 {
            return;
        }
        let Some((class, tokens)) = self.sessions.next_held() else { return };
        let mine = replica.residents.get(session).map(|r| r.class);
        if mine.is_some_and(|mine| class > mine) {
            self.preempt_for(model, tokens, class, Some(session));
        }
    }
}

impl<'a, T> Pass<'a, T> {
    /// The session this is a turn of.
    pub fn session(&self) -> PrefixKey {
        self.ask.session
    }

    /// The turn reaches `replica` with `tokens` of context, before it
    /// starts. A session resident nowhere here (served by another instance
    /// until now) is resident from this turn on, at its previous turn's
    /// context as `heard` says (None: as of now, at this turn's). Returns
    /// the pause this turn must wait out, if it must (`Pause::wait`).
    pub fn arrive<'g>(
        &self,
        gate: &'g Gate<'g>,
        replica: &'g Arc<Replica>,
        tokens: u64,
        heard: impl FnOnce() -> Option<Heard>,
    ) -> Option<Pause<'g>> {
        let Ask { session, new, model, who, .. } = self.ask;
        if new {
            return None;
        }
        let sessions = gate.sessions;
        let now = crate::clock::now_ms();
        // The replica's own record is asked first: the sessions' index is
        // one lock for every request. (One resident on another replica
        // moves at `begin`, with all it learned.)
        if !replica.residents.contains(session) && !sessions.is_resident(session) {
            let heard = heard().unwrap_or(Heard { tokens, arrived_ms: now, ..Heard::default() });
            // This turn, beginning, says what it added (and, its second, that it continued).
            sessions.seen_elsewhere(
                replica,
                session,
                Heard { tokens: heard.tokens.min(tokens), last_ms: now, ..heard },
            );
        }
        gate.yield_at_boundary(replica, session, model);
        if !sessions.must_pause(replica, session, tokens, now) {
            return None;
        }
        let class = replica.residents.get(session).map_or(who.class, |r| r.class);
        Some(Pause { gate, replica, session, tokens, class, came_ms: now })
    }

    /// The turn starts on `replica` with `tokens` of context: resident
    /// there from now (the first turn's reservation given back), until the
    /// returned turn is dropped.
    pub fn begin(&mut self, sessions: &Arc<Sessions>, replica: &Arc<Replica>, tokens: u64, now_ms: u64) -> SessionTurn {
        let Ask { session, link, who, .. } = self.ask;
        let turn = sessions.begin_turn(replica, session, link, tokens, who, now_ms);
        drop(self.reservation.take());
        turn
    }
}

impl Pause<'_> {
    /// Waits until the turn may start (room opened) or `max_wait_ms` passed;
    /// returns how long it waited.
    pub async fn wait(self) -> Duration {
        let Pause { gate, replica, session, tokens, class, came_ms } = self;
        let preempted = replica.residents.get(session).is_some_and(|r| r.preempted);
        let waited = gate.sessions.pause(replica, session, tokens, came_ms).await;
        let replica = replica.id.clone();
        (gate.report)(Happened::Paused { replica, tokens, waited, class, preempted });
        waited
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::tests::settings;
    use super::*;
    use crate::domain_error::DomainError;
    use crate::fleet::{AdminState, ReplicaSpec};

    /// A fleet of replicas of `pool` tokens each, and sessions over it.
    fn gateway(ids: &[&str], pool: u64) -> (Arc<Sessions>, Fleet) {
        let fleet = Fleet::default();
        for id in ids {
            let r = Replica::new(ReplicaSpec::new(id, "http://x"), AdminState::Active);
            r.set_observed_kv(Some(pool));
            fleet.add(r);
        }
        (Sessions::new(settings()), fleet)
    }

    fn ask(session: PrefixKey, new: bool, tokens: u64, who: &Who) -> Ask<'_> {
        Ask { session, new, link: None, tokens, model: None, who }
    }

    /// The planner: the replica with the most room (the first among ties).
    fn most_room(sessions: &Sessions, fleet: &Fleet) -> Result<(Arc<Replica>, ()), DomainError> {
        let list = fleet.snapshot();
        let best = list.iter().max_by_key(|r| sessions.room_of(r).left()).cloned().expect("a replica");
        Ok((best, ()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_session_waits_at_the_gate_until_room_opens_then_is_placed_reserved_and_begun() {
        let (s, fleet) = gateway(&["a"], 12_000);
        let a = fleet.get("a").unwrap();
        let who = Who::default();
        // A resident of 10,000 tokens between turns: 2,000 left.
        drop(s.begin_turn(&a, 1, None, 10_000, &who, crate::clock::now_ms()));
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: false, report: &report };
        let entering = gate.enter(ask(2, true, 4_000, &who), || most_room(&s, &fleet));
        let room_opens = async {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            assert_eq!(s.held(), 1, "held: no room for 4,000 tokens");
            assert!(s.sweep(crate::clock::now_ms() + 60_000).any, "the resident idles out");
        };
        let (pass, ()) = tokio::join!(entering, room_opens);
        let mut pass = pass.unwrap();
        assert_eq!(pass.waited, Some(Duration::from_millis(1_500)));
        let (target, ()) = pass.target.take().unwrap();
        assert_eq!(&*target.id, "a");
        let waited = Duration::from_millis(1_500);
        let held = Happened::Held { tokens: 4_000, waited, over_capacity: false, alone: false };
        assert_eq!(reports.borrow().as_slice(), &[held]);
        // Reserved on a until its first turn is resident, then resident.
        assert_eq!(s.room_of(&a).taken, 4_000);
        assert!(pass.arrive(&gate, &target, 4_000, || None).is_none(), "a new session's first turn never pauses");
        let turn = pass.begin(&s, &target, 4_000, crate::clock::now_ms());
        // Resident, no longer reserved: counted once, at what the session
        // that left grew to (learned when it idled out).
        assert_eq!(s.room_of(&a).taken, 10_000);
        assert!(s.is_resident(2));
        drop(turn);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_is_reported_and_refused_and_a_wait_that_runs_out_goes_over_capacity() {
        let (s, fleet) = gateway(&["a"], 12_000);
        let a = fleet.get("a").unwrap();
        let who = Who::default();
        drop(s.begin_turn(&a, 1, None, 11_000, &who, crate::clock::now_ms()));
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: false, report: &report };
        // max_held 2: two wait, the third is refused at once.
        let waiting = [2, 3].map(|id| gate.enter(ask(id, true, 4_000, &who), || most_room(&s, &fleet)));
        let third = async {
            tokio::task::yield_now().await;
            let refused = gate.enter(ask(4, true, 4_000, &who), || most_room(&s, &fleet)).await;
            assert!(matches!(refused, Err(DomainError::Overloaded { .. })));
        };
        let [two, three] = waiting;
        let (two, three, ()) = tokio::join!(two, three, third);
        // No room ever opened: both went after max_wait_ms, over capacity.
        for pass in [two.unwrap(), three.unwrap()] {
            assert_eq!(pass.waited, Some(Duration::from_millis(10_000)));
        }
        let reports = reports.borrow();
        assert_eq!(reports[0], Happened::QueueFull);
        let over = |h: &&Happened| matches!(h, Happened::Held { over_capacity: true, .. });
        assert_eq!(reports.iter().filter(over).count(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_resident_turn_over_its_pool_pauses_at_the_gate_and_the_pause_is_reported() {
        let (s, fleet) = gateway(&["a"], 12_000);
        let a = fleet.get("a").unwrap();
        let who = Who::default();
        // In the past: 2's turn comes after 1 continued.
        let now = crate::clock::now_ms() - 100;
        drop(s.begin_turn(&a, 1, None, 5_000, &who, now));
        drop(s.begin_turn(&a, 2, None, 5_000, &who, now + 1));
        drop(s.begin_turn(&a, 1, None, 5_000, &who, now + 2));
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: false, report: &report };
        let plan = || most_room(&s, &fleet);
        let older = gate.enter(ask(1, false, 7_000, &who), plan).await.unwrap();
        assert!(older.arrive(&gate, &a, 7_000, || None).is_none(), "the older one never pauses");
        let mut younger = gate.enter(ask(2, false, 8_000, &who), plan).await.unwrap();
        assert!(younger.target.is_none() && younger.waited.is_none(), "a resident's turn passes the entry at once");
        let pause = younger.arrive(&gate, &a, 8_000, || None).expect("the youngest, over the pool, pauses");
        let room_opens = async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            assert_eq!(s.paused(), 1);
            assert!(s.sweep(crate::clock::now_ms() + 60_000).any, "the older idles out");
        };
        let (waited, ()) = tokio::join!(pause.wait(), room_opens);
        assert_eq!(waited, Duration::from_millis(700));
        let paused =
            Happened::Paused { replica: a.id.clone(), tokens: 8_000, waited, class: who.class, preempted: false };
        assert_eq!(reports.borrow().as_slice(), &[paused]);
        drop(younger.begin(&s, &a, 8_000, crate::clock::now_ms()));
        assert_eq!(s.paused(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_served_elsewhere_is_heard_at_its_turn_and_a_higher_class_takes_its_room_at_the_boundary() {
        let (s, fleet) = gateway(&["a"], 12_000);
        let a = fleet.get("a").unwrap();
        let background = Who { class: Class::Background, stated: true, ..Who::default() };
        let interactive = Who { class: Class::Interactive, ..Who::default() };
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: true, report: &report };
        let plan = || most_room(&s, &fleet);
        // A background session another instance served: its pins say 9,000 tokens.
        let now = crate::clock::now_ms();
        let heard = Heard { tokens: 9_000, last_ms: now, arrived_ms: now - 5_000, ..Heard::default() };
        let mut bg = gate.enter(ask(1, false, 9_500, &background), plan).await.unwrap();
        assert!(bg.arrive(&gate, &a, 9_500, || Some(heard)).is_none());
        assert!(s.is_resident(1), "resident here from this turn");
        // Its turn streams; an interactive session waits for room. The
        // background one's next turn arrives before the gateway saw its
        // stream end (an agent sends it on the last chunk): that is its
        // boundary, and it gives its room there and pauses.
        let turn = bg.begin(&s, &a, 9_500, now);
        let entering = gate.enter(ask(2, true, 6_000, &interactive), plan);
        let next_turn = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(s.held(), 1);
            let bg = gate.enter(ask(1, false, 9_600, &background), plan).await.unwrap();
            let pause = bg.arrive(&gate, &a, 9_600, || None).expect("its room was given away: it pauses");
            drop(turn);
            // Held here until the interactive session is resident and leaves.
            let waited = tokio::time::timeout(Duration::from_millis(500), pause.wait()).await;
            assert!(waited.is_err(), "still paused while the interactive session holds the room");
        };
        let (pass, ()) = tokio::join!(entering, next_turn);
        let pass = pass.unwrap();
        assert_eq!(pass.target.as_ref().map(|(r, ())| &*r.id), Some("a"));
        let preempted = Happened::Preempted {
            replica: a.id.clone(),
            class: Class::Background,
            for_class: Class::Interactive,
            for_tokens: 6_000,
        };
        assert!(reports.borrow().contains(&preempted), "{:?}", reports.borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_that_fits_beside_the_residents_next_turns_is_admitted_or_held_by_what_each_costs() {
        let (s, fleet) = gateway(&["a"], 12_000);
        let a = fleet.get("a").unwrap();
        let who = Who::default();
        let link = Some(42);
        let t0 = crate::clock::now_ms();
        for (i, tokens) in [2_000, 3_500, 5_000, 6_500, 8_000, 9_500].into_iter().enumerate() {
            drop(s.begin_turn(&a, 1, link, tokens, &who, t0 + i as u64));
        }
        assert!(s.sweep(crate::clock::now_ms() + 60_000).any);
        // A resident at its first turn, counted at its projection (9,500):
        // a newcomer of 3,000 does not fit beside that, but beside its next
        // turn (2,000) it does, for three rounds.
        drop(s.begin_turn(&a, 2, link, 2_000, &who, crate::clock::now_ms()));
        assert_eq!(s.room_of(&a).left(), Some(2_500));
        assert_eq!(s.room_counting(&a, Counting::NextTurn).left(), Some(10_000));
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: false, report: &report };
        let new = Ask { link, ..ask(3, true, 3_000, &who) };
        // Nothing measured of the replica's pace: admitted now, to pause later.
        let pass = gate.enter(new, || most_room(&s, &fleet)).await.unwrap();
        assert_eq!(pass.waited, None, "admitted at once: the choice by cost was asked");
        assert!(reports.borrow().is_empty(), "{:?}", reports.borrow());
        // Reserved at its projection counted whole, at its first turn beside
        // the residents' next turns.
        assert_eq!(s.room_of(&a).taken, 9_500 + 9_500);
        assert_eq!(s.room_counting(&a, Counting::NextTurn).taken, 2_000 + 3_000);
        // Another arriving with it, before the first is resident: the room
        // its reservation leaves beside the next turns admits it too.
        let second = gate.enter(Ask { session: 4, ..new }, || most_room(&s, &fleet)).await.unwrap();
        assert_eq!(second.waited, None, "admitted at once beside the first's reservation");
        drop((pass, second));
        // Once the pace says pausing costs more, it is held whole.
        let now = crate::clock::now_ms();
        drop(s.begin_turn(&a, 2, link, 3_500, &who, now - 400));
        a.residents.observe_prefill(1_000, Duration::from_secs(2));
        let entering = gate.enter(new, || most_room(&s, &fleet));
        let room_opens = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(s.held(), 1, "held whole: pausing would cost more");
            assert!(s.sweep(crate::clock::now_ms() + 60_000).any);
        };
        let (pass, ()) = tokio::join!(entering, room_opens);
        assert_eq!(pass.unwrap().waited, Some(Duration::from_millis(300)));
    }

    #[tokio::test(start_paused = true)]
    async fn on_a_one_slot_engine_a_higher_class_takes_the_slot_at_the_lower_ones_boundary() {
        let (s, fleet) = gateway(&["a"], 16_384);
        let a = fleet.get("a").unwrap();
        a.set_slot_tokens(Some(16_384));
        let background = Who { class: Class::Background, stated: true, ..Who::default() };
        let interactive = Who { class: Class::Interactive, ..Who::default() };
        let reports = RefCell::new(Vec::new());
        let report = |h: Happened| reports.borrow_mut().push(h);
        let gate = Gate { sessions: &s, fleet: &fleet, store: None, preempt: true, report: &report };
        let plan = || most_room(&s, &fleet);
        let mut bg = gate.enter(ask(1, true, 1_300, &background), plan).await.unwrap();
        let turn = bg.begin(&s, &a, 1_300, crate::clock::now_ms());
        let entering = gate.enter(ask(2, true, 1_300, &interactive), plan);
        let next_turn = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(s.held(), 1);
            let bg = gate.enter(ask(1, false, 1_500, &background), plan).await.unwrap();
            let pause = bg.arrive(&gate, &a, 1_500, || None).expect("the slot was given away: it pauses");
            drop(turn);
            let waited = tokio::time::timeout(Duration::from_millis(500), pause.wait()).await;
            assert!(waited.is_err(), "still paused while the interactive session holds the slot");
        };
        let (pass, ()) = tokio::join!(entering, next_turn);
        assert_eq!(pass.unwrap().waited, Some(Duration::from_millis(300)));
    }
}
