//! The conversations one replica holds: the one record of where a
//! conversation lives, read by the hold and placement (`sessions/`: who is
//! resident, their footprints, projections, gaps; the wall receipts found
//! is `wall::WallEvidence`, kept here beside the load it is read at)
//! and by the capacity verdict (the working set: conversations that came
//! back, resident now or ended within the verdict's window). Kept on the
//! replica's record, so it leaves with it. `Sessions` decides who is
//! resident where and keeps the index from a session to its replica; this
//! is only the replica's side of it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::wall::{Load, Receipt, WallEvidence};
use crate::policy::PrefixKey;

/// One resident session.
#[derive(Debug, Clone, Copy, Default)]
pub struct Resident {
    /// Its context now, tokens (its latest turn's).
    pub tokens: u64,
    /// What its latest turns added to its context, tokens, newest first
    /// (0: not known yet): its next turn likely adds as much as the most of
    /// these (agents' contexts grow, by as much as their answers and tool
    /// results, which vary). Read through `growth`, written by `grew`.
    pub recent_growth: [u64; GROWTH_MEMORY],
    /// The largest context it reached: what it teaches the projections when it ends.
    pub peak_tokens: u64,
    /// What it was projected to reach when it arrived (0: nothing learned):
    /// it counts against the room at the larger of this and `tokens`.
    pub projected: u64,
    /// Its first link (system prompt, instructions, tools), when it has one.
    pub link: Option<crate::policy::PrefixKey>,
    /// When it arrived on this replica (its first turn here), ms: the
    /// youngest is the one whose turns pause when the pool is crossed.
    pub arrived_ms: u64,
    /// When its second turn began, here or (as its pins say) elsewhere, ms
    /// (0: not yet, or not known): of sessions that arrived together, the
    /// later to continue is the younger (`room::Occupant::continued_ms`).
    pub continued_ms: u64,
    /// When its latest turn began, here or (as its pins say) elsewhere, ms:
    /// a turn heard of from another instance is a later one only if it
    /// began after this.
    pub began_ms: u64,
    /// When it was last active: its latest turn's start while it runs, its
    /// end once it ended here, or the start of a later one elsewhere (as
    /// its pins say). Its idle-out counts from this.
    pub last_ms: u64,
    /// Turns running now: a session mid-turn is never idle.
    pub running: u32,
    /// A turn of it ran here (not only another instance's pins say so):
    /// this instance keeps it alive in a shared store.
    pub ours: bool,
    /// The longest silence between two of its turns seen here, ms (0: none
    /// yet): how long this agent's tool calls take, so when it has left.
    pub longest_gap_ms: u64,
    /// Its priority class: its first turn's, unless a later turn said another.
    pub class: crate::priority::Class,
    /// Its client, hashed (turns between clients when residents give way).
    pub client: u64,
    /// A waiting session of a higher class took its room between its turns
    /// (`priority.preempt`): it counts for nothing until its next turn,
    /// which waits for room again.
    pub preempted: bool,
    /// Its turns here (2 or more: it came back, and the working set counts it).
    pub turns: u32,
    /// The replica's turn count (`Residents::begun`) when its latest turn began.
    pub begun_seq: u64,
    /// How many other sessions began a turn here between its previous
    /// turn and its latest: a prefix it then finds was kept beside theirs.
    /// Sessions, not turns, and not every resident: a paused or idle
    /// resident took no slot meanwhile, so counting it would read two
    /// slots as keeping four sessions (a host tier that is not there).
    pub others_between: u32,
    /// Its turns paused now at the wall (`sessions/pause.rs`), and since
    /// when the first of them waits, ms.
    pub paused: u32,
    pub paused_since_ms: u64,
    /// How long its turns waited in pauses that ended, ms (the sessions view).
    pub waited_ms: u64,
    /// Its latest turn ended where its next would pass its projection (the
    /// peak its link's last sessions reached, else the fleet's):
    /// most likely its last, so it idles out at once and its room goes to the next (a
    /// paused turn, a held session) without a hand-off's wait.
    pub at_peak: bool,
}

/// A conversation that came back here (two turns or more) and has since
/// idled out: the capacity verdict counts it through its window, since the
/// replica should still keep it warm.
#[derive(Debug, Clone, Copy)]
struct Ended {
    tokens: u64,
    last_ms: u64,
}

/// A session idles out after this many times its longest gap between turns.
pub const GAP_FACTOR: u64 = 3;

/// ... and never sooner than this: a loop that returns at once still gets
/// a moment (the client's own work, a pub/sub hop to another instance).
pub const MIN_IDLE_MS: u64 = 500;

