//! Sessions at the KV wall: which conversations live on which replica, and
//! the queue where whole new sessions wait for room.
//!
//! Why hold: once the sessions in flight need more KV than the replicas
//! hold, every turn evicts another session's prefix and every turn
//! re-prefills; no placement helps (the seed measured counter placement,
//! load-balanced placement and one large request per card, all alike).
//! Holding whole new sessions until a resident one leaves keeps the ones
//! that run warm: four agent families on two one-slot llama.cpp replicas
//! ran 2.7x faster two at a time than all at once (issue 26).
//!
//! - A session is a conversation the gateway pins (a prefix family, a
//!   session key, a stored-response chain). It is *resident* on its replica
//!   from its first turn while a turn runs, and until it idles out after its
//!   last turn ended: a few times its own longest gap between turns, between
//!   a floor and `idle_ms` (`Resident::idle_after_ms`). Every hand-off of
//!   room waits that long, so it is learned per session.
//! - A new session (conversation-shaped, nothing pinned yet) whose
//!   footprint matters is held when no candidate has room (`room.rs`), in a
//!   queue ordered by priority class, then turns between clients
//!   (`priority::FairQueue`); turns of resident sessions are never queued
//!   with them (they pause only when their replica is crossed, the lowest
//!   class, the client with most sessions and the youngest first:
//!   `pause.rs`). The head of the queue goes as soon as room opens (a
//!   session idles out, moves, its replica leaves or capacity grows:
//!   re-checked on each change and every `RECHECK`), to the replica with
//!   the most room; a higher class may take a lower one's room between its
//!   turns (`preempt_for`). Admitted, it reserves its room until its first
//!   turn is resident (`Reservation`). After `max_wait_ms` it goes anyway,
//!   over capacity, and says so.
//! - The queue is bounded (`max_held`): past it, a clear 503, the lowest
//!   class first. A waiter whose client went away leaves the queue at once
//!   (its ticket is dropped).
//!
//! What is kept is bounded by the sessions alive: an idle session is
//! forgotten by the sweep, a replica's with the replica.

pub mod gate;
mod hold;
mod pause;
pub mod projection;
pub mod room;
pub mod sync;
mod view;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub use crate::fleet::residents::Heard;
use crate::fleet::residents::{Begin, Resident};
use crate::fleet::Replica;
use crate::policy::PrefixKey;
use crate::priority::{FairQueue, Who};
pub use hold::{Ticket, WaitEnded};
pub use room::{Entry, Room};
use serde::{Deserialize, Serialize};
pub use view::{SessionState, SessionView};

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// More request headers that name a conversation, tried after the
    /// built-in ones (`x-session-id`, `session-id`, `session_id`,
    /// `x-claude-code-session-id`, `x-session-affinity`). Lowercase.
    pub headers: Vec<String>,
    /// A session stays resident on its replica (its KV counted against the
    /// room) until this long after its last turn ended.
    pub idle_ms: u64,
    /// Longest a new session waits for room at the KV wall before it is
    /// admitted over capacity (0: never held).
    pub max_wait_ms: u64,
    /// Most new sessions waiting for room at once; past it, 503 with Retry-After.
    pub max_held: usize,
    /// A new session whose footprint is smaller than this many tokens is
    /// never held (on llama.cpp slots every session takes a whole slot).
    /// Unset: a sixteenth of the smallest candidate replica's KV capacity
    /// (a 3,072-token pool: 192; a 1,000,000-token one: 62,500), since what
    /// matters is a session's share of a pool, not its size.
    pub hold_min_tokens: Option<u64>,
    /// When a replica's resident sessions outgrow its KV anyway (their
    /// projections fell short, or nothing was learned yet), the next turn of
    /// the youngest one there (on slots that are all the engine keeps, of
    /// every one past them, the oldest kept first) waits, at a turn
    /// boundary, until room opens
    /// (at most `max_wait_ms`), so the older ones stay warm instead of all
    /// evicting each other. A paused agent waits for others' work: turn it
    /// off where one agent's latency matters more than the fleet's.
    pub pause: bool,
    /// A session turn bound for a replica whose KV is a pool of tokens is
    /// counted by the engine before it runs (`POST /tokenize`, as vLLM
    /// serves it: one round trip of a few milliseconds), so the hold and
    /// the pauses reckon with the engine's own figures, not estimates from
    /// bytes. An engine without the endpoint is not asked again. Off: every
    /// figure is an estimate.
    pub count_tokens: bool,
    /// Where the wall is: `learned` (where a replica was seen to lose a
    /// returning session's prefix, or its engine preempted or said its
    /// pool was full; until then nothing waits there), `declared` (its
    /// declared capacity, raised by what receipts found kept, until a wall
    /// is seen), or `auto`: learned on slot engines (llama.cpp's slots are
    /// not its wall: llama-server keeps prompts in host memory by
    /// default), declared where the capacity is a pool of KV blocks the
    /// engine reports (vLLM, SGLang) or `kv_tokens` says. Set `learned`
    /// for vLLM with a CPU offload tier.
    #[schema(inline)]
    pub wall: WallAt,
}

/// Where the hold and the pauses take a replica's wall to be (`sessions.wall`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WallAt {
    /// Learned on slot engines, declared on pools.
    #[default]
    Auto,
    /// Where it was seen; nothing waits before.
    Learned,
    /// The declared capacity (raised by receipts), until a wall is seen.
    Declared,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            headers: Vec::new(),
            idle_ms: 5_000,
            max_wait_ms: 120_000,
            max_held: 256,
            hold_min_tokens: None,
            pause: true,
            count_tokens: true,
            wall: WallAt::Auto,
        }
    }
}

/// Longest a placement waits on a shared store (reading the fleet's loads,
/// admitting a session); past it, this instance's own view decides.
pub const STORE_BUDGET: Duration = Duration::from_millis(250);

/// How often held sessions look at the room again without being told
/// (capacity read by the prober, a replica added, another instance's pins).
pub const RECHECK: Duration = Duration::from_millis(200);

/// The sweep runs at the next idle-out (`Swept::next_idle_out_ms`), but no
/// closer to the last sweep than this: with many sessions ending in turn, a
/// sweep (a pass over every session) every few ms would cost more than the
/// room it opens sooner.
pub const MIN_SWEEP_SPACING: Duration = Duration::from_millis(20);

