//! Room at the KV wall, pure: what a session takes of a replica, what is
//! left, where a new session goes, and whether it must wait. No clock, no
//! I/O: the caller gathers the figures (`Sessions::rooms`).
//!
//! The arithmetic, and why:
//! - A replica's capacity is its KV in tokens: vLLM's own metrics
//!   (`num_gpu_blocks x block_size`), a declared `kv_tokens`, or llama.cpp's
//!   slots times the context of one slot (`/props`).
//! - A session's footprint is its context in tokens. Where the capacity is
//!   slots (llama.cpp), a session takes whole slots: one slot keeps one
//!   conversation's prefix, however short, so the footprint is rounded up to
//!   a slot's context.
//! - Room = capacity - the footprints of the sessions resident there (their
//!   first turn until `sessions.idle_ms` of silence), and what other
//!   instances reserved.

pub use crate::fleet::residents::Pace;
use crate::priority::Class;

/// What the placement knows of one candidate replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// KV capacity in tokens; None: unknown.
    pub capacity: Option<u64>,
    /// Tokens taken by resident sessions and reservations.
    pub taken: u64,
    /// One slot's context, where the capacity is slots (llama.cpp).
    pub slot_tokens: Option<u64>,
}

impl Room {
    /// Tokens left (negative: over capacity); None when the capacity is unknown.
    pub fn left(&self) -> Option<i64> {
        self.capacity.map(|c| c as i64 - self.taken as i64)
    }

    /// What a session of `tokens` takes here.
    pub fn footprint(&self, tokens: u64) -> u64 {
        footprint(tokens, self.slot_tokens)
    }

    pub fn fits(&self, tokens: u64) -> bool {
        self.left().is_some_and(|left| left >= self.footprint(tokens) as i64)
    }
}

/// What a session of `tokens` takes of a replica: its context, or whole
/// slots where the capacity is slots of `slot_tokens` (llama.cpp: one slot
/// keeps one conversation's prefix, however short).
pub fn footprint(tokens: u64, slot_tokens: Option<u64>) -> u64 {
    match slot_tokens {
        Some(slot) if slot > 0 => tokens.max(1).div_ceil(slot) * slot,
        _ => tokens,
    }
}

/// Which candidates a new session may go to: those with the most room (the
/// caller's counter picks among ties), or all of them when any capacity is
/// unknown (the counter alone, as for any spread). Indexes into `rooms`.
pub fn most_room(rooms: &[Room]) -> Vec<usize> {
    if rooms.iter().any(|r| r.capacity.is_none()) {
        return (0..rooms.len()).collect();
    }
    let best = rooms.iter().filter_map(Room::left).max();
    (0..rooms.len()).filter(|i| rooms[*i].left() == best).collect()
}

/// What to do with a new session of `tokens` over `rooms` (its candidates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Place it now (room somewhere, capacity unknown, or too small to matter).
    Admit,
    /// No candidate has room: wait until a resident session leaves.
    Hold,
    /// Larger than any candidate's whole capacity: wait until one is empty,
    /// then it runs alone there.
    HoldAlone,
}

/// Counts sessions admitted but not resident yet (`reserved`: their
/// tokens) against `rooms`, each where the most room is left: where it
/// will most likely go. Unknown capacities take nothing.
pub fn reserve(rooms: &mut [Room], reserved: &[u64]) {
    for tokens in reserved {
        if let Some(room) = rooms.iter_mut().filter(|r| r.capacity.is_some()).max_by_key(|r| r.left()) {
            room.taken += room.footprint(*tokens);
        }
    }
}

/// The default `sessions.hold_min_tokens`: a sixteenth of the smallest
/// known capacity among `rooms` (0 when none is known: nothing to hold
/// against anyway).
pub fn default_min_tokens(rooms: &[Room]) -> u64 {
    rooms.iter().filter_map(|r| r.capacity).min().unwrap_or(0) / 16
}

/// `min_tokens`: a session whose footprint is smaller than this never
/// waits (a short chat costs a replica little, and holding it costs its user
/// a turn). On slots, every session takes a whole slot: it always matters.
pub fn entry(rooms: &[Room], tokens: u64, min_tokens: u64) -> Entry {
    if rooms.is_empty() || rooms.iter().any(|r| r.capacity.is_none()) {
        return Entry::Admit;
    }
    if rooms.iter().map(|r| r.footprint(tokens)).min().unwrap_or(0) < min_tokens {
        return Entry::Admit;
    }
    if rooms.iter().all(|r| r.footprint(tokens) > r.capacity.unwrap_or(0)) {
        // It fits nowhere even empty: it goes where nothing else is.
        return match rooms.iter().any(|r| r.taken == 0) {
            true => Entry::Admit,
            false => Entry::HoldAlone,
        };
    }
    match rooms.iter().any(|r| r.fits(tokens)) {
        true => Entry::Admit,
        false => Entry::Hold,
    }
}