/// How many of a session's latest turns its next turn's growth is guessed
/// from. Why not only the latest: what a turn added is known as estimates
/// (and answers and tool results vary). On real vLLM, one agent's turns
/// each added 247 tokens by the engine's count, but 195-380 by the
/// gateway's estimates, made as the replica's calibration moved between
/// turns; reckoning with the latest let an older session's turn cross a
/// 3,072-token pool by 16 tokens (docs/benchmarks-log.md, three instances).
/// Why not every turn: a one-off large tool result would count against the
/// room for the rest of the session.
pub const GROWTH_MEMORY: usize = 3;

impl Resident {
    /// Its context at its next turn, tokens, as far as anyone can tell: its
    /// latest turn's plus the most its recent turns added (whether the
    /// latest runs now or ended: an agent's next turn comes within moments
    /// either way).
    pub fn next_turn_tokens(&self) -> u64 {
        self.tokens.saturating_add(self.growth())
    }

    /// The most its recent turns added, tokens (0: not known yet).
    pub fn growth(&self) -> u64 {
        self.recent_growth.iter().copied().max().unwrap_or(0)
    }

    /// Its next turn came, `silence` after its last turn ended (None: before
    /// this instance saw that turn end: the client had its answer first,
    /// and its agent returned at once). Why not leave a gap unrecorded then:
    /// a fast agent whose every return beat the stream's end would keep
    /// `longest_gap_ms` at 0, "none yet", and hold its room `idle_ms`
    /// after it stopped instead of `MIN_IDLE_MS` (on the simulated wall, a
    /// paused session waited 2.9 s instead of 2.4 s in half the runs).
    pub fn came_back(&mut self, silence: Option<u64>) {
        self.longest_gap_ms = self.longest_gap_ms.max(silence.unwrap_or(0)).max(1);
    }

    /// Its latest turn added `tokens`.
    pub fn grew(&mut self, tokens: u64) {
        self.recent_growth.rotate_right(1);
        self.recent_growth[0] = tokens;
    }

    /// What it counts for against its replica's room, tokens.
    pub fn counted_tokens(&self) -> u64 {
        match self.preempted {
            true => 0,
            false => self.tokens.max(self.projected),
        }
    }

    /// How long after its last turn this session idles out: a few times its
    /// longest gap, between `MIN_IDLE_MS` and `idle_ms` (`sessions.idle_ms`,
    /// also what a session with one turn so far gets). An agent that returns
    /// at once gives its room back soon after it stops; one running long
    /// tool calls keeps it through them (up to `idle_ms`).
    pub fn idle_after_ms(&self, idle_ms: u64) -> u64 {
        if self.at_peak {
            return 0;
        }
        match self.longest_gap_ms {
            0 => idle_ms,
            gap => gap.saturating_mul(GAP_FACTOR).clamp(MIN_IDLE_MS.min(idle_ms), idle_ms),
        }
    }
}

#[derive(Debug, Default)]
pub struct Residents {
    sessions: Mutex<foldhash::HashMap<PrefixKey, Resident>>,
    /// Conversations that came back here and idled out, by id: the working
    /// set's memory (`working_set`). Locked after `sessions`, never before.
    ended: Mutex<foldhash::HashMap<PrefixKey, Ended>>,
    /// With a shared store: the footprints of every instance's live
    /// sessions here, as last read (`store.session_loads`).
    fleet_load: AtomicU64,
    /// A session turn's duration here, ms, smoothed (0: none ended yet).
    turn_ms: AtomicU64,
    /// The engine's prefill rate here: tokens prefilled over the time spent,
    /// both smoothed (`observe_prefill`).
    prefill: Mutex<Prefilled>,
    /// Session turns begun here: whether others ran between two turns of one.
    begun: AtomicU64,
    /// Where its cache ends, as its receipts showed it.
    pub evidence: WallEvidence,
}

/// What the gateway measured of a replica's pace, for the choice between
/// holding a new session and admitting it to pause later (`room::admit_and_pause`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pace {
    /// A session turn's duration, ms (None: none ended yet).
    pub turn_ms: Option<u64>,
    /// The engine's prefill rate, tokens a second (None: not measured yet).
    pub prefill_tps: Option<f64>,
}

/// Uncached prompt tokens prefilled and the engine's seconds on them, each
/// an exponentially smoothed sum (`PACE_WEIGHT`): their ratio is the rate.
#[derive(Debug, Default)]
struct Prefilled {
    tokens: f64,
    secs: f64,
}