/// A session another instance served last is forgotten here after this
/// many times `idle_ms` without news, if that instance never released it.
pub const ELSEWHERE_FACTOR: u64 = 6;

/// A session's entry in a shared store outlives its idle time by this much:
/// the flusher renews this instance's residents every flush interval.
pub const STORE_SLACK_MS: u64 = 1_000;

#[derive(Default)]
struct State {
    /// Where each session lives: its replica's record, which holds the
    /// session's figures (`Replica::residents`). A record that left the
    /// fleet is gone once no request holds it, and its sessions leave this
    /// index at the next sweep: a removal needs no call here.
    home: foldhash::HashMap<PrefixKey, Weak<Replica>>,
    /// Held sessions, by class, then turns between clients (`priority.rs`).
    held: FairQueue<HeldWaiter>,
    /// Tickets turned away after they queued (`max_held` reached by a
    /// higher class): their waiters answer 503.
    evicted: Vec<u64>,
    /// The names of the clients resident sessions belong to, by hash
    /// (`Resident::client`), for the sessions view: kept while a resident
    /// session of theirs is (pruned by `sweep`).
    clients: foldhash::HashMap<u64, Arc<str>>,
}

/// A new session admitted to the room whose first turn is not resident yet.
#[derive(Debug)]
struct Reserved {
    id: u64,
    tokens: Footprint,
    /// Where it was placed (None: not yet).
    on: Option<Arc<str>>,
}

/// How a room counts its residents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// Each at what it is counted for (`Resident::counted_tokens`: its
    /// projection, once learned): the room for a session held whole.
    Whole,
    /// Each at its next turn's context: the room for a newcomer admitted
    /// to pause at the crossing (`room::admit_and_pause`), which the
    /// pause, not the hold, keeps within capacity.
    NextTurn,
}

/// What a new session is counted at until its first turn is resident, in
/// each way a room counts (`Counting`): what it will grow to (its
/// projection) counted whole, its first turn beside the residents' next turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub whole: u64,
    pub next_turn: u64,
}

impl Footprint {
    /// A session counted at `tokens` either way (nothing projected).
    pub fn same(tokens: u64) -> Footprint {
        Footprint { whole: tokens, next_turn: tokens }
    }

    pub fn at(self, counting: Counting) -> u64 {
        match counting {
            Counting::Whole => self.whole,
            Counting::NextTurn => self.next_turn,
        }
    }

    /// `reserved`, each as `counting` counts it.
    pub fn all_at(reserved: &[Footprint], counting: Counting) -> Vec<u64> {
        reserved.iter().map(|f| f.at(counting)).collect()
    }
}

/// A new session admitted to the room, until its first turn is resident:
/// counted against the room meanwhile, so the next in line is neither
/// admitted into the same room nor placed on the same replica before the
/// first is resident. Drop it once `begin_turn` ran (or the request ended).
pub struct Reservation {
    sessions: Arc<Sessions>,
    id: u64,
}

impl Reservation {
    /// It was placed on `replica`: counted there from now.
    pub fn place(&self, replica: &Arc<str>) {
        if let Some(r) = self.sessions.reservations().iter_mut().find(|r| r.id == self.id) {
            r.on = Some(replica.clone());
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.sessions.reservations().retain(|r| r.id != self.id);
        self.sessions.changed.notify_waiters();
    }
}

/// What the queue keeps of a held session (for the capacity view).
#[derive(Debug, Clone, Copy)]
struct HeldWaiter {
    tokens: u64,
    since_ms: u64,
}

/// A client id as residents keep it (a hash: `Resident` stays `Copy`).
fn client_hash(client: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(client.as_bytes())
}

impl State {
    fn leave(&mut self, session: PrefixKey) -> Option<Resident> {
        let replica = self.home.remove(&session)?.upgrade()?;
        replica.residents.remove(session)
    }

    /// Where `session` lives, when its replica is still there.
    fn home_of(&self, session: PrefixKey) -> Option<Arc<Replica>> {
        self.home.get(&session).and_then(Weak::upgrade)
    }
}

pub struct Sessions {
    /// `[sessions]`: idle_ms, max_wait_ms, max_held, hold_min_tokens.
    settings: SessionConfig,
    state: Mutex<State>,
    /// What sessions grow to, learned from those that ended here.
    projections: Mutex<projection::Projections>,
    /// Turns paused now.
    paused: std::sync::atomic::AtomicUsize,
    /// Told when room may have opened.
    changed: tokio::sync::Notify,
    /// Told when a session's turn ended at its peak: sweep now.
    sweep_soon: tokio::sync::Notify,
    /// How the waits went, since start.
    waits: Mutex<WaitStats>,
    /// New sessions admitted whose first turn is not resident yet. Its own
    /// lock, never held with another: the room reads it.
    reservations: Mutex<Vec<Reserved>>,
    next_reservation: std::sync::atomic::AtomicU64,
    /// Held while a new session's replica is chosen and its reservation
    /// placed there (`placing`): taken before any other lock here.
    placing: Mutex<()>,
}

/// What a sweep did.
#[derive(Debug, Default)]
pub struct Swept {
    /// Any session went (room may have opened).
    pub any: bool,
    /// This instance's own sessions that idled out, by replica.
    pub released: Vec<(Arc<str>, PrefixKey)>,
    /// When the next resident session between turns idles out, ms (None:
    /// none is): the next sweep is due then, not a whole `RECHECK` later,
    /// since a paused turn or a held session waits for that moment.
    pub next_idle_out_ms: Option<u64>,
}

impl Heard {
    /// What a session's pins say: `latest`, its latest turn's, and
    /// `first`, its family's first (a session key's pin is both). The one
    /// reading of pins every instance makes, so all reckon alike.
    pub fn from_pins(latest: &crate::pins::Pin, first: Option<&crate::pins::Pin>) -> Heard {
        let arrived_ms = first.map_or(latest.last_used_ms, |first| first.created_ms);
        // Its first turn's size is its family's first pin's: what each turn added since.
        let growth_hint = first
            .filter(|_| latest.turns >= 2)
            .map_or(0, |first| latest.est_tokens.saturating_sub(first.est_tokens) / u64::from(latest.turns - 1));
        // Its second turn's pin says when it continued; a later one does
        // not: as early as can be (it continued before any turn heard of).
        let continued_ms = match latest.turns {
            0 | 1 => 0,
            2 => latest.last_used_ms,
            _ => arrived_ms,
        };
        Heard { tokens: latest.est_tokens, last_ms: latest.last_used_ms, arrived_ms, continued_ms, growth_hint }
    }
}

/// Waits of held sessions, since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitStats {
    pub waited: u64,
    pub over_capacity: u64,
    pub total_ms: u64,
    pub max_ms: u64,
}