/// A session as the choice between holding and pausing sees it: its
/// context at its next turn, and what a turn adds, tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growing {
    pub tokens: u64,
    pub growth: u64,
}

/// Rounds looked ahead at most.
const MAX_ROUNDS: u64 = 64;

/// How many turns a new session (`new`, its first turn) runs beside
/// `residents` (each at its next turn) on a pool of `capacity` before, all
/// growing a turn a round, their turns together cross it.
pub fn rounds_before_crossing(capacity: u64, residents: &[Growing], new: Growing) -> u64 {
    let load = |round: u64| residents.iter().chain([&new]).map(|s| s.tokens + round * s.growth).sum::<u64>();
    (0..MAX_ROUNDS).take_while(|round| load(*round) <= capacity).count() as u64
}

/// The choice for a new session that fits its replica now but not at what
/// it will grow to (its projection): hold it whole until a resident leaves,
/// or admit it now and pause its turn at the crossing (`must_pause`)?
///
/// - Admitted, its first `k` turns (`rounds_before_crossing`) run beside
///   the residents' turns; held, they would run after them. Its first turn
///   is a cold prefill of its whole context either way (`first / rate`),
///   plus a turn's answer: the overlap saves that and `k - 1` turns more.
/// - Paused at the crossing, its prefix is likely evicted while the older
///   sessions grow to their peaks: its context then re-prefills once, at
///   the engine's measured rate.
/// - The hand-off (a resident leaving, its room going to the next) is paid
///   by both.
///
/// Admit when the overlap saves more than the re-prefill costs. The first
/// prefill cancels out of the comparison, leaving `k` turns against what
/// its `k - 1` turns added, re-prefilled. (Counting the overlap as `k` warm
/// turns alone held whole sessions on real vLLM where the cold schedule
/// was faster: docs/benchmarks-log.md.) With nothing measured yet, admit: what
/// a cold gateway does. What was learned informs the choice; it is never a
/// reason to pick the slower schedule.
pub fn admit_and_pause(capacity: u64, residents: &[Growing], new: Growing, pace: Pace) -> bool {
    let k = rounds_before_crossing(capacity, residents, new);
    if k == 0 {
        return false;
    }
    let (Some(turn_ms), Some(prefill_tps)) = (pace.turn_ms, pace.prefill_tps) else { return true };
    let prefill_ms = |tokens: u64| tokens as f64 / prefill_tps * 1_000.0;
    let overlap_ms = prefill_ms(new.tokens) + k as f64 * turn_ms as f64;
    let reprefill_ms = prefill_ms(new.tokens + (k - 1) * new.growth);
    overlap_ms > reprefill_ms
}

/// Sessions whose first turns began within the same span of this many
/// milliseconds (counted from the epoch) arrived together: they are told
/// apart by when their second turn began, not by their arrival.
pub const ARRIVAL_GRAIN_MS: u64 = 1_000;

/// How young a resident is, larger is younger: its arrival's second, when
/// it continued, its arrival, its id (exactly one is the youngest).
type Age = (u64, u64, u64, u128);

/// One resident session as the pause sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupant {
    /// When it arrived here (its first turn), ms.
    pub arrived_ms: u64,
    /// When its second turn began, ms (`u64::MAX`: not yet). Why: agents
    /// launched together (a fan-out of subagents, a batch) arrive in the
    /// same millisecond, and the engine serves one first; the one behind
    /// should give way, or the one ahead waits for it to catch up and
    /// finish (on the simulated wall, a 3.2-3.7 s pause instead of 2.4 s).
    /// Fixed once set, and every instance hears it (the second turn's pin):
    /// a turn let through because another yields finds it still yielding.
    pub continued_ms: u64,
    /// Its id: sessions that arrived in the same millisecond are ordered by
    /// it, so exactly one of them is the youngest (two "youngest" sessions
    /// would pause each other until `max_wait_ms`).
    pub id: u128,
    /// Its context now, tokens.
    pub tokens: u64,
    /// Its priority class.
    pub class: Class,
    /// How many sessions of its class its client has resident here (itself
    /// included): within a class, the client with the most yields first.
    pub client_sessions: usize,
}