/// Each new reading weighs this much in a smoothed figure (`Pace`).
const PACE_WEIGHT: f64 = 0.25;

fn smoothed(before: f64, reading: f64) -> f64 {
    if before == 0.0 {
        reading
    } else {
        before + (reading - before) * PACE_WEIGHT
    }
}

/// A prefill shorter than this many uncached tokens says little of the rate
/// (the time to first token is then mostly the queue and the first decode step).
pub const MIN_PREFILL_TOKENS: u64 = 256;

/// What another instance's pins say of a session (`Residents::heard`,
/// `Sessions::seen_elsewhere`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Heard {
    /// Its context at its latest turn, tokens.
    pub tokens: u64,
    /// When its latest turn began, ms.
    pub last_ms: u64,
    /// Its first turn's start: its family's first pin's creation, the same
    /// moment on every instance, so all agree which session is the youngest.
    pub arrived_ms: u64,
    /// When its second turn began, ms (0: not known): of sessions that
    /// arrived together, the later to continue is the younger.
    pub continued_ms: u64,
    /// What its turns added on average, as its pins say (0: unknown),
    /// until a turn seen here says.
    pub growth_hint: u64,
}

/// A turn of a session beginning here (`Residents::begin`).
#[derive(Debug, Clone, Copy)]
pub struct Begin {
    /// Its context with this turn, tokens.
    pub tokens: u64,
    pub now_ms: u64,
    /// What it was on the replica it moved from, if it moved: it keeps its
    /// gaps, peak and projection.
    pub moved: Option<Resident>,
    /// What a session new here is projected to reach (0: nothing learned).
    pub projected: u64,
    pub link: Option<PrefixKey>,
    pub class: crate::priority::Class,
    /// The turn stated its class (a later turn's stated class replaces the first's).
    pub stated: bool,
    /// Its client, hashed.
    pub client: u64,
}

/// A paused turn of a resident session: it counts as busy (it cannot idle
/// out: the room that opens is for it) until the guard is dropped, however
/// the pause ends (room opened, the wait ran out, or the client went away).
pub struct PausedTurn<'a> {
    residents: &'a Residents,
    session: PrefixKey,
}

impl Drop for PausedTurn<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.residents.lock().get_mut(&self.session) {
            r.running = r.running.saturating_sub(1);
            r.paused = r.paused.saturating_sub(1);
            if r.paused == 0 {
                r.waited_ms += crate::clock::now_ms().saturating_sub(r.paused_since_ms);
            }
        }
    }
}

/// What the sweep found of one session (`Residents::sweep_one`).
#[derive(Debug, Default)]
pub struct SweptOne {
    /// It idled out (or was not here): it left, as it was.
    pub left: Option<Resident>,
    /// It left, or was not here at all.
    pub gone: bool,
    /// When it idles out, when it is between turns and stays, ms.
    pub idle_out_ms: Option<u64>,
    /// It stays: its client, hashed.
    pub client: Option<u64>,
    /// Its first link and context now, when it stays and the replica saw its wall.
    pub crossed: Option<(Option<PrefixKey>, u64)>,
}

impl Residents {
    /// The sessions resident here. Private: every reading and change is a
    /// method, so none holds it across another lock. `Sessions` calls
    /// these with its own lock held, never the other way round.
    fn lock(&self) -> MutexGuard<'_, foldhash::HashMap<PrefixKey, Resident>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `session` as it is now, if resident here.
    pub fn get(&self, session: PrefixKey) -> Option<Resident> {
        self.lock().get(&session).copied()
    }

    pub fn contains(&self, session: PrefixKey) -> bool {
        self.lock().contains_key(&session)
    }

    /// Every resident session as it is now.
    pub fn snapshot(&self) -> Vec<(PrefixKey, Resident)> {
        self.lock().iter().map(|(id, r)| (*id, *r)).collect()
    }

