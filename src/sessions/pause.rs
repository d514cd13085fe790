//! Pauses at the KV wall: the next turn of a resident session waits, at a
//! turn boundary, while the sessions on its replica are over its pool and
//! it is the one to give way (`room::must_pause`: the lowest class, the
//! client with most sessions, the youngest). A turn that started is never
//! cut; a pause is bounded by `max_wait_ms`, and, unless a turn let
//! through would evict a resident's whole prompt (slots that are all the
//! engine keeps), by what re-prefilling the turn would cost
//! (`Sessions::pause_bound`).

use std::time::Duration;

use super::room::{self, Room};
use super::{Counting, Footprint, Sessions};
use crate::fleet::residents::Resident;
use crate::fleet::Replica;
use crate::policy::PrefixKey;
use crate::priority::Class;

/// A paused turn (`Residents::paused_turn`), counted in `Sessions::paused`
/// while it waits.
struct PausedTurn<'a> {
    _resident: crate::fleet::residents::PausedTurn<'a>,
    sessions: &'a Sessions,
}

impl<'a> PausedTurn<'a> {
    fn start(sessions: &'a Sessions, replica: &'a Replica, session: PrefixKey) -> PausedTurn<'a> {
        let resident = replica.residents.paused_turn(session);
        sessions.paused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        PausedTurn { _resident: resident, sessions }
    }
}