impl Occupant {
    /// The order in which residents give way when their replica is crossed:
    /// the lowest class first; within it, the client with the most sessions
    /// here (fair turns between clients); then the youngest: the latest to
    /// arrive, and of those that arrived together, the latest to continue.
    fn yield_order(&self) -> (Class, std::cmp::Reverse<usize>, std::cmp::Reverse<Age>) {
        let age = (self.arrived_ms / ARRIVAL_GRAIN_MS, self.continued_ms, self.arrived_ms, self.id);
        (self.class, std::cmp::Reverse(self.client_sessions), std::cmp::Reverse(age))
    }
}

/// Which residents give way when a replica's residents run over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Yielding {
    /// The first to give way alone (`Occupant::yield_order`): the engine
    /// evicts only what the others run over by (a pool's least recently
    /// used blocks) or restores what it evicts (a host tier), so pausing
    /// one is enough. Why not more there: on llama-server as shipped,
    /// pausing every session past one slot paused 24 turns of the
    /// agent-traffic replay where the first alone paused 3, and the replay
    /// took 172.1 s instead of 135.4 s (docs/benchmarks-log.md, real agent traffic).
    First,
    /// Every resident past what the capacity holds, kept in the reverse
    /// order: slots that are all the engine keeps, where each turn let
    /// through evicts a whole prompt. Why: on two slots with four sessions,
    /// pausing the youngest left three taking turns on two slots, each turn
    /// evicting a kept session's whole prompt (a pause of 120 s on real
    /// llama-server while the other three thrashed).
    Past,
}

/// Whether the next turn of `me` (a resident of `room`'s replica, now at
/// `tokens` of context) must pause: the residents' contexts with this turn
/// exceed the replica's capacity, and `me` gives way as `yielding` says:
/// the first to give way (`Occupant::yield_order`: the lowest class, the
/// client with the most sessions, the youngest), or any past what the
/// capacity holds when the residents are kept in the reverse order (its
/// context and those of every resident kept before it exceed it).
/// Pausing those keeps the others warm; pausing all would thrash every
/// one. `others` are the other residents. The first kept never pauses,
/// however large: no room would ever open for it. Unknown capacity: never.
pub fn must_pause(room: &Room, me: Occupant, others: impl IntoIterator<Item = Occupant>, yielding: Yielding) -> bool {
    let Some(capacity) = room.capacity else { return false };
    let mine = me.yield_order();
    let (mut taken, mut kept_before, mut first, mut alone) = (room.footprint(me.tokens), 0, true, true);
    for o in others {
        let footprint = room.footprint(o.tokens);
        taken += footprint;
        if o.yield_order() > mine {
            kept_before += footprint;
        } else {
            first = false;
        }
        alone = false;
    }
    match yielding {
        Yielding::First => taken > capacity && first && !alone,
        Yielding::Past => kept_before > 0 && room.footprint(me.tokens) + kept_before > capacity,
    }
}