    /// A session arrives with its record as it was (its stream went on
    /// here from another replica, `SessionTurn::moved_to`).
    pub fn carry(&self, session: PrefixKey, resident: Resident) {
        self.lock().insert(session, Resident { ours: true, ..resident });
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The sum of the residents' footprints: each counted at
    /// `counted_tokens`, shaped by `footprint` (whole slots on llama.cpp),
    /// the preempted ones at nothing.
    ///
    /// A system prompt several residents of a pool share is counted with
    /// each, though the pool caches it once. Why: counting it once paused
    /// fewer turns and was slower on real vLLM at its wall (whole 128-token
    /// blocks: the learned set 6-9 % slower in three runs), where on
    /// simulated pools it spared two needless pauses (docs/benchmarks-log.md,
    /// "Counting a shared system prompt once on a pool").
    pub fn footprint_sum(&self, footprint: impl Fn(u64) -> u64) -> u64 {
        // A preempted session counts for nothing: on slots, not even the
        // whole slot a session of any size takes (it gave that slot away).
        self.lock().values().filter(|s| !s.preempted).map(|s| footprint(s.counted_tokens())).sum()
    }

    /// The same sum with each resident at its next turn's context
    /// (`next_turn_tokens`) rather than at what it is counted for: the
    /// room a newcomer admitted to pause later (`room::admit_and_pause`)
    /// has until the residents' turns cross it.
    pub fn next_turn_sum(&self, footprint: impl Fn(u64) -> u64) -> u64 {
        self.lock().values().filter(|s| !s.preempted).map(|s| footprint(s.next_turn_tokens())).sum()
    }

    /// Sessions, their contexts and their counted contexts, summed.
    pub fn figures(&self) -> (usize, u64, u64) {
        let on = self.lock();
        (on.len(), on.values().map(|r| r.tokens).sum(), on.values().map(|r| r.counted_tokens()).sum())
    }

    /// Turns paused now, by class (`Class::ALL`'s order).
    pub fn paused_by_class(&self) -> [usize; 3] {
        let mut by_class = [0; 3];
        for r in self.lock().values() {
            let i = crate::priority::Class::ALL.iter().position(|c| *c == r.class).unwrap_or(1);
            by_class[i] += r.paused as usize;
        }
        by_class
    }

    /// A turn of `session` begins here: resident from now (as it was where
    /// it moved from, if it moved; anew otherwise).
    pub fn begin(&self, session: PrefixKey, b: Begin) {
        let mut on = self.lock();
        // One that ended here and came back has had a turn here already.
        let returned = u32::from(self.back(session));
        let fresh = !on.contains_key(&session);
        let others_between = match on.get(&session) {
            Some(me) => on.iter().filter(|(id, o)| **id != session && o.begun_seq > me.begun_seq).count() as u32,
            None => 0,
        };
        let r = on.entry(session).or_insert(match b.moved {
            Some(m) => Resident { last_ms: b.now_ms, arrived_ms: b.now_ms, running: 0, ours: true, ..m },
            None => Resident {
                tokens: b.tokens,
                last_ms: b.now_ms,
                arrived_ms: b.now_ms,
                ours: true,
                projected: b.projected,
                link: b.link,
                class: b.class,
                client: b.client,
                turns: returned,
                ..Default::default()
            },
        });
        if b.stated {
            r.class = b.class;
        }
        r.preempted = false;
        r.at_peak = false;
        if !fresh && r.ours {
            // The silence since its last turn ended: how long its agent
            // was away. Only when that turn ran here: a turn another
            // instance served is known by when it began, not when it
            // ended (that instance learns the gap, in `heard`).
            r.came_back((r.running == 0).then(|| b.now_ms.saturating_sub(r.last_ms)));
        }
        let tokens = b.tokens.max(b.moved.map_or(0, |m| m.tokens));
        r.grew(tokens.saturating_sub(r.tokens));
        r.tokens = tokens;
        r.peak_tokens = r.peak_tokens.max(r.tokens);
        r.last_ms = b.now_ms;
        r.began_ms = b.now_ms;
        r.others_between = others_between;
        r.begun_seq = self.begun.fetch_add(1, Ordering::Relaxed) + 1;
        r.running += 1;
        r.turns = r.turns.saturating_add(1);
        if r.turns >= 2 && r.continued_ms == 0 {
            r.continued_ms = b.now_ms;
        }
        r.ours = true;
    }

    /// A turn of `session` that ran here ended at `now_ms`. True when it
    /// ended at its peak (`Resident::at_peak`): it idles out at once.
    pub fn end(&self, session: PrefixKey, now_ms: u64) -> bool {
        let mut on = self.lock();
        let Some(r) = on.get_mut(&session) else { return false };
        if r.running == 1 && now_ms > r.began_ms {
            // One turn, from its start to its end here: the pace of a turn.
            let took = (now_ms - r.began_ms) as f64;
            let before = self.turn_ms.load(Ordering::Relaxed) as f64;
            self.turn_ms.store(smoothed(before, took).round() as u64, Ordering::Relaxed);
        }
        r.running = r.running.saturating_sub(1);
        r.last_ms = r.last_ms.max(now_ms);
        // Its next turn would take it past what sessions like it reached:
        // this one was most likely its last.
        r.at_peak = r.running == 0 && r.projected > 0 && r.tokens + r.growth().max(1) > r.projected;
        r.at_peak
    }

    /// A response here prefilled `uncached` tokens in `took` of the
    /// engine's time (`InflightGuard::prefilled`): the engine's prefill
    /// rate. Tokens and time are summed, not rates averaged: two prompts
    /// prefilled in one step come out as the engine's rate, where the
    /// second, timed from the first's first event, alone would read as
    /// almost instant.
    pub fn observe_prefill(&self, uncached: u64, took: std::time::Duration) {
        if uncached < MIN_PREFILL_TOKENS {
            return;
        }
        let mut p = self.prefill.lock().unwrap_or_else(|e| e.into_inner());
        let keep = 1.0 - PACE_WEIGHT;
        p.tokens = p.tokens * keep + uncached as f64;
        p.secs = p.secs * keep + took.as_secs_f64();
    }

    /// What was measured of this replica's pace.
    pub fn pace(&self) -> Pace {
        let turn_ms = Some(self.turn_ms.load(Ordering::Relaxed)).filter(|t| *t > 0);
        let p = self.prefill.lock().unwrap_or_else(|e| e.into_inner());
        let prefill_tps = (p.secs > 0.0).then(|| p.tokens / p.secs);
        Pace { turn_ms, prefill_tps }
    }

    /// Another instance's pins say of `session` what `heard` holds: resident
    /// here as of `heard.last_ms` (no turn of it runs here).
    pub fn heard(&self, session: PrefixKey, heard: Heard) {
        let Heard { tokens, last_ms, arrived_ms, continued_ms, growth_hint } = heard;
        let mut on = self.lock();
        self.back(session);
        // Known from its pins: it came back (or has a name), as the working set counts.
        let r = on.entry(session).or_insert(Resident {
            tokens,
            last_ms,
            began_ms: last_ms,
            arrived_ms,
            turns: 2,
            ..Default::default()
        });
        if r.continued_ms == 0 {
            r.continued_ms = continued_ms;
        }
        // Compared with when the latest turn known here began, not with when
        // it ended: the client may send the next turn elsewhere before this
        // instance sees its own turn's stream end.
        if last_ms > r.began_ms {
            // A later turn began elsewhere: that instance, the last to serve
            // it, releases it once it idles out after that turn (it knows
            // when the turn ends); this one stops keeping it. When the turn
            // before ran here, the silence between its end and this start
            // is the agent's gap: every instance learns it from the turns it
            // hands on, so the one serving the last turn releases it soon.
            if r.ours {
                r.came_back((r.running == 0).then(|| last_ms.saturating_sub(r.last_ms)));
            }
            r.ours = false;
            r.began_ms = last_ms;
        }
        if tokens > r.tokens {
            r.grew(tokens - r.tokens);
            r.tokens = tokens;
        } else if r.growth() == 0 {
            // First heard of here, after turns elsewhere: its pins say what
            // they added, or the youngest would reckon with it at its size
            // now and go into a round that crosses the pool.
            r.grew(growth_hint);
        }
        r.peak_tokens = r.peak_tokens.max(r.tokens);
        r.last_ms = r.last_ms.max(last_ms);
    }

    /// `session` leaves this replica (it moved, or its record is dropped),
    /// as it was.
    pub fn remove(&self, session: PrefixKey) -> Option<Resident> {
        self.lock().remove(&session)
    }

    /// `session` leaves if no turn of it runs here (another instance
    /// released it): as it was, remembered for the working set.
    pub fn remove_if_between_turns(&self, session: PrefixKey) -> Option<Resident> {
        let mut on = self.lock();
        let ended = on.get(&session).filter(|r| r.running == 0).copied()?;
        on.remove(&session);
        drop(on);
        self.remember_ended(session, &ended);
        Some(ended)
    }

    /// The sweep's look at `session`: it leaves when it is not here or
    /// idled out at `now_ms` (`idle_after`: how long after its last turn);
    /// `lesson`: this replica saw its wall, and what stays says what it holds.
    pub fn sweep_one(
        &self,
        session: PrefixKey,
        now_ms: u64,
        idle_after: impl Fn(&Resident) -> u64,
        lesson: bool,
    ) -> SweptOne {
        let mut on = self.lock();
        let Some(r) = on.get(&session).copied() else { return SweptOne { gone: true, ..SweptOne::default() } };
        let crossed = lesson.then_some((r.link, r.tokens));
        let idle_out_ms = (r.running == 0).then(|| r.last_ms.saturating_add(idle_after(&r)).saturating_add(1));
        if idle_out_ms.is_some_and(|at| now_ms >= at) {
            on.remove(&session);
            drop(on);
            self.remember_ended(session, &r);
            return SweptOne { left: Some(r), gone: true, crossed, ..SweptOne::default() };
        }
        SweptOne { left: None, gone: false, idle_out_ms, client: Some(r.client), crossed }
    }

    /// A turn of `session` pauses: the session counts as busy until the guard is dropped.
    pub fn paused_turn(&self, session: PrefixKey) -> PausedTurn<'_> {
        if let Some(r) = self.lock().get_mut(&session) {
            r.running += 1;
            if r.paused == 0 {
                r.paused_since_ms = crate::clock::now_ms();
            }
            r.paused += 1;
        }
        PausedTurn { residents: self, session }
    }