impl Drop for PausedTurn<'_> {
    fn drop(&mut self) {
        self.sessions.paused.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Sessions {
    /// True when the next turn of resident `session` on `replica`, at
    /// `tokens` of context, must pause (`room::must_pause`, the others at
    /// their next turns' contexts: `Resident::next_turn_tokens`), or waits for
    /// room again after a higher class took its room (`preempt_for`).
    /// (Off with `sessions.pause = false`, or with the hold off.)
    /// `now_ms`: when this turn came (its session's second turn, if it has
    /// not continued yet, began then).
    pub fn must_pause(&self, replica: &Replica, session: PrefixKey, tokens: u64, now_ms: u64) -> bool {
        if self.settings.max_wait_ms == 0 {
            return false;
        }
        let Some(capacity) = self.pause_pool(replica) else { return false };
        let shape = Room { capacity: Some(capacity), taken: 0, slot_tokens: replica.slot_tokens() };
        let on = replica.residents.snapshot();
        let Some(me) = on.iter().find(|(id, _)| *id == session).map(|(_, r)| *r) else { return false };
        if me.preempted {
            // The session that took its room may be placed here and not
            // resident yet (its reservation is in the room), admitted and
            // not placed, or still held (it took the room at this turn's
            // boundary a moment ago, and looks again when told): each counts
            // here until it is resident, or this turn would slip in first
            // and both would run over the pool.
            let unplaced = Footprint::all_at(&self.unplaced(), Counting::Whole);
            let held_above = self.next_held().filter(|(class, _)| *class > me.class).map(|(_, tokens)| tokens);
            let placed_here = !self.placed_on(replica).is_empty();
            if unplaced.is_empty() && held_above.is_none() && !placed_here {
                // The room went where it was given (that session is
                // resident now, or went elsewhere): from here this session
                // counts again, and its turn waits as any resident's over
                // the pool (the lowest class gives way), so a new session
                // does not take the room back before it.
                replica.residents.unpreempt(session);
                return self.must_pause(replica, session, tokens, now_ms);
            }
            let mut room = self.room_of(replica);
            room.taken += unplaced.iter().chain(&held_above).map(|t| room.footprint(*t)).sum::<u64>();
            return !room.fits(tokens);
        }
        if !self.settings.pause {
            return false;
        }
        // Each class's sessions per client, counted in one pass (a count
        // per resident, rescanning them all, was O(n²) per turn).
        let mut per_client = std::collections::HashMap::<(Class, u64), usize>::with_capacity(on.len());
        for (_, r) in on.iter() {
            *per_client.entry((r.class, r.client)).or_default() += 1;
        }
        let client_sessions = |class: Class, client: u64| per_client.get(&(class, client)).copied().unwrap_or(0);
        let occupant = |id: PrefixKey, r: &Resident, tokens: u64, continued_ms: u64| room::Occupant {
            arrived_ms: r.arrived_ms,
            continued_ms,
            id,
            tokens,
            class: r.class,
            client_sessions: client_sessions(r.class, r.client),
        };
        // The others at their next turn: an older one's next turn goes
        // whatever comes, so a younger one that arrives first in a round
        // must not take the room that turn will need (both would run over
        // the pool, and the engine would thrash them both).
        let continued = |r: &Resident, or: u64| if r.continued_ms == 0 { or } else { r.continued_ms };
        let others = on
            .iter()
            .filter(|(s, _)| *s != session)
            .map(|(s, r)| occupant(*s, r, r.next_turn_tokens(), continued(r, u64::MAX)));
        // Every session past the slots gives way where a turn let through
        // evicts a whole prompt; elsewhere the first alone (`room::Yielding`).
        // The evidence is read as of now: `now_ms` is when this turn came.
        let yielding = if let_through_evicts_a_prompt(replica, crate::clock::now_ms()) {
            room::Yielding::Past
        } else {
            room::Yielding::First
        };
        let me = occupant(session, &me, tokens.max(me.tokens), continued(&me, now_ms));
        room::must_pause(&shape, me, others, yielding)
    }

    /// Pauses the next turn of resident `session` on `replica` (`tokens` of
    /// context with this turn) while the residents there are over its pool
    /// and it is the youngest (`room::must_pause`), at most `max_wait_ms`;
    /// returns how long it paused, if it did (`gate::Pass::arrive` decides,
    /// then `pause` waits).
    #[cfg(test)]
    pub async fn pause_if_over(&self, replica: &Replica, session: PrefixKey, tokens: u64) -> Option<Duration> {
        let came = crate::clock::now_ms();
        match self.must_pause(replica, session, tokens, came) {
            true => Some(self.pause(replica, session, tokens, came).await),
            false => None,
        }
    }

    /// Waits while the next turn of resident `session` on `replica` must
    /// pause (it did when it came, at `came_ms`: its place in the order is
    /// fixed), at most `max_wait_ms`; returns how long it waited. The turn
    /// has not started: a turn that started is never cut. While paused the
    /// session counts as busy (it cannot idle out: the room that opens is
    /// for it).
    pub async fn pause(&self, replica: &Replica, session: PrefixKey, tokens: u64, came_ms: u64) -> Duration {
        let _busy = PausedTurn::start(self, replica, session);
        let started = tokio::time::Instant::now();
        let deadline = started + self.pause_bound(replica, session, tokens);
        // The bound is read again while the turn waits (it can end the wait
        // sooner, never later than the bound at the start): the turns
        // running meanwhile can show the engine keeps more than its slots,
        // or give its first measured prefill rate.
        let bound_passed = || started.elapsed() >= self.pause_bound(replica, session, tokens);
        self.wait_for(deadline, || bound_passed() || !self.must_pause(replica, session, tokens, came_ms)).await;
        started.elapsed()
    }

    /// How long a turn of `tokens` may pause on `replica`: `max_wait_ms`,
    /// and, unless a turn let through would evict a resident's whole prompt
    /// (`let_through_evicts_a_prompt`), never longer than re-prefilling the
    /// whole turn would take at the replica's measured prefill rate.
    ///
    /// Why the two. A pool (vLLM, SGLang) evicts blocks least recently used
    /// first: a turn let through takes about what it runs over by, so
    /// waiting longer than its own cold turn costs the agent more than it
    /// saves. So does a slot engine that keeps prompts in host memory
    /// (llama-server's `--cache-ram`): its walls are misses of the engine's
    /// own choosing (it keeps its slot's prompt when the next shares half
    /// of it, instead of restoring the returning one), and unbounded such
    /// pauses lasted a minute for turns of a few hundred tokens. But where a
    /// slot is all the engine keeps, a turn let through into a resident's
    /// slot evicts that session's whole prompt, and its next turn evicts
    /// this one's, each turn after: the pause is for the resident's sake,
    /// and lasts until room opens. Bounded by its own re-prefill there, the
    /// second set at llama-server's wall took 1.10x the cold set's time;
    /// waiting for room, 0.54x (docs/benchmarks-log.md, real agent traffic). On the
    /// simulated pool, waiting for room made the cold set 0.87x of the hold
    /// off instead of 0.77x.
    /// A turn that gave its room to a higher class waits the whole
    /// `max_wait_ms`: that wait is for the other session's sake.
    pub fn pause_bound(&self, replica: &Replica, session: PrefixKey, tokens: u64) -> Duration {
        let max = Duration::from_millis(self.settings.max_wait_ms);
        if replica.residents.get(session).is_some_and(|r| r.preempted)
            || let_through_evicts_a_prompt(replica, crate::clock::now_ms())
        {
            return max;
        }
        match replica.residents.pace().prefill_tps {
            Some(tps) => max.min(Duration::try_from_secs_f64(tokens as f64 / tps).unwrap_or(max)),
            None => max,
        }
    }

    /// Turns of resident sessions paused now.
    pub fn paused(&self) -> usize {
        self.paused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns paused now on `replica`, by class (interactive, default,
    /// background: `Class::ALL`'s order).
    pub fn paused_by_class(replica: &Replica) -> [usize; 3] {
        replica.residents.paused_by_class()
    }
}

/// Whether a turn let through on `replica` would evict a resident
/// session's whole prompt: it is a slot engine (each slot holds one
/// prompt) not seen keeping more than its slots. Seen keeping more:
/// within `WALL_MEMORY_MS` of `now_ms`, a session found its prefix after
/// the turns of as many other sessions as it has slots (more prompts than
/// slots ran across its gap: a host tier, llama-server's `--cache-ram`).
/// It decides both how long a pause lasts (`pause_bound`) and who pauses
/// (`room::Yielding` in `must_pause`): one reading of the evidence, so the
/// two never disagree about the engine.
fn let_through_evicts_a_prompt(replica: &Replica, now_ms: u64) -> bool {
    let Some(slot) = replica.slot_tokens() else { return false };
    let slots = replica.kv_capacity().map_or(1, |kv| (kv / slot).max(1));
    replica.residents.evidence.kept_beside(now_ms).sessions <= slots
}

#[cfg(test)]
mod tests {
    use super::super::tests::{heard, instance, pool_of, replica, settings};
    use super::super::*;
    use crate::priority::Class;

    /// Two agents (1, the older, and 2) at 3,500 tokens, then 5,000: their
    /// next turns (6,500 each) cross the 12,000-token pool together. The
    /// older's second turn runs while its guard is held.
    fn two_crossing_the_pool(s: &Arc<Sessions>, a: &Arc<Replica>) -> SessionTurn {
        let now = crate::clock::now_ms();
        drop(s.begin_turn(a, 1, None, 3_500, &Who::default(), now));
        drop(s.begin_turn(a, 2, None, 3_500, &Who::default(), now + 1));
        let older = s.begin_turn(a, 1, None, 5_000, &Who::default(), now + 10);
        drop(s.begin_turn(a, 2, None, 5_000, &Who::default(), now + 11));
        older
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_lasts_no_longer_than_re_prefilling_the_turn_would() {
        let (s, a) = instance(); // a pool
        let _older = two_crossing_the_pool(&s, &a);
        assert!(s.must_pause(&a, 2, 6_500, u64::MAX));
        let max = std::time::Duration::from_millis(s.settings().max_wait_ms);
        assert_eq!(s.pause_bound(&a, 2, 6_500), max, "no rate measured: max_wait_ms");
        // The engine prefills 2,000 tokens a second: the turn re-prefilled
        // cold would take 3.25 s, so it waits no longer than that.
        a.residents.observe_prefill(2_000, std::time::Duration::from_secs(1));
        let bound = std::time::Duration::from_millis(3_250);
        assert!(bound < max);
        assert_eq!(s.pause_bound(&a, 2, 6_500), bound);
        let waited = s.pause(&a, 2, 6_500, u64::MAX).await;
        assert!(waited >= bound && waited < bound + std::time::Duration::from_millis(100), "{waited:?}");
        // A turn that gave its room to a higher class waits for it whole.
        a.residents.preempt(&[2], Class::Interactive, |_, _| true);
        assert_eq!(s.pause_bound(&a, 2, 6_500), max);
    }

    #[test]
    fn on_slots_that_are_all_the_engine_keeps_a_pause_waits_for_room_however_cheap_its_re_prefill() {
        let s = Sessions::new(settings());
        let a = replica("a");
        a.set_observed_kv(Some(16_384));
        a.set_slot_tokens(Some(8_192)); // two slots
        a.residents.observe_prefill(2_000, std::time::Duration::from_secs(1));
        let max = std::time::Duration::from_millis(s.settings().max_wait_ms);
        let now = crate::clock::now_ms();
        assert_eq!(s.pause_bound(&a, 2, 6_500), max, "nothing seen kept beyond the slots");
        // Four sessions resident, two of them idle (waiting on tools, or
        // paused): 1 and 2 take turns in the two slots and find their
        // prefixes after each other's. That is what the slots keep, however
        // many are resident: a turn let through would evict one whole.
        for (id, at) in [(3, now), (4, now + 1), (1, now + 2), (2, now + 3), (1, now + 4)] {
            drop(s.begin_turn(&a, id, None, 2_000, &Who::default(), at));
        }
        assert_eq!(a.residents.others_between(1), 1);
        let _ = a.residents.receipt(1_500, 1_500, a.residents.others_between(1), now + 5);
        assert_eq!(s.pause_bound(&a, 2, 6_500), max);
        // 2 and 3 take turns, then 1 again, and finds its prefix after
        // both: three prompts across two slots, so the engine kept one in
        // host memory. A turn let through evicts nothing for good: it
        // waits no longer than its cold turn (3.25 s at 2,000 tokens a
        // second).
        drop(s.begin_turn(&a, 2, None, 2_000, &Who::default(), now + 6));
        drop(s.begin_turn(&a, 3, None, 2_000, &Who::default(), now + 7));
        drop(s.begin_turn(&a, 1, None, 2_000, &Who::default(), now + 8));
        assert_eq!(a.residents.others_between(1), 2);
        let _ = a.residents.receipt(1_500, 1_500, a.residents.others_between(1), now + 8);
        assert_eq!(s.pause_bound(&a, 2, 6_500), std::time::Duration::from_millis(3_250));
        // Evidence that old says nothing now.
        let later = now + 8 + crate::fleet::wall::WALL_MEMORY_MS + 1;
        assert!(!super::let_through_evicts_a_prompt(&a, now + 8));
        assert!(super::let_through_evicts_a_prompt(&a, later));
    }

    #[test]
    fn on_slots_that_are_all_the_engine_keeps_every_session_past_them_pauses_and_with_a_host_tier_the_youngest_alone() {
        let s = Sessions::new(settings()); // the wall declared: two slots
        let a = replica("a");
        a.set_observed_kv(Some(16_384));
        a.set_slot_tokens(Some(8_192));
        let now = crate::clock::now_ms();
        // Four sessions a second apart, each shorter than a slot.
        for id in 1..=4 {
            drop(s.begin_turn(&a, id, None, 2_000, &Who::default(), now + id as u64 * 1_000));
        }
        let pauses = || (1..=4).map(|id| s.must_pause(&a, id, 2_000, u64::MAX)).collect::<Vec<_>>();
        assert_eq!(pauses(), [false, false, true, true], "nothing seen kept beyond the slots: both past them pause");
        // The oldest finds its prefix after three other sessions' turns:
        // the engine keeps more prompts than its two slots.
        drop(s.begin_turn(&a, 1, None, 2_100, &Who::default(), now + 5_000));
        assert_eq!(a.residents.others_between(1), 3);
        let _ = a.residents.receipt(1_500, 1_500, 3, crate::clock::now_ms());
        assert_eq!(pauses(), [false, false, false, true], "a host tier: the youngest alone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_ends_at_its_re_prefill_once_the_engine_is_seen_keeping_more_than_its_slots() {
        let s = Sessions::new(settings()); // max_wait_ms 10 s
        let a = replica("a");
        a.set_observed_kv(Some(4_000));
        a.set_slot_tokens(Some(4_000)); // one slot, its capacity declared
        a.residents.observe_prefill(2_000, std::time::Duration::from_secs(1));
        let now = crate::clock::now_ms() - 100;
        drop(s.begin_turn(&a, 1, None, 2_000, &Who::default(), now));
        drop(s.begin_turn(&a, 2, None, 2_000, &Who::default(), now + 1));
        drop(s.begin_turn(&a, 1, None, 2_000, &Who::default(), now + 2)); // 1 continued first
        assert!(s.must_pause(&a, 2, 2_500, u64::MAX));
        let paused = tokio::spawn({
            let (s, a) = (s.clone(), a.clone());
            async move { s.pause_if_over(&a, 2, 2_500).await }
        });
        // Nothing says the slot is not all it keeps: past the turn's
        // re-prefill (1.25 s), it still waits for room.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(s.paused(), 1);
        // A turn running meanwhile finds its prefix after the other's, two
        // sessions on one slot: a host tier. The pause is past its bound,
        // and ends at the next look, with no room made.
        let _ = a.residents.receipt(1_500, 1_500, 1, crate::clock::now_ms());
        let waited = paused.await.unwrap().expect("it paused");
        assert!(waited >= Duration::from_secs(3) && waited <= Duration::from_secs(3) + RECHECK, "{waited:?}");
        assert!(s.must_pause(&a, 2, 2_500, u64::MAX), "ended by its bound, not by room");
    }

    #[test]
    fn the_youngest_pauses_in_the_round_that_crosses_the_pool_whichever_turn_comes_first() {
        let (s, a) = instance();
        let older = two_crossing_the_pool(&s, &a);
        // The younger's next turn comes first: it pauses now, not a round
        // late (6,500 + 5,000 fit, but the older's next turn goes whatever
        // comes, and both would then run over the pool and thrash).
        assert!(s.must_pause(&a, 2, 6_500, u64::MAX));
        // The same with the older's turn ended, its next still to come.
        drop(older);
        assert!(s.must_pause(&a, 2, 6_500, u64::MAX));
        assert!(!s.must_pause(&a, 1, 6_500, u64::MAX), "the older one never pauses");
        assert!(!s.must_pause(&a, 2, 5_400, u64::MAX), "a turn that fits beside the older's next goes");
    }

    #[test]
    fn an_older_session_whose_turns_add_unevenly_counts_at_the_most_its_recent_turns_added() {
        let (s, a) = pool_of(3_072);
        let now = crate::clock::now_ms();
        // Real vLLM's shape: turns estimated to add 380, then 195 tokens.
        for (t, tokens) in [1_200, 1_580, 1_775].into_iter().enumerate() {
            drop(s.begin_turn(&a, 1, None, tokens, &Who::default(), now + t as u64 * 10));
        }
        drop(s.begin_turn(&a, 2, None, 900, &Who::default(), now + 5));
        // The older's next turn may add 380 again (2,155): 900 + 100 beside
        // it crosses 3,072; with only its latest growth (1,970) it would fit.
        assert!(s.must_pause(&a, 2, 1_000, u64::MAX));
        assert!(!s.must_pause(&a, 2, 900, u64::MAX), "what fits beside the older's largest recent turn goes");
        // Three turns later a one-off large turn is forgotten.
        for (t, tokens) in [1_800, 1_820, 1_840].into_iter().enumerate() {
            drop(s.begin_turn(&a, 1, None, tokens, &Who::default(), now + 100 + t as u64 * 10));
        }
        assert_eq!(a.residents.get(1).unwrap().growth(), 25);
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_turn_resumes_when_room_opens_or_at_max_wait_ms() {
        let s = Sessions::new(settings()); // max_wait_ms 10 s
        let a = replica("a");
        a.set_observed_kv(Some(12_000));
        // In the past: 2's turn comes after 1 continued.
        let now = crate::clock::now_ms() - 100;
        drop(s.begin_turn(&a, 1, None, 5_000, &Who::default(), now));
        drop(s.begin_turn(&a, 2, None, 5_000, &Who::default(), now + 1));
        drop(s.begin_turn(&a, 1, None, 5_000, &Who::default(), now + 2)); // 1 continued first
        assert!(!s.must_pause(&a, 1, 7_000, u64::MAX), "the older one never pauses");
        assert!(!s.must_pause(&a, 2, 7_000, u64::MAX), "within the pool");
        assert!(s.must_pause(&a, 2, 8_000, u64::MAX), "the youngest, over the pool");
        // Room opens when the older one idles out: the pause ends then.
        let paused = tokio::spawn({
            let (s, a) = (s.clone(), a.clone());
            async move { s.pause_if_over(&a, 2, 8_000).await }
        });
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(s.paused(), 1);
        // The views say where: a default-class turn on a, its session paused.
        assert_eq!(Sessions::paused_by_class(&a), [0, 1, 0]);
        let state_of = |id: u128| {
            let view = s.view(crate::clock::now_ms(), 100);
            view.iter().find(|v| v.session == Some(format!("{id:032x}"))).map(|v| v.state)
        };
        assert_eq!(state_of(2), Some(SessionState::Paused));
        assert_eq!(state_of(1), Some(SessionState::Idle));
        assert!(s.sweep(crate::clock::now_ms() + 60_000).any);
        assert!(s.is_resident(2) && !s.is_resident(1), "the older idled out; the paused one, busy, did not");
        assert_eq!(paused.await.unwrap(), Some(Duration::from_millis(1_500)));
        assert_eq!(s.paused(), 0);
        assert_eq!(Sessions::paused_by_class(&a), [0; 3]);
        assert_eq!(state_of(2), Some(SessionState::Idle));
        // No room ever: it goes after max_wait_ms.
        let now = crate::clock::now_ms() - 100;
        drop(s.begin_turn(&a, 3, None, 5_000, &Who::default(), now));
        drop(s.begin_turn(&a, 4, None, 5_000, &Who::default(), now + 10));
        for older in [2, 3] {
            drop(s.begin_turn(&a, older, None, 5_000, &Who::default(), now + 20));
            // continued before 4
        }
        assert!(s.must_pause(&a, 4, 8_000, u64::MAX));
        let started = tokio::time::Instant::now();
        assert_eq!(s.pause_if_over(&a, 4, 8_000).await, Some(Duration::from_millis(10_000)));
        assert_eq!(started.elapsed(), Duration::from_millis(10_000));
    }

    #[test]
    fn a_preempted_turn_waits_while_the_session_that_took_its_room_is_placed_here_but_not_resident() {
        let (s, a) = instance(); // a 12,000-token pool
        let background = Who { class: Class::Background, ..Who::default() };
        drop(s.begin_turn(&a, 1, None, 8_000, &background, crate::clock::now_ms()));
        assert_eq!(s.preempt_for(std::slice::from_ref(&a), Class::Interactive, 8_000, None).len(), 1);
        // The interactive session was admitted and placed here; its first
        // turn has not begun. The preempted session is the only resident.
        let reservation = s.reserve_unheld(Footprint::same(8_000));
        reservation.place(&a.id);
        assert!(s.must_pause(&a, 1, 8_200, u64::MAX), "not alone: the room is the placed session's");
        // Once the other is resident and gone, it goes.
        drop(reservation);
        assert!(!s.must_pause(&a, 1, 8_200, u64::MAX), "alone, it goes");
    }

    #[test]
    fn instances_that_learned_of_two_sessions_in_another_order_agree_which_is_youngest() {
        // Session 1 began at 100 (its first pin's creation), session 2 at
        // 1,101 (another second: arrival decides). Instance x served 1's
        // first turn and heard of 2 late; instance y the other way round:
        // both take each session's first turn as its arrival, not the
        // moment they heard of it.
        let ((x, ax), (y, ay)) = (instance(), instance());
        drop(x.begin_turn(&ax, 1, None, 5_000, &Who::default(), 100));
        x.seen_elsewhere(&ax, 2, heard(5_000, 5_000, 1_101, 0));
        y.seen_elsewhere(&ay, 1, heard(5_000, 4_000, 100, 0));
        y.seen_elsewhere(&ay, 2, heard(5_000, 1_200, 1_101, 0));
        for (s, a) in [(&x, &ax), (&y, &ay)] {
            assert!(s.must_pause(a, 2, 8_000, u64::MAX), "2 is the youngest everywhere");
            assert!(!s.must_pause(a, 1, 8_000, u64::MAX));
        }
    }

    #[test]
    fn of_two_sessions_that_arrived_together_the_later_to_continue_yields_on_every_instance() {
        // Both began at 10,000 (a batch), 2 with the smaller id; the engine
        // served 2 first, so 2 continued at 10,400 and 1 at 10,800.
        // Instance x served their turns; y heard of them from their pins.
        let ((x, ax), (y, ay)) = (instance(), instance());
        drop(x.begin_turn(&ax, 1, None, 4_000, &Who::default(), 10_000));
        drop(x.begin_turn(&ax, 2, None, 4_000, &Who::default(), 10_000));
        drop(x.begin_turn(&ax, 2, None, 5_000, &Who::default(), 10_400));
        let seen =
            |tokens, last_ms, continued_ms| Heard { tokens, last_ms, arrived_ms: 10_000, continued_ms, growth_hint: 0 };
        y.seen_elsewhere(&ay, 2, seen(5_000, 10_400, 10_400));
        // 1's second turn comes now: x decides with it, y has it from its pin.
        assert!(x.must_pause(&ax, 1, 7_500, 10_800), "1 continued later: it yields");
        drop(x.begin_turn(&ax, 1, None, 5_000, &Who::default(), 10_800));
        y.seen_elsewhere(&ay, 1, seen(5_000, 10_800, 10_800));
        for (s, a) in [(&x, &ax), (&y, &ay)] {
            assert!(s.must_pause(a, 1, 7_500, 20_000), "1 is the youngest everywhere");
            assert!(!s.must_pause(a, 2, 7_500, 20_000));
        }
    }

    #[test]
    fn a_session_first_heard_of_from_its_pins_counts_at_what_its_turns_added() {
        let (s, a) = pool_of(3_072);
        let now = crate::clock::now_ms();
        // The older: three turns elsewhere, 1,072 tokens growing ~200 a turn.
        s.seen_elsewhere(&a, 1, heard(1_469, now, now - 2_000, 198));
        drop(s.begin_turn(&a, 2, None, 1_300, &Who::default(), now - 1_000));
        // The younger's 1,450 beside the older's next (~1,667) crosses 3,072.
        assert!(s.must_pause(&a, 2, 1_450, u64::MAX));
        // Turns seen here say what they added; the hint counts as one of
        // its recent turns until they push it out.
        s.seen_elsewhere(&a, 1, heard(1_500, now + 10, now - 2_000, 198));
        assert_eq!(a.residents.get(1).unwrap().growth(), 198);
        s.seen_elsewhere(&a, 1, heard(1_531, now + 20, now - 2_000, 198));
        s.seen_elsewhere(&a, 1, heard(1_562, now + 30, now - 2_000, 198));
        assert_eq!(a.residents.get(1).unwrap().growth(), 31);
        assert!(!s.must_pause(&a, 2, 1_450, u64::MAX));
    }
}