/// Which lower-class residents give their room to a waiting session of
/// `class` and `footprint` tokens (`priority.preempt`): on each candidate
/// (its room, and its residents with whether a turn of theirs runs now), the
/// residents of a lower class between turns, lowest class and youngest
/// first, until the session fits. Returns the candidate needing the fewest
/// (index into `candidates`) and their ids; None when no candidate can be
/// freed enough. A turn that started is never cut: a resident mid-turn is
/// not taken.
pub fn preemptible(
    candidates: &[(Room, Vec<(Occupant, bool)>)],
    class: Class,
    footprint: u64,
) -> Option<(usize, Vec<u128>)> {
    let mut best: Option<(usize, Vec<u128>)> = None;
    for (i, (room, residents)) in candidates.iter().enumerate() {
        let Some(mut left) = room.left() else { continue };
        let mut lower: Vec<&Occupant> =
            residents.iter().filter(|(o, running)| o.class < class && !running).map(|(o, _)| o).collect();
        lower.sort_by_key(|o| (o.class, std::cmp::Reverse((o.arrived_ms, o.id))));
        let mut taken = Vec::new();
        for o in lower {
            if left >= footprint as i64 {
                break;
            }
            left += room.footprint(o.tokens) as i64;
            taken.push(o.id);
        }
        let fits = left >= footprint as i64;
        if fits && !taken.is_empty() && best.as_ref().is_none_or(|(_, b)| taken.len() < b.len()) {
            best = Some((i, taken));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_session_is_admitted_to_pause_later_when_the_overlap_saves_more_than_the_re_prefill_costs() {
        // The simulated wall: 12,000 tokens, one resident at its second
        // turn (3,500, +1,500 a turn), a new session of 2,000 (+1,500).
        let resident = [Growing { tokens: 3_500, growth: 1_500 }];
        let new = Growing { tokens: 2_000, growth: 1_500 };
        assert_eq!(rounds_before_crossing(12_000, &resident, new), 3, "5,500, 8,500, 11,500; then 14,500");
        let pace = |turn_ms, tps| Pace { turn_ms: Some(turn_ms), prefill_tps: Some(tps) };
        // Turns of 400 ms, prefill at 8,200 tokens a second: its first
        // prefill and three turns overlapped (0.24 + 1.2 s) against
        // re-prefilling 5,000 tokens (0.6 s).
        assert!(admit_and_pause(12_000, &resident, new, pace(400, 8_200.0)));
        // A slow prefill (1,000 tokens a second) against quick turns: 2 +
        // 1.2 s overlapped against 5 s re-prefilled: hold.
        assert!(!admit_and_pause(12_000, &resident, new, pace(400, 1_000.0)));
        // Real vLLM's shape (3,072 tokens, ~1,200-token sessions growing
        // ~250 a turn): one round overlaps; the re-prefill is the first
        // prefill again, so the turn it overlaps decides: admit.
        let vllm = [Growing { tokens: 1_450, growth: 250 }];
        let newcomer = Growing { tokens: 1_200, growth: 250 };
        assert_eq!(rounds_before_crossing(3_072, &vllm, newcomer), 1);
        assert!(admit_and_pause(3_072, &vllm, newcomer, pace(1_200, 300.0)));
        // Nothing measured: what a cold gateway does.
        assert!(admit_and_pause(12_000, &resident, new, Pace::default()));
        // It does not fit beside the residents now: held, whatever the pace.
        let full = [Growing { tokens: 11_000, growth: 0 }];
        assert_eq!(rounds_before_crossing(12_000, &full, new), 0);
        assert!(!admit_and_pause(12_000, &full, new, Pace::default()));
    }

    /// A default-class resident of one client, arrived (and continued) at
    /// `arrived_ms`, at `tokens` of context.
    fn at(arrived_ms: u64, tokens: u64) -> Occupant {
        Occupant {
            arrived_ms,
            continued_ms: arrived_ms,
            id: u128::from(arrived_ms),
            tokens,
            class: Class::Default,
            client_sessions: 1,
        }
    }

    fn room(capacity: u64, taken: u64) -> Room {
        Room { capacity: Some(capacity), taken, slot_tokens: None }
    }

    #[test]
    fn a_new_session_goes_where_the_most_room_is_and_ties_or_unknowns_go_to_the_counter() {
        assert_eq!(most_room(&[room(100, 80), room(100, 10), room(100, 50)]), vec![1]);
        assert_eq!(most_room(&[room(100, 10), room(200, 110), room(100, 50)]), vec![0, 1], "a tie");
        let unknown = Room { capacity: None, taken: 0, slot_tokens: None };
        assert_eq!(most_room(&[room(100, 0), unknown]), vec![0, 1]);
    }

    #[test]
    fn a_session_waits_only_when_no_candidate_has_room_for_it() {
        assert_eq!(entry(&[room(100, 80), room(100, 70)], 20, 10), Entry::Admit);
        assert_eq!(entry(&[room(100, 90), room(100, 85)], 20, 10), Entry::Hold);
        assert_eq!(entry(&[room(100, 90), room(100, 85)], 5, 10), Entry::Admit, "too small to matter");
        let unknown = Room { capacity: None, taken: 0, slot_tokens: None };
        assert_eq!(entry(&[room(100, 90), unknown], 50, 10), Entry::Admit, "unknown capacity: no hold");
        assert_eq!(entry(&[room(100, 10), room(100, 20)], 150, 10), Entry::HoldAlone);
        assert_eq!(entry(&[room(100, 0), room(100, 20)], 150, 10), Entry::Admit, "an empty replica takes it");
        assert_eq!(entry(&[], 150, 10), Entry::Admit);
    }

    #[test]
    fn a_session_admitted_but_not_resident_yet_takes_the_most_room() {
        let mut rooms = [room(100, 80), room(100, 10)];
        reserve(&mut rooms, &[50]);
        assert_eq!(rooms.map(|r| r.taken), [80, 60]);
        // The next one of 50 no longer fits anywhere: it waits.
        assert_eq!(entry(&rooms, 50, 10), Entry::Hold);
    }

    #[test]
    fn the_default_threshold_is_a_share_of_the_smallest_pool() {
        assert_eq!(default_min_tokens(&[room(3_072, 0), room(12_000, 0)]), 192);
        assert_eq!(default_min_tokens(&[room(1_000_000, 0)]), 62_500);
        let unknown = Room { capacity: None, taken: 0, slot_tokens: None };
        assert_eq!(default_min_tokens(&[unknown]), 0);
        // A 150-token chat on a 3,072-token pool is below it; a 1,200-token agent turn is not.
        let small_pool = [room(3_072, 3_000), room(3_072, 2_900)];
        assert_eq!(entry(&small_pool, 150, default_min_tokens(&small_pool)), Entry::Admit);
        assert_eq!(entry(&small_pool, 1_200, default_min_tokens(&small_pool)), Entry::Hold);
    }

    #[test]
    fn only_the_youngest_resident_pauses_and_only_over_the_pool() {
        let pool = room(12_000, 0);
        // Three sessions at 4,000 fit; the youngest growing to 5,000 crosses the pool.
        assert!(!must_pause(&pool, at(3, 4_000), [at(1, 4_000), at(2, 4_000)], Yielding::First));
        assert!(must_pause(&pool, at(3, 5_000), [at(1, 4_000), at(2, 4_000)], Yielding::First));
        // An older one crossing it does not pause: the youngest will.
        assert!(!must_pause(&pool, at(2, 5_000), [at(1, 4_000), at(3, 4_000)], Yielding::First));
        // Room opened (the oldest idled out): the youngest goes on.
        assert!(!must_pause(&pool, at(3, 5_000), [at(2, 4_000)], Yielding::First));
        let unknown = Room { capacity: None, taken: 0, slot_tokens: None };
        assert!(!must_pause(&unknown, at(3, 50_000), [at(1, 4_000)], Yielding::First));
        // On one-slot llama.cpp replicas, a second conversation never fits beside the first.
        let slot = Room { capacity: Some(8_192), taken: 0, slot_tokens: Some(8_192) };
        assert!(must_pause(&slot, at(2, 100), [at(1, 100)], Yielding::First));
        // Alone on it, a session larger than the replica goes on: nothing would make room.
        assert!(!must_pause(&pool, at(1, 50_000), [], Yielding::First));
        // Two that arrived in the same millisecond: exactly one pauses.
        let (x, y) = (Occupant { id: 1, ..at(5, 7_000) }, Occupant { id: 2, ..at(5, 7_000) });
        assert!(must_pause(&pool, y, [x], Yielding::First) != must_pause(&pool, x, [y], Yielding::First));
    }

    #[test]
    fn on_slots_that_are_all_the_engine_keeps_every_session_past_them_pauses_not_only_the_youngest() {
        // Four sessions on two slots: the two oldest keep theirs, both
        // younger ones pause (with only the youngest paused, the third
        // would evict one of the first two every turn).
        let slots = Room { capacity: Some(16_384), taken: 0, slot_tokens: Some(8_192) };
        let all = [at(1_000, 2_000), at(2_000, 2_000), at(3_000, 2_000), at(4_000, 2_000)];
        let pauses_at = |yielding| {
            (0..4)
                .map(|i: usize| {
                    let others = all.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, o)| *o);
                    must_pause(&slots, all[i], others, yielding)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(pauses_at(Yielding::Past), [false, false, true, true]);
        // Where the engine keeps more than its slots, the youngest alone.
        assert_eq!(pauses_at(Yielding::First), [false, false, false, true]);
        // An older session grown past what it and the oldest fit pauses
        // too; the oldest, first kept, never does.
        let pool = room(12_000, 0);
        assert!(must_pause(&pool, at(2_000, 9_000), [at(1_000, 4_000), at(3_000, 1_000)], Yielding::Past));
        assert!(!must_pause(&pool, at(2_000, 9_000), [at(1_000, 4_000), at(3_000, 1_000)], Yielding::First));
        assert!(!must_pause(&pool, at(1_000, 13_000), [at(2_000, 4_000)], Yielding::Past));
    }

    #[test]
    fn of_sessions_that_arrived_together_the_one_behind_gives_way() {
        let pool = room(12_000, 0);
        let o = |id, arrived_ms, continued_ms| Occupant {
            arrived_ms,
            continued_ms,
            id,
            tokens: 7_000,
            class: Class::Default,
            client_sessions: 1,
        };
        // The same millisecond, the engine served `ahead` first: it
        // continued first, so `behind` (the smaller id, even) yields.
        let (ahead, behind) = (o(2, 10_000, 10_400), o(1, 10_000, 10_800));
        assert!(
            must_pause(&pool, behind, [ahead], Yielding::First) && !must_pause(&pool, ahead, [behind], Yielding::First)
        );
        // Not continued yet: younger than any that has.
        let (ahead, behind) = (o(1, 10_000, 10_400), o(2, 10_000, u64::MAX));
        assert!(
            must_pause(&pool, behind, [ahead], Yielding::First) && !must_pause(&pool, ahead, [behind], Yielding::First)
        );
        // Another second: arrival decides, however late the older continued.
        let (older, younger) = (o(1, 10_000, 19_000), o(2, 11_000, 11_400));
        assert!(
            must_pause(&pool, younger, [older], Yielding::First)
                && !must_pause(&pool, older, [younger], Yielding::First)
        );
    }

    #[test]
    fn the_lowest_class_gives_way_first_then_the_client_with_most_sessions() {
        let pool = room(12_000, 0);
        let o = |arrived_ms, class, client_sessions| Occupant {
            arrived_ms,
            continued_ms: arrived_ms,
            id: u128::from(arrived_ms),
            tokens: 7_000,
            class,
            client_sessions,
        };
        // An older background session pauses before a younger interactive one.
        let (bg, int) = (o(1, Class::Background, 1), o(2, Class::Interactive, 1));
        assert!(must_pause(&pool, bg, [int], Yielding::First) && !must_pause(&pool, int, [bg], Yielding::First));
        // Same class: the client with three sessions here yields before the
        // one with one, even though that one is younger.
        let (many, one) = (o(1, Class::Default, 3), o(2, Class::Default, 1));
        assert!(must_pause(&pool, many, [one], Yielding::First) && !must_pause(&pool, one, [many], Yielding::First));
    }

    #[test]
    fn a_waiting_higher_class_takes_the_room_of_lower_ones_between_turns_only() {
        let (bg, def, int) = (Class::Background, Class::Default, Class::Interactive);
        // Two replicas of 12,000, each with two 5,000-token sessions; an
        // interactive session of 7,000 waits.
        let full = room(12_000, 10_000);
        let o = |id: u128, class, arrived_ms, running| {
            (Occupant { arrived_ms, continued_ms: arrived_ms, id, tokens: 5_000, class, client_sessions: 1 }, running)
        };
        let a = vec![o(1, bg, 10, false), o(2, bg, 20, false)];
        let b = vec![o(3, bg, 10, true), o(4, def, 20, false)];
        // On a, the youngest background session frees enough.
        assert_eq!(preemptible(&[(full, a.clone()), (full, b.clone())], int, 7_000), Some((0, vec![2])));
        // On b the background session is mid-turn: never taken. The default
        // one gives way to an interactive session, not to a default one.
        assert_eq!(preemptible(&[(full, b.clone())], int, 7_000), Some((0, vec![4])));
        assert_eq!(preemptible(&[(full, b.clone())], def, 7_000), None);
        assert_eq!(preemptible(&[(full, b)], int, 8_000), None, "not enough without the one mid-turn");
        assert_eq!(preemptible(&[(full, a.clone())], bg, 7_000), None, "background preempts no one");
        // Room enough already: nothing is taken.
        assert_eq!(preemptible(&[(room(12_000, 0), a)], int, 7_000), None);
    }

    #[test]
    fn on_slots_a_session_takes_whole_slots() {
        // llama.cpp with one slot of 8,192 tokens: one conversation each.
        let one_slot = |taken| Room { capacity: Some(8_192), taken, slot_tokens: Some(8_192) };
        assert_eq!(one_slot(0).footprint(1_500), 8_192);
        assert_eq!(entry(&[one_slot(8_192), one_slot(8_192)], 1_500, 1_000), Entry::Hold);
        assert_eq!(entry(&[one_slot(8_192), one_slot(0)], 1_500, 1_000), Entry::Admit);
        let four = Room { capacity: Some(4 * 4_096), taken: 0, slot_tokens: Some(4_096) };
        assert_eq!(four.footprint(5_000), 8_192, "two slots");
    }
}