    /// `session` counts again (the room a higher class took went where it was given).
    pub fn unpreempt(&self, session: PrefixKey) {
        if let Some(r) = self.lock().get_mut(&session) {
            r.preempted = false;
        }
    }

    /// Preempts `victims` that are still of a class below `class` and
    /// `between_turns` (a turn may have begun since they were chosen):
    /// they count for nothing until their next turn. Returns the classes
    /// of those preempted.
    pub fn preempt(
        &self,
        victims: &[PrefixKey],
        class: crate::priority::Class,
        between_turns: impl Fn(&PrefixKey, &Resident) -> bool,
    ) -> Vec<crate::priority::Class> {
        let mut on = self.lock();
        let mut out = Vec::new();
        for id in victims {
            if let Some(r) = on.get_mut(id).filter(|r| between_turns(id, r) && r.class < class) {
                r.preempted = true;
                out.push(r.class);
            }
        }
        out
    }

    pub fn fleet_load(&self) -> u64 {
        self.fleet_load.load(Ordering::Relaxed)
    }

    pub fn set_fleet_load(&self, tokens: u64) {
        self.fleet_load.store(tokens, Ordering::Relaxed);
    }

    fn ended(&self) -> MutexGuard<'_, foldhash::HashMap<PrefixKey, Ended>> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resident `session` left (`r` as it was): one that came back is
    /// remembered for the working set, at the largest context it held.
    pub fn remember_ended(&self, session: PrefixKey, r: &Resident) {
        if r.turns >= 2 {
            self.ended().insert(session, Ended { tokens: r.peak_tokens.max(r.tokens), last_ms: r.last_ms });
        }
    }