/// A turn of a session on a replica: resident while it runs; when dropped
/// (the turn ended, however), the idle clock starts.
pub struct SessionTurn {
    sessions: Arc<Sessions>,
    session: PrefixKey,
}

impl SessionTurn {
    /// The session this turn belongs to.
    pub fn session(&self) -> PrefixKey {
        self.session
    }

    /// Its stream went on on `to` (its replica died, stalled or was
    /// drained): the session lives there from now, its turn still running
    /// (ended there when this drops).
    pub fn moved_to(&self, to: &Arc<Replica>) {
        let mut state = self.sessions.lock();
        let Some(resident) = state.leave(self.session) else { return };
        state.home.insert(self.session, Arc::downgrade(to));
        to.residents.carry(self.session, resident);
        drop(state);
        self.sessions.changed.notify_waiters();
    }
}

impl Drop for SessionTurn {
    fn drop(&mut self) {
        self.sessions.end_turn(self.session, crate::clock::now_ms());
    }
}

/// What the capacity view shows of one replica's sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidentFigures {
    pub sessions: usize,
    pub tokens: u64,
    /// Each at the larger of its context now and its projection.
    pub counted_tokens: u64,
}

impl Sessions {
    pub fn new(settings: SessionConfig) -> Arc<Sessions> {
        Arc::new(Sessions {
            settings,
            state: Mutex::default(),
            projections: Mutex::default(),
            paused: Default::default(),
            changed: tokio::sync::Notify::new(),
            sweep_soon: tokio::sync::Notify::new(),
            waits: Mutex::default(),
            reservations: Mutex::default(),
            next_reservation: Default::default(),
            placing: Mutex::default(),
        })
    }