    /// A conversation that came back here, as the pins restored at start
    /// say (`tokens`, last used at `last_ms`): in the working set until its
    /// window passes or it is resident again.
    pub fn remember(&self, conversation: PrefixKey, tokens: u64, last_ms: u64) {
        let mut ended = self.ended();
        let e = ended.entry(conversation).or_insert(Ended { tokens, last_ms });
        e.tokens = e.tokens.max(tokens);
        e.last_ms = e.last_ms.max(last_ms);
    }

    /// Resident `session` is back: it counts as resident, not as ended.
    /// True when it had ended here (it came back).
    pub fn back(&self, session: PrefixKey) -> bool {
        self.ended().remove(&session).is_some()
    }

    /// The conversation lives elsewhere now (its pin moved): not here.
    pub fn forget(&self, conversation: PrefixKey) {
        self.ended().remove(&conversation);
    }

    /// Forgets every ended conversation (the replica's pins were deleted).
    pub fn forget_ended(&self) {
        self.ended().clear();
    }

    /// The working set: every conversation that came back here, resident
    /// now or ended since `since_ms` (older ones are dropped), with the
    /// largest context each held.
    pub fn working_set(&self, since_ms: u64) -> Vec<(PrefixKey, u64)> {
        let mut out: Vec<(PrefixKey, u64)> = self
            .lock()
            .iter()
            .filter(|(_, r)| r.turns >= 2)
            .map(|(id, r)| (*id, r.peak_tokens.max(r.tokens)))
            .collect();
        let mut ended = self.ended();
        ended.retain(|_, e| e.last_ms >= since_ms);
        out.extend(ended.iter().map(|(id, e)| (*id, e.tokens)));
        out
    }

    /// The engine's preemption counter read (`total`, vLLM's): the wall
    /// lowered to the load resident now when it rose
    /// (`WallEvidence::engine_preemptions`).
    pub fn engine_preemptions(&self, total: u64, now_ms: u64) -> Option<u64> {
        self.evidence.engine_preemptions(total, self.load(), now_ms)
    }

    /// The engine says its pool is full now: the wall lowered to the load
    /// resident now (`WallEvidence::engine_full`).
    pub fn engine_full(&self, now_ms: u64) -> Option<u64> {
        self.evidence.engine_full(self.load(), now_ms)
    }

    /// Reads a pinned turn's receipt against the load resident now
    /// (`WallEvidence::receipt`); `others_between`: other sessions whose
    /// turns began here since the session's previous turn.
    pub fn receipt(&self, predicted: u64, cached: u64, others_between: u32, now_ms: u64) -> Receipt {
        self.evidence.receipt(self.load(), predicted, cached, others_between, now_ms)
    }

    /// Tokens resident in the sessions not paused, and how many sessions
    /// hold them. Why not the paused: their turns wait and take nothing of
    /// the engine meanwhile; counted, a prefix kept beside two running
    /// sessions while two more waited read as four sessions kept on two
    /// slots (a host tier that is not there), and the learned capacity let
    /// four in (real llama-server, the second set of families 347.5 s
    /// instead of 107.1 s). Raw tokens, not footprints (whole slots): read
    /// in footprints, a loss on a slot engine at as many sessions as were
    /// once kept beside others always read as the engine's miss, no wall
    /// was ever learned on llama-server as shipped, and the agent-traffic
    /// replay there took 1.12-1.20x of vllm-router's wall instead of
    /// 0.73-0.84x (docs/benchmarks-log.md, real agent traffic).
    fn load(&self) -> Load {
        let on = self.lock();
        let running = || on.values().filter(|r| r.paused == 0);
        Load { tokens: running().map(|r| r.tokens).sum(), sessions: running().count() as u64 }
    }