    pub fn settings(&self) -> &SessionConfig {
        &self.settings
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reservations(&self) -> std::sync::MutexGuard<'_, Vec<Reserved>> {
        self.reservations.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves room for a new session of `tokens`. Called with the state
    /// locked (`_admitting`): judging the room and reserving are one step.
    fn reserve(self: &Arc<Self>, _admitting: &State, tokens: Footprint) -> Reservation {
        let id = self.next_reservation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.reservations().push(Reserved { id, tokens, on: None });
        Reservation { sessions: self.clone(), id }
    }

    /// The sessions admitted but not placed yet.
    fn unplaced(&self) -> Vec<Footprint> {
        self.reservations().iter().filter(|r| r.on.is_none()).map(|r| r.tokens).collect()
    }

    /// A turn of `session` (`tokens` of context; `link` its first link) of
    /// `who` starts on `replica`: it is resident there from now (moved, if
    /// it lived elsewhere). A session new here counts at its projection
    /// from now on. Its class is its first turn's, or a later turn's that
    /// states one.
    pub fn begin_turn(
        self: &Arc<Self>,
        replica: &Arc<Replica>,
        session: PrefixKey,
        link: Option<PrefixKey>,
        tokens: u64,
        who: &Who,
        now_ms: u64,
    ) -> SessionTurn {
        let projected = self.project(link).unwrap_or(0);
        let moved = {
            let mut state = self.lock();
            state.clients.entry(client_hash(&who.client)).or_insert_with(|| who.client.clone());
            let here = state.home.get(&session).is_some_and(|home| std::ptr::eq(home.as_ptr(), Arc::as_ptr(replica)));
            let moved = if here { None } else { state.leave(session) };
            state.home.insert(session, Arc::downgrade(replica));
            let client = client_hash(&who.client);
            let (class, stated) = (who.class, who.stated);
            let begin = Begin { tokens, now_ms, moved, projected, link, class, stated, client };
            replica.residents.begin(session, begin);
            moved.is_some()
        };
        if moved {
            self.changed.notify_waiters();
        }
        SessionTurn { sessions: self.clone(), session }
    }

    fn end_turn(&self, session: PrefixKey, now_ms: u64) {
        let state = self.lock();
        let Some(replica) = state.home_of(session) else { return };
        if replica.residents.end(session, now_ms) {
            // Its last turn, most likely: its room goes now, not a hand-off later.
            self.sweep_soon.notify_one();
        }
    }

    /// Waits until a session's turn ended at its peak (the sessions' task
    /// sweeps then: `sync.rs`).
    pub async fn sweep_wanted(&self) {
        self.sweep_soon.notified().await
    }

    /// Another instance's session, known from its pins (`heard`): resident
    /// where they say, as of `heard.last_ms` (no turn of it runs here).
    pub fn seen_elsewhere(&self, replica: &Arc<Replica>, session: PrefixKey, heard: Heard) {
        let mut state = self.lock();
        if state.home.get(&session).is_some_and(|home| !std::ptr::eq(home.as_ptr(), Arc::as_ptr(replica))) {
            state.leave(session);
        }
        state.home.insert(session, Arc::downgrade(replica));
        replica.residents.heard(session, heard);
    }

    /// Forgets the sessions idle for longer than their idle-out
    /// (`Resident::idle_after_ms`), and those whose replica left (room
    /// opened: the held are told). Says which of this instance's own went,
    /// for the other instances to hear at once (`Store::release_sessions`).
    pub fn sweep(&self, now_ms: u64) -> Swept {
        let idle_ms = self.settings.idle_ms;
        let mut gone = false;
        let (mut ended, mut released) = (Vec::new(), Vec::new());
        // Replicas that saw their wall since the last sweep: the sessions
        // resident there crossed it, and teach the projections what they
        // hold now, before they end (a cold gateway learns at its first wall).
        let mut walls: Vec<Arc<Replica>> = Vec::new();
        let mut crossed = Vec::new();
        let mut next_idle_out_ms: Option<u64> = None;
        let mut clients = foldhash::HashSet::default();
        let mut state = self.lock();
        state.home.retain(|session, home| {
            let Some(replica) = home.upgrade() else {
                gone = true;
                return false;
            };
            let seen = |walls: &[Arc<Replica>]| walls.iter().any(|w| Arc::ptr_eq(w, &replica));
            if !seen(&walls) && replica.residents.evidence.take_wall_lesson() {
                walls.push(replica.clone());
            }
            let lesson = seen(&walls);
            // A session another instance served last leaves when that one
            // releases it (`released_elsewhere`): only it knows when its
            // turn ended. Past `ELSEWHERE_FACTOR` x `idle_ms` without news
            // (that instance gone), it leaves anyway.
            let idle_after = |r: &Resident| match r.ours {
                true => r.idle_after_ms(idle_ms),
                false => idle_ms.saturating_mul(ELSEWHERE_FACTOR),
            };
            let one = replica.residents.sweep_one(*session, now_ms, idle_after, lesson);
            crossed.extend(one.crossed);
            clients.extend(one.client);
            if let Some(r) = one.left {
                if r.ours {
                    released.push((replica.id.clone(), *session));
                }
                ended.push(r);
            }
            if let Some(at) = one.idle_out_ms {
                next_idle_out_ms = Some(next_idle_out_ms.map_or(at, |n| n.min(at)));
            }
            gone |= one.gone;
            !one.gone
        });
        state.clients.retain(|hash, _| clients.contains(hash));
        drop(state);
        if !ended.is_empty() || !crossed.is_empty() {
            let mut projections = self.projections();
            for r in ended {
                projections.learn(r.link, r.peak_tokens);
                projections.learn_growth(r.link, r.growth());
            }
            for (link, tokens) in crossed {
                projections.learn(link, tokens);
            }
        }
        if gone {
            self.changed.notify_waiters();
        }
        Swept { any: gone, released, next_idle_out_ms }
    }

    /// Another instance released `session` on `replica` (it idled out
    /// there, the last to serve it): it leaves here too unless a turn of it
    /// runs here now (what it grew to, as seen here, teaches the
    /// projections), and the held look at the room again.
    pub fn released_elsewhere(&self, replica: &str, session: PrefixKey) {
        let mut state = self.lock();
        let Some(home) = state.home_of(session).filter(|r| &*r.id == replica) else { return };
        if let Some(ended) = home.residents.remove_if_between_turns(session) {
            state.home.remove(&session);
            drop(state);
            // It ended: every instance learns what it grew to, not only
            // the one that served its last turn.
            let mut projections = self.projections();
            projections.learn(ended.link, ended.peak_tokens);
            projections.learn_growth(ended.link, ended.growth());
            drop(projections);
            self.changed.notify_waiters();
        }
    }

    /// The room `r` has for new sessions: its capacity, and the
    /// footprints of the sessions resident there. With a shared store, the
    /// larger of this instance's own view and every instance's loads.
    pub fn room_of(&self, r: &Replica) -> Room {
        self.room_counting(r, Counting::Whole)
    }

    /// The room `r` shows (metrics, the capacity view): left under the wall
    /// the hold uses, else under what it holds as learned (its declared
    /// capacity, raised by receipts): how far it is from a wall expected.
    pub fn room_shown(&self, r: &Replica) -> Option<i64> {
        let room = self.room_of(r);
        room.left().or_else(|| {
            let capacity = r.residents.evidence.learned().capacity(r.kv_capacity(), r.slot_tokens());
            Room { capacity, ..room }.left()
        })
    }

    /// The room `r` has counted as `counting` says (`room_of`: `Whole`).
    pub fn room_counting(&self, r: &Replica, counting: Counting) -> Room {
        let slot_tokens = r.slot_tokens();
        let shape = Room { capacity: None, taken: 0, slot_tokens };
        let footprint = |tokens| shape.footprint(tokens);
        let placed_on = self.placed_on(r);
        let placed = |counting| placed_on.iter().map(|p| footprint(p.at(counting))).sum::<u64>();
        let whole = r.residents.footprint_sum(footprint) + placed(Counting::Whole);
        let taken = match counting {
            Counting::Whole => whole.max(r.residents.fleet_load()),
            // Other instances' sessions here (the fleet's load beyond this
            // instance's own) stay counted whole: their turns are not seen here.
            Counting::NextTurn => {
                let others = r.residents.fleet_load().saturating_sub(whole);
                r.residents.next_turn_sum(footprint) + placed(Counting::NextTurn) + others
            }
        };
        // The wall as seen (what it holds as learned: a wall seen, or the
        // declared capacity raised by receipts), or declared where the
        // operator says so; none until one is seen otherwise, since what an
        // engine keeps (host memory, an offload tier) is not what it
        // declares. An empty replica loses no session's prefix to another's,
        // so the first to come is never kept from it by a wall.
        let capacity = match taken {
            0 => r.kv_capacity().filter(|_| self.wall_at(r) == WallAt::Declared),
            _ => self.wall_of(r),
        };
        Room { capacity, taken, slot_tokens }
    }

    /// Where the hold takes `r`'s wall to be (`sessions.wall`): where it is
    /// declared, the declared capacity (lowered to a wall seen below it);
    /// where it is learned, nothing until a wall was seen, then what it
    /// holds as learned (`Learned::capacity`: the declared capacity raised
    /// by kept receipts, no more than the wall). None: nothing waits there.
    pub fn wall_of(&self, r: &Replica) -> Option<u64> {
        let learned = r.residents.evidence.learned();
        let wall = learned.wall(r.slot_tokens());
        match self.wall_at(r) {
            // A pool's blocks are its wall: a kept receipt above them says
            // more of the count (a shared system prompt counted per
            // session) than of the pool, so only a wall seen lowers it.
            WallAt::Declared => r.kv_capacity().map(|c| wall.map_or(c, |w| c.min(w))),
            _ if wall.is_none() => None,
            _ => learned.capacity(r.kv_capacity(), r.slot_tokens()),
        }
    }

    /// The pool the pauses keep `r`'s residents within: its declared
    /// capacity where the wall is declared (a wall seen lower makes new
    /// sessions wait, not resident ones pause: the residents' turns are
    /// what found it), its wall where it is learned.
    pub(super) fn pause_pool(&self, r: &Replica) -> Option<u64> {
        match self.wall_at(r) {
            WallAt::Declared => r.kv_capacity(),
            _ => self.wall_of(r),
        }
    }

    /// `sessions.wall` for `r`, `auto` resolved: learned on slots.
    fn wall_at(&self, r: &Replica) -> WallAt {
        match self.settings.wall {
            WallAt::Auto if r.slot_tokens().is_some() => WallAt::Learned,
            WallAt::Auto => WallAt::Declared,
            chosen => chosen,
        }
    }

    /// Reads every instance's session loads on `replicas` from a shared
    /// store into this view (replacing the last read). A store that is not
    /// shared has none: nothing changes.
    pub async fn read_fleet_loads(
        &self,
        store: &dyn crate::store::Store,
        replicas: &[Arc<Replica>],
    ) -> Result<(), crate::store::StoreError> {
        let ids: Vec<String> = replicas.iter().map(|r| r.id.to_string()).collect();
        let loads = store.session_loads(&ids).await?;
        if loads.is_empty() {
            return Ok(());
        }
        for (r, load) in replicas.iter().zip(loads) {
            r.residents.set_fleet_load(load);
        }
        self.changed.notify_waiters();
        Ok(())
    }

    /// This instance's resident sessions as a shared store keeps them: the
    /// flusher renews them, each until it idles out (plus `STORE_SLACK_MS`,
    /// since the flusher renews them only every flush interval).
    pub fn kept(&self, now_ms: u64) -> Vec<crate::store::KeptSession> {
        let idle_ms = self.settings.idle_ms;
        let state = self.lock();
        let mut out = Vec::new();
        for (session, home) in &state.home {
            let Some(replica) = home.upgrade() else { continue };
            let Some(r) = replica.residents.get(*session).filter(|r| r.ours) else { continue };
            let from = if r.running > 0 { now_ms } else { r.last_ms };
            out.push(crate::store::KeptSession {
                replica: replica.id.to_string(),
                session: format!("{session:032x}"),
                footprint: match r.preempted {
                    true => 0,
                    false => room::footprint(r.counted_tokens(), replica.slot_tokens()),
                },
                until_ms: from + r.idle_after_ms(idle_ms) + STORE_SLACK_MS,
            });
        }
        out
    }

    /// What the capacity view shows of `replica`'s sessions.
    pub fn resident(replica: &Replica) -> ResidentFigures {
        let (sessions, tokens, counted_tokens) = replica.residents.figures();
        ResidentFigures { sessions, tokens, counted_tokens }
    }

    fn projections(&self) -> std::sync::MutexGuard<'_, projection::Projections> {
        self.projections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What a session of first link `link` is expected to grow to (None:
    /// nothing learned yet).
    pub fn project(&self, link: Option<PrefixKey>) -> Option<u64> {
        self.projections().project(link)
    }

    /// What a turn of a new session of first link `link` is expected to
    /// add, tokens (None: nothing learned yet).
    pub fn project_growth(&self, link: Option<PrefixKey>) -> Option<u64> {
        self.projections().project_growth(link)
    }

    /// The new sessions placed on `replica` whose first turn is not
    /// resident yet.
    pub fn placed_on(&self, replica: &Replica) -> Vec<Footprint> {
        let reservations = self.reservations();
        reservations.iter().filter(|r| r.on.as_ref() == Some(&replica.id)).map(|r| r.tokens).collect()
    }

    /// What the capacity view shows of the projections.
    pub fn projection_figures(&self) -> projection::ProjectionFigures {
        self.projections().figures()
    }

    /// True when `session` is resident on a replica still there (its turns
    /// are not queued as a new session's).
    pub fn is_resident(&self, session: PrefixKey) -> bool {
        self.lock().home_of(session).is_some()
    }

    /// Waits until `ready` says yes (true) or `deadline` passed (false),
    /// looking again at every change (`changed`) and every `RECHECK`.
    async fn wait_for(&self, deadline: tokio::time::Instant, ready: impl Fn() -> bool) -> bool {
        loop {
            // Registered before looking, so a change in between is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready() {
                return true;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return false;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(RECHECK.min(deadline - now)) => {}
            }
        }
    }

    /// Sessions known (for the churn and bound tests).
    pub fn len(&self) -> usize {
        self.lock().home.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the held to look again (capacity changed, a tick).
    pub fn recheck(&self) {
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What another instance's pins say: its context, latest turn's start,
    /// arrival and growth; it continued when it arrived (tests order by arrival).
    pub(super) fn heard(tokens: u64, last_ms: u64, arrived_ms: u64, growth_hint: u64) -> Heard {
        Heard { tokens, last_ms, arrived_ms, continued_ms: arrived_ms, growth_hint }
    }

    /// The hold's mechanics are tested at a configured wall: the declared
    /// capacity (`sessions.wall = "declared"`).
    pub(super) fn settings() -> SessionConfig {
        SessionConfig {
            idle_ms: 1_000,
            max_wait_ms: 10_000,
            max_held: 2,
            hold_min_tokens: Some(1),
            wall: WallAt::Declared,
            ..Default::default()
        }
    }

    /// One gateway instance's sessions and its view of replica "a" (a
    /// 12,000-token pool): tests of several instances take one each.
    pub(super) fn instance() -> (Arc<Sessions>, Arc<Replica>) {
        pool_of(12_000)
    }

    /// One instance's sessions and replica "a" with a pool of `tokens`.
    pub(super) fn pool_of(tokens: u64) -> (Arc<Sessions>, Arc<Replica>) {
        let a = replica("a");
        a.set_observed_kv(Some(tokens));
        (Sessions::new(settings()), a)
    }

    pub(super) fn replica(id: &str) -> Arc<Replica> {
        Arc::new(Replica::new(crate::fleet::ReplicaSpec::new(id, "http://x"), crate::fleet::AdminState::Active))
    }

    #[test]
    fn a_turn_whose_stream_went_on_elsewhere_moves_its_session_there_still_running() {
        let s = Sessions::new(settings());
        let fleet = crate::fleet::Fleet::default();
        for id in ["a", "b"] {
            let r = Replica::new(crate::fleet::ReplicaSpec::new(id, "http://x"), crate::fleet::AdminState::Active);
            r.set_observed_kv(Some(12_000));
            fleet.add(r);
        }
        let (a, b) = (fleet.get("a").unwrap(), fleet.get("b").unwrap());
        let turn = s.begin_turn(&a, 7, None, 3_000, &Who::default(), crate::clock::now_ms());
        turn.moved_to(&b);
        assert!(a.residents.get(7).is_none(), "gone from the replica it left");
        assert_eq!(b.residents.get(7).map(|r| (r.tokens, r.running)), Some((3_000, 1)), "there, its turn running");
        assert_eq!(s.room_of(&b).taken, 3_000);
        drop(turn);
        assert_eq!(b.residents.get(7).map(|r| r.running), Some(0), "its turn ended there");
    }

    #[test]
    fn a_session_is_resident_while_its_turn_runs_and_until_it_idles_out() {
        let s = Sessions::new(settings());
        let a = replica("a");
        let turn = s.begin_turn(&a, 7, None, 500, &Who::default(), 0);
        assert_eq!(Sessions::resident(&a), ResidentFigures { sessions: 1, tokens: 500, counted_tokens: 500 });
        assert!(!s.sweep(5_000).any, "mid-turn: never idle");
        drop(turn);
        let ended = crate::clock::now_ms();
        assert!(!s.sweep(ended + 500).any);
        assert!(s.sweep(ended + 1_001).any);
        assert_eq!((Sessions::resident(&a).sessions, s.len()), (0, 0));
    }

    #[test]
    fn an_agent_whose_turns_begin_before_their_previous_end_is_seen_idles_out_at_the_floor() {
        let s = Sessions::new(SessionConfig { idle_ms: 10_000, ..settings() });
        let a = replica("a");
        let t0 = crate::clock::now_ms();
        // Each next turn begins before this instance saw the last one end
        // (the client had its answer before the gateway saw the stream end).
        let mut turn = s.begin_turn(&a, 1, None, 500, &Who::default(), t0);
        for i in 1..4 {
            let next = s.begin_turn(&a, 1, None, 500 + i * 100, &Who::default(), t0 + i * 400);
            drop(turn);
            turn = next;
        }
        drop(turn);
        let last = t0 + 3 * 400;
        assert!(s.sweep(last + crate::fleet::residents::MIN_IDLE_MS + 1).any, "it returned at once: the floor");
        assert!(!s.is_resident(1));
    }

    #[test]
    fn a_session_idles_out_after_a_few_times_its_own_longest_gap() {
        let s = Sessions::new(SessionConfig { idle_ms: 10_000, ..settings() });
        let a = replica("a");
        // A tool-calling agent: 2 s between its turns. Idle 6 s after its last turn, not 10.
        drop(s.begin_turn(&a, 1, None, 500, &Who::default(), crate::clock::now_ms()));
        let last = crate::clock::now_ms() + 2_000;
        drop(s.begin_turn(&a, 1, None, 600, &Who::default(), last));
        assert!(!s.sweep(last + 5_900).any);
        assert!(s.sweep(last + 6_100).any);
        assert!(!s.is_resident(1));
        // A loop that returns at once: gone soon after it stops, at the
        // floor. (It stays below what session 1 grew to, 600: a session
        // whose next turn would pass its projection idles out at once.)
        drop(s.begin_turn(&a, 2, None, 500, &Who::default(), crate::clock::now_ms()));
        let last = crate::clock::now_ms() + 10;
        drop(s.begin_turn(&a, 2, None, 550, &Who::default(), last));
        let swept = s.sweep(last + crate::fleet::residents::MIN_IDLE_MS - 50);
        assert!(!swept.any);
        let due = last + crate::fleet::residents::MIN_IDLE_MS + 1;
        assert_eq!(swept.next_idle_out_ms, Some(due), "the next sweep is due the moment it idles out");
        assert!(!s.sweep(due - 1).any);
        assert!(s.sweep(due).any);
        assert_eq!(s.sweep(due).next_idle_out_ms, None, "nobody left to idle out");
        // Its entry in a shared store lives exactly that long, plus the flusher's slack.
        drop(s.begin_turn(&a, 3, None, 500, &Who::default(), crate::clock::now_ms()));
        let last = crate::clock::now_ms() + 1_000;
        drop(s.begin_turn(&a, 3, None, 550, &Who::default(), last));
        let kept = s.kept(last);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].until_ms, last + 3_000 + STORE_SLACK_MS);
    }

    #[test]
    fn the_projection_learns_what_ended_sessions_grew_to_and_new_ones_count_at_it() {
        let (s, a) = instance();
        let link = Some(42);
        assert_eq!(s.project(link), None, "a cold gateway projects nothing");
        // An agent of that link grows from 2,000 to 9,000 tokens, then idles out.
        let start = crate::clock::now_ms();
        for (i, tokens) in [2_000, 5_500, 9_000].into_iter().enumerate() {
            drop(s.begin_turn(&a, 1, link, tokens, &Who::default(), start + i as u64));
        }
        assert_eq!(s.room_of(&a).left(), Some(3_000));
        assert!(s.sweep(crate::clock::now_ms() + 60_000).any);
        assert_eq!(s.project(link), Some(9_000));
        assert_eq!(s.project(Some(7)), Some(9_000), "another link: the fleet's");
        // A new session of that link counts at 9,000 from its first 2,000-token turn.
        drop(s.begin_turn(&a, 2, link, 2_000, &Who::default(), crate::clock::now_ms()));
        assert_eq!(s.room_of(&a).left(), Some(3_000));
        // And at what it holds, once it outgrows its projection.
        drop(s.begin_turn(&a, 2, link, 10_000, &Who::default(), crate::clock::now_ms()));
        assert_eq!(s.room_of(&a).left(), Some(2_000));
        let figures = s.projection_figures();
        assert_eq!((figures.fleet_tokens, figures.sessions_learned, figures.links), (Some(9_000), 1, 1));
    }

    #[tokio::test]
    async fn a_turn_that_ends_where_its_next_would_pass_its_projection_gives_its_room_at_once() {
        let s = Sessions::new(SessionConfig { idle_ms: 10_000, ..settings() });
        let a = replica("a");
        let link = Some(42);
        // One session of the link grows to 9,000 tokens and ends: learned.
        let start = crate::clock::now_ms();
        for (i, tokens) in [2_000, 5_500, 9_000].into_iter().enumerate() {
            drop(s.begin_turn(&a, 1, link, tokens, &Who::default(), start + i as u64));
        }
        assert!(s.sweep(crate::clock::now_ms() + 60_000).any);
        // The next one: below the peak it keeps its room through its gaps.
        let now = crate::clock::now_ms();
        drop(s.begin_turn(&a, 2, link, 2_000, &Who::default(), now));
        drop(s.begin_turn(&a, 2, link, 5_500, &Who::default(), now + 1));
        assert!(!s.sweep(crate::clock::now_ms() + 100).any);
        // Its turn at the peak ends: most likely its last. The sessions'
        // task is told to sweep, and the sweep lets it go at once.
        let turn = s.begin_turn(&a, 2, link, 9_000, &Who::default(), now + 2);
        let told = tokio::time::timeout(std::time::Duration::from_millis(50), s.sweep_wanted());
        drop(turn);
        assert!(told.await.is_ok(), "the sessions' task is told");
        assert!(s.sweep(now + 10).any, "gone a moment after its turn ended, not its gaps later");
        assert!(!s.is_resident(2));
        // Another link's session counts at the fleet's projection (9,000
        // too): well below it, it keeps its room through its gaps.
        drop(s.begin_turn(&a, 3, Some(7), 2_000, &Who::default(), crate::clock::now_ms()));
        assert!(!s.sweep(crate::clock::now_ms() + 100).any);
    }

    #[test]
    fn a_wall_seen_teaches_the_projection_what_the_sessions_resident_there_hold_before_they_end() {
        let s = Sessions::new(settings());
        let (a, b) = (replica("a"), replica("b"));
        let now = crate::clock::now_ms();
        drop(s.begin_turn(&a, 1, Some(42), 6_500, &Who::default(), now));
        drop(s.begin_turn(&a, 2, Some(42), 5_000, &Who::default(), now));
        drop(s.begin_turn(&b, 3, Some(7), 9_000, &Who::default(), now));
        assert!(!s.sweep(now).any);
        assert_eq!(s.project(Some(42)), None, "no session ended, no wall seen: nothing learned");
        // The engine on a says its pool is full (or preempted, or a receipt found a lost prefix).
        assert_eq!(a.residents.engine_full(0), Some(11_500));
        assert!(!s.sweep(now).any, "nobody leaves for it");
        assert_eq!(s.project(Some(42)), Some(6_500), "its link: the largest of the sessions that crossed it");
        assert_eq!(s.project(Some(7)), Some(6_500), "b saw no wall: its session taught nothing");
        assert!(s.is_resident(1) && s.is_resident(2) && s.is_resident(3));
    }

    #[test]
    fn a_wall_narrows_a_replica_only_while_something_is_resident_there() {
        let (s, a) = pool_of(3_000);
        let now = crate::clock::now_ms();
        drop(s.begin_turn(&a, 1, None, 800, &Who::default(), now));
        assert_eq!(a.residents.receipt(1_000, 0, 0, 0), crate::fleet::wall::Receipt::Lost { load: 800 });
        assert_eq!(s.room_of(&a).left(), Some(0), "lost a prefix at 800: no room above it");
        assert!(s.sweep(now + 60_000).any);
        assert_eq!(s.room_of(&a).left(), Some(3_000), "empty: no session loses its prefix to another's");
    }

    #[test]
    fn on_slots_a_wall_counts_the_slots_its_sessions_held_so_four_slots_still_take_four_sessions() {
        use crate::fleet::wall::Receipt;
        use crate::sessions::room::{entry, Entry};
        let s = Sessions::new(settings()); // idle_ms 1 s
        let a = replica("a");
        a.set_observed_kv(Some(16_384));
        a.set_slot_tokens(Some(4_096)); // four slots
        let now = crate::clock::now_ms();
        for id in 1..=5 {
            drop(s.begin_turn(&a, id, None, 1_000, &Who::default(), now + id as u64));
        }
        // Five sessions on four slots: a returning one lost its prefix. The
        // loss is read in tokens (5,000), the wall in the slots held (four).
        assert_eq!(a.residents.receipt(900, 0, 0, now + 10), Receipt::Lost { load: 5_000 });
        assert_eq!(s.wall_of(&a), Some(16_384), "the four slots, not the 5,000 tokens the five held");
        // They leave, and three come: a fourth still has its slot.
        assert!(s.sweep(now + 60_000).any);
        for id in 6..=8 {
            drop(s.begin_turn(&a, id, None, 1_000, &Who::default(), now + 60_000 + id as u64));
        }
        assert_eq!(entry(&[s.room_of(&a)], 1_000, 0), Entry::Admit);
        drop(s.begin_turn(&a, 9, None, 1_000, &Who::default(), now + 60_010));
        assert_eq!(entry(&[s.room_of(&a)], 1_000, 0), Entry::Hold, "a fifth waits for a slot");
    }

    #[test]
    fn on_one_slot_a_wall_seen_holds_a_short_session_for_room_not_as_larger_than_the_replica() {
        use crate::sessions::room::{entry, Entry};
        let s = Sessions::new(settings());
        let a = replica("a");
        a.set_observed_kv(Some(8_192));
        a.set_slot_tokens(Some(8_192));
        let now = crate::clock::now_ms();
        drop(s.begin_turn(&a, 1, None, 2_900, &Who::default(), now));
        drop(s.begin_turn(&a, 2, None, 2_900, &Who::default(), now + 1));
        let _ = a.residents.receipt(2_500, 0, 0, now + 2);
        assert_eq!(a.residents.evidence.wall(), Some(5_800), "lost at 5,800 tokens resident");
        assert_eq!(s.wall_of(&a), Some(8_192), "one slot held: 5,800 tokens were two slots' worth");
        assert_eq!(entry(&[s.room_of(&a)], 2_900, 0), Entry::Hold, "it fits the slot once the slot is free");
    }

    #[test]
    fn a_session_whose_next_turn_began_elsewhere_is_released_by_that_instance_not_here() {
        let s = Sessions::new(settings()); // idle_ms 1 s
        let a = replica("a");
        drop(s.begin_turn(&a, 1, None, 5_000, &Who::default(), 1_000));
        // Its next turn began on another instance at 2,000 and is still running
        // there at 4,000, past this instance's idle-out of 1 s.
        s.seen_elsewhere(&a, 1, heard(6_000, 2_000, 1_000, 0));
        let swept = s.sweep(4_000);
        assert!(swept.released.is_empty() && s.is_resident(1), "kept, and not released by this instance");
        // That instance releases it once it idles out after its turn.
        s.released_elsewhere("a", 1);
        assert!(!s.is_resident(1));
        assert_eq!(s.project(None), Some(6_000), "what it grew to, seen here, is learned here too");
        // Without news, it leaves after ELSEWHERE_FACTOR x idle_ms.
        s.seen_elsewhere(&a, 2, heard(6_000, 10_000, 10_000, 0));
        assert!(!s.sweep(10_000 + 5_000).any);
        assert!(s.sweep(10_000 + ELSEWHERE_FACTOR * 1_000 + 1).any);
    }

    #[test]
    fn a_next_turn_elsewhere_heard_before_this_instance_saw_its_own_turn_end_is_still_the_later_one() {
        let s = Sessions::new(settings()); // idle_ms 1 s
        let a = replica("a");
        let t0 = crate::clock::now_ms();
        let turn = s.begin_turn(&a, 1, None, 2_000, &Who::default(), t0);
        // The client had its answer and sent the next turn to another
        // instance before this one saw its own stream end.
        s.seen_elsewhere(&a, 1, heard(2_500, t0 + 100, t0, 0));
        drop(turn);
        // That instance serves the latest turn and releases it: not this one.
        let swept = s.sweep(t0 + 100 + 1_001);
        assert!(swept.released.is_empty() && s.is_resident(1), "released while its latest turn ran elsewhere");
        // An older notice (its own turn's, announced again) changes nothing.
        s.seen_elsewhere(&a, 1, heard(2_500, t0 + 50, t0, 0));
        assert!(s.sweep(t0 + 100 + 1_001).released.is_empty());
    }

    #[test]
    fn with_turns_spread_over_instances_each_learns_the_agents_gap_from_the_turns_it_hands_on() {
        // Turns 1, 3, 5 here, 2 and 4 on other instances; each turn takes
        // 1 s and the agent returns 50 ms after each.
        let s = Sessions::new(SessionConfig { idle_ms: 5_000, ..settings() });
        let a = replica("a");
        // Ahead of the clock: a turn's guard, dropped now, ends it no later than asked.
        let mut at = crate::clock::now_ms() + 100_000;
        for turn in 1..=5u64 {
            match turn % 2 {
                1 => {
                    let t = s.begin_turn(&a, 1, None, 1_000 * turn, &Who::default(), at);
                    drop(t);
                    s.end_turn(1, at + 1_000);
                }
                _ => s.seen_elsewhere(&a, 1, heard(1_000 * turn, at, 0, 0)),
            }
            at += 1_050;
        }
        let r = a.residents.get(1).unwrap();
        assert_eq!(r.longest_gap_ms, 50, "the agent's silence, not a turn elsewhere and its silence");
        assert_eq!(r.idle_after_ms(5_000), crate::fleet::residents::MIN_IDLE_MS, "it leaves soon after its last turn");
    }

    #[test]
    fn a_sessions_pins_say_when_it_arrived_continued_and_what_its_turns_added() {
        let pin = |turns, created_ms, last_used_ms, est_tokens| crate::pins::Pin {
            replica: Arc::from("a"),
            created_ms,
            last_used_ms,
            turns,
            est_tokens,
            family: 7,
            origin: Default::default(),
            went_on: 0,
        };
        let first = pin(1, 1_000, 1_000, 1_000);
        let one = Heard::from_pins(&first, Some(&first));
        assert_eq!((one.arrived_ms, one.continued_ms, one.growth_hint), (1_000, 0, 0), "not continued yet");
        let second = Heard::from_pins(&pin(2, 1_400, 1_400, 1_300), Some(&first));
        assert_eq!((second.arrived_ms, second.continued_ms, second.growth_hint), (1_000, 1_400, 300));
        let fourth = Heard::from_pins(&pin(4, 2_200, 2_200, 1_900), Some(&first));
        assert_eq!((fourth.continued_ms, fourth.growth_hint, fourth.tokens), (1_000, 300, 1_900), "as early as can be");
        let unknown_family = Heard::from_pins(&pin(3, 2_000, 2_000, 1_600), None);
        assert_eq!((unknown_family.arrived_ms, unknown_family.growth_hint), (2_000, 0));
    }

    #[test]
    fn a_moved_session_lives_where_it_went_and_a_removed_replica_takes_its_sessions() {
        let s = Sessions::new(settings());
        let (a, b) = (replica("a"), replica("b"));
        drop(s.begin_turn(&a, 1, None, 300, &Who::default(), 0));
        drop(s.begin_turn(&b, 1, None, 200, &Who::default(), 1));
        assert_eq!((Sessions::resident(&a).sessions, Sessions::resident(&b).tokens), (0, 300));
        s.seen_elsewhere(&a, 2, heard(100, 5, 5, 0));
        a.set_observed_kv(Some(1_000));
        assert_eq!(s.room_of(&a).left(), Some(900));
        a.set_slot_tokens(Some(250));
        assert_eq!(s.room_of(&a).left(), Some(750), "a whole slot taken");
        // The replica leaves: its record (and its sessions' figures) with it.
        let gone = Arc::downgrade(&a);
        drop(a);
        assert!(gone.upgrade().is_none());
        assert_eq!((s.is_resident(2), s.is_resident(1)), (false, true));
        assert!(s.sweep(crate::clock::now_ms()).any, "the sweep drops the sessions whose replica left");
        assert_eq!(s.len(), 1);
    }
}