    /// How many other sessions began a turn here between `session`'s
    /// previous turn and its latest (`Resident::others_between`).
    pub fn others_between(&self, session: PrefixKey) -> u32 {
        self.lock().get(&session).map_or(0, |r| r.others_between)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_kept_beside_other_sessions_turns_above_the_wall_forgets_it() {
        let r = Residents::default();
        let begin = |session, tokens, now_ms| {
            r.begin(
                session,
                Begin {
                    tokens,
                    now_ms,
                    moved: None,
                    projected: 0,
                    link: None,
                    class: Default::default(),
                    stated: false,
                    client: 0,
                },
            )
        };
        begin(1, 1_000, 0);
        begin(2, 1_000, 1);
        assert_eq!(r.receipt(900, 100, 0, 2), Receipt::Lost { load: 2_000 });
        assert_eq!(r.evidence.wall(), Some(2_000));
        // Session 1 comes back after session 2's turn, above the wall, and
        // finds its prefix: the replica keeps both (llama-server restoring
        // it from host memory); the loss was not its capacity.
        begin(1, 1_500, 3);
        assert_eq!(r.others_between(1), 1);
        assert_eq!(r.receipt(1_000, 1_000, r.others_between(1), 4), Receipt::Unwalled { wall: 2_000, load: 2_500 });
        assert_eq!(r.evidence.wall(), None);
        // A loss with more resident sets it again (at 2,500 it is a miss:
        // sessions were kept beside others' there); a session whose turns
        // follow each other with nothing between proves only its load.
        begin(3, 500, 5);
        assert_eq!(r.receipt(900, 0, 0, 5), Receipt::Lost { load: 3_000 });
        begin(2, 1_200, 6);
        begin(2, 1_400, 7);
        assert_eq!(r.others_between(2), 0);
        assert_eq!(r.receipt(1_000, 1_000, r.others_between(2), 8), Receipt::Kept { load: 3_400 });
        assert_eq!(r.evidence.wall(), Some(3_400));
        // Kept beside others' turns at the wall, not above it: it stands.
        begin(1, 1_500, 9);
        assert_eq!(r.others_between(1), 2, "3 and 2 began turns since its last");
        assert_eq!(r.receipt(1_000, 1_000, 2, 10), Receipt::Kept { load: 3_400 });
        assert_eq!(r.evidence.wall(), Some(3_400));
    }

    #[test]
    fn a_receipt_reads_the_load_of_the_sessions_not_paused() {
        use crate::fleet::wall::KeptBeside;
        let r = Residents::default();
        for s in 1..=4 {
            r.lock().insert(s, Resident { tokens: 2_000, ..Default::default() });
        }
        // Two of the four wait at the wall: the engine keeps what the two
        // others hold, not four sessions.
        let paused = [r.paused_turn(3), r.paused_turn(4)];
        assert_eq!(r.receipt(1_500, 1_500, 1, 0), Receipt::Kept { load: 4_000 });
        assert_eq!(r.evidence.kept_beside(0), KeptBeside { tokens: 4_000, sessions: 2 });
        drop(paused);
        assert_eq!(r.receipt(1_500, 0, 0, 1), Receipt::Lost { load: 8_000 });
        assert_eq!(r.evidence.learned().wall_sessions, Some(3), "four running at the loss");
    }

    #[test]
    fn the_prefill_rate_sums_tokens_over_time_so_prompts_prefilled_together_read_as_the_engine() {
        use std::time::Duration;
        let r = Residents::default();
        assert_eq!(r.pace().prefill_tps, None);
        r.observe_prefill(MIN_PREFILL_TOKENS - 1, Duration::from_secs(1));
        assert_eq!(r.pace().prefill_tps, None, "too short to say");
        r.observe_prefill(1_000, Duration::from_secs(1));
        assert_eq!(r.pace().prefill_tps, Some(1_000.0));
        // A second prompt of the same step: its first event right after the
        // first's. Averaged as rates it would read as unbounded.
        r.observe_prefill(1_000, Duration::ZERO);
        let rate = r.pace().prefill_tps.unwrap();
        assert!((rate - 1_750.0 / 0.75).abs() < 1e-9, "{rate}");
        // Older readings fade: a slower engine shows through.
        for _ in 0..40 {
            r.observe_prefill(1_000, Duration::from_secs(4));
        }
        assert!((r.pace().prefill_tps.unwrap() - 250.0).abs() < 1.0);
    }

    #[test]
    fn the_working_set_is_every_conversation_that_came_back_resident_or_ended_within_the_window() {
        let r = Residents::default();
        let sorted = |mut v: Vec<(PrefixKey, u64)>| {
            v.sort();
            v
        };
        let once = Resident { tokens: 3_000, peak_tokens: 3_000, turns: 1, last_ms: 1_000, ..Default::default() };
        let back = Resident { tokens: 6_000, peak_tokens: 7_000, turns: 3, last_ms: 2_000, ..Default::default() };
        r.lock().insert(1, once);
        r.lock().insert(2, back);
        assert_eq!(r.working_set(0), vec![(2, 7_000)], "a one-turn conversation is not part of it");
        // Both idle out: the one that came back is remembered through the window.
        r.lock().clear();
        r.remember_ended(1, &once);
        r.remember_ended(2, &back);
        assert_eq!(r.working_set(1_500), vec![(2, 7_000)]);
        assert!(r.working_set(2_001).is_empty(), "past its window");
        assert!(r.working_set(0).is_empty(), "and dropped then");
        // Restored from the pins at start; back as a resident, it counts once.
        r.remember(3, 4_000, 5_000);
        r.remember(4, 2_000, 5_000);
        assert_eq!(sorted(r.working_set(0)), vec![(3, 4_000), (4, 2_000)]);
        assert!(r.back(3) && !r.back(3));
        r.lock().insert(3, Resident { tokens: 4_500, peak_tokens: 4_500, turns: 2, ..Default::default() });
        assert_eq!(sorted(r.working_set(0)), vec![(3, 4_500), (4, 2_000)]);
        // Moved elsewhere, or the replica's pins deleted: gone from here.
        r.forget(4);
        assert_eq!(r.working_set(0), vec![(3, 4_500)]);
        r.remember(5, 1_000, 5_000);
        r.forget_ended();
        assert_eq!(r.working_set(0), vec![(3, 4_500)], "the resident stays");
    }

    #[test]
    fn the_idle_out_is_a_few_times_the_longest_gap_between_a_floor_and_idle_ms() {
        let with_gap = |longest_gap_ms| Resident { tokens: 1, longest_gap_ms, ..Default::default() };
        assert_eq!(with_gap(0).idle_after_ms(5_000), 5_000, "one turn so far: idle_ms");
        assert_eq!(with_gap(10).idle_after_ms(5_000), MIN_IDLE_MS, "an agent that returns at once");
        assert_eq!(with_gap(1_000).idle_after_ms(5_000), 3_000);
        assert_eq!(with_gap(8_000).idle_after_ms(30_000), 24_000, "8 s tool calls keep their room");
        assert_eq!(with_gap(8_000).idle_after_ms(5_000), 5_000, "never past idle_ms");
        assert_eq!(with_gap(10).idle_after_ms(100), 100, "a floor above idle_ms gives way to it");
    }
}
