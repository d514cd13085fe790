//! Where one replica's cache ends, as its receipts showed it: the wall (the
//! load at which a returning session lost its prefix, or the engine
//! preempted, or said its pool was full), the most it was seen to keep,
//! and whether it keeps sessions beside each other's turns beyond its
//! slots (a host tier). Bookkeeping only: the caller reads the load
//! resident (`Residents::load`, raw tokens) and passes
//! it in, so every rule here is tested with plain numbers.

mod shared;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use shared::SharedWall;

use crate::capacity::Learned;

/// A wall no loss confirmed for this long is forgotten. Why: with a wall,
/// the replica takes no new session above it, so no receipt ever comes from
/// above it to raise it; a wall lowered by a passing cause (a thrash the
/// hold since ended, an engine that restarted and lost every prefix at a
/// small load) would cap the replica for the life of the process. A wall
/// that is real is found again by the next loss: one turn's prefill every
/// ten minutes at most.
pub const WALL_MEMORY_MS: u64 = 10 * 60_000;

/// A receipt below this many predicted cached tokens says nothing.
pub const MIN_RECEIPT_TOKENS: u64 = 256;

/// What is resident on the replica as a receipt is read: the sessions'
/// footprints, and how many sessions hold them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub tokens: u64,
    pub sessions: u64,
}

/// When a session found its prefix after other sessions' turns here,
/// within `WALL_MEMORY_MS` (`WallEvidence::kept_beside`; zeros: none): the
/// most resident (tokens), and the most sessions whose turns ran here
/// across its gap, itself included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptBeside {
    pub tokens: u64,
    pub sessions: u64,
}

/// What a pinned turn's receipt says about its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// The turn found less than half the prefix it should have: the
    /// replica did not keep the session (at `load` tokens resident).
    Lost { load: u64 },
    /// The turn found its prefix: the replica holds `load` tokens resident.
    Kept { load: u64 },
    /// The turn found its prefix after other sessions' turns ran here, at
    /// `load` tokens resident, above the wall (`wall`): the replica keeps
    /// more than one session above it, so the wall was not its capacity
    /// (a miss of the engine's own choosing: llama-server keeps its slot's
    /// prompt, instead of restoring the returning one from host memory,
    /// when the two share half of the slot's). Forgotten; a real one is
    /// found again by the next loss.
    Unwalled { wall: u64, load: u64 },
    /// The turn found less than half its prefix at `load` tokens resident,
    /// but within `WALL_MEMORY_MS` a session found its prefix after others'
    /// turns with as much resident, or 10 % less (`kept_beside`): a miss,
    /// not the replica's wall.
    Missed { load: u64, kept_beside: u64 },
    /// Too small to say, or in between.
    Unclear,
}

/// One replica's evidence of where its cache ends.
#[derive(Debug, Default)]
pub struct WallEvidence {
    /// The load at which this replica was seen to lose a resident
    /// session's prefix: its wall in practice, whatever its capacity says
    /// (0: none seen). Receipts set and raise it.
    wall: AtomicU64,
    /// How many sessions the replica held at its wall (0: none seen): at a
    /// loss, one fewer than were resident (at least one); raised by a kept
    /// receipt above the wall. On slots the room counts whole slots, and
    /// the wall is this many slots (`Learned::wall`).
    wall_sessions: AtomicU64,
    /// The engine's preemption counter as last read, plus one (0: never read).
    preemptions_seen: AtomicU64,
    /// When a loss last said the wall is there (lowered it, or found it at
    /// or above it), ms: a wall not confirmed for `WALL_MEMORY_MS` is
    /// forgotten (`forget_stale_wall`).
    wall_confirmed_ms: AtomicU64,
    /// When a kept receipt above the wall last raised it or showed it was
    /// not the replica's, ms (0: never): another instance's losses no newer
    /// than that do not lower it again (`merge`).
    raised_ms: AtomicU64,
    /// The wall was set or lowered since the projections last learned from
    /// the sessions resident here (`take_wall_lesson`).
    wall_lesson: AtomicBool,
    /// Receipts read here: kept (a returning session found its prefix),
    /// lost (found less than half of it), and the highest load a kept
    /// one was read at, and the most sessions one was kept across (itself
    /// and the sessions whose turns ran here in its gap; slots count
    /// sessions): the evidence of what the replica keeps (`learned`).
    kept: AtomicU64,
    lost: AtomicU64,
    kept_high: AtomicU64,
    kept_sessions_high: AtomicU64,
    /// The most resident when a returning session found its prefix after
    /// other sessions' turns, and when (ms): a loss at about that load is
    /// not the replica's wall (`Receipt::Missed`).
    kept_beside_high: AtomicU64,
    kept_beside_ms: AtomicU64,
    /// The most sessions whose turns ran here across such a receipt's gap,
    /// its own included: more than the replica has slots says it keeps
    /// prompts beyond them (`KeptBeside`).
    kept_beside_sessions: AtomicU64,
}

impl WallEvidence {
    /// The wall receipts found (None: none seen).
    pub fn wall(&self) -> Option<u64> {
        Some(self.wall.load(Ordering::Relaxed)).filter(|w| *w > 0)
    }

    /// What the receipts taught of this replica (the capacity view).
    pub fn learned(&self) -> Learned {
        let wall_tokens = self.wall();
        Learned {
            wall_tokens,
            wall_sessions: wall_tokens.and(Some(self.wall_sessions.load(Ordering::Relaxed)).filter(|s| *s > 0)),
            kept_at_tokens: self.kept_high.load(Ordering::Relaxed),
            kept_sessions: self.kept_sessions_high.load(Ordering::Relaxed),
            receipts_kept: self.kept.load(Ordering::Relaxed),
            receipts_lost: self.lost.load(Ordering::Relaxed),
        }
    }

    /// Reads the engine's preemption counter (`total`, as vLLM reports it).
    /// Preemptions since the last read mean the engine ran out of KV with
    /// `load` resident: the wall is lowered to it, as a lost receipt does.
    /// Returns that load when it was; the first read only notes the
    /// counter, and a counter that went back (an engine restarted) starts
    /// over.
    pub fn engine_preemptions(&self, total: u64, load: Load, now_ms: u64) -> Option<u64> {
        let before = self.preemptions_seen.swap(total.saturating_add(1), Ordering::Relaxed);
        if before == 0 || total < before {
            return None;
        }
        self.over_wall(load, now_ms)
    }

    /// The engine says its pool is full with `load` resident
    /// (`vllm:kv_cache_usage_perc` near 1 with requests waiting): the wall
    /// is lowered to it. Returns that load when the wall moved (a full
    /// pool read again at the same load says nothing new).
    pub fn engine_full(&self, load: Load, now_ms: u64) -> Option<u64> {
        (load.tokens > 0 && self.lower_wall(load, now_ms)).then_some(load.tokens)
    }

    /// Lowers the wall to `load`; None when nothing is resident.
    fn over_wall(&self, load: Load, now_ms: u64) -> Option<u64> {
        (load.tokens > 0).then(|| {
            self.lower_wall(load, now_ms);
            load.tokens
        })
    }

    /// Sets the wall at `load` when none was seen or it is lower, and
    /// confirms it now; true when it moved. The sessions held there are
    /// one fewer than were resident: the one that lost its prefix is what
    /// did not fit.
    fn lower_wall(&self, load: Load, now_ms: u64) -> bool {
        self.lower_wall_to(load.tokens, load.sessions.saturating_sub(1).max(1), now_ms)
    }

    /// Sets the wall at `tokens` (`held` sessions) when none was seen or
    /// it is lower; a wall that moved leaves a lesson (the same wall seen
    /// again teaches nothing). Either way the wall is confirmed at `at_ms`.
    /// True when it moved.
    fn lower_wall_to(&self, tokens: u64, held: u64, at_ms: u64) -> bool {
        let lower = |at: u64| {
            move |w: u64| match w {
                0 => Some(at),
                w => (at < w).then_some(at),
            }
        };
        let before = self.wall.fetch_update(Ordering::Relaxed, Ordering::Relaxed, lower(tokens));
        if before.is_ok() {
            self.wall_lesson.store(true, Ordering::Relaxed);
        }
        let _ = self.wall_sessions.fetch_update(Ordering::Relaxed, Ordering::Relaxed, lower(held));
        self.wall_confirmed_ms.fetch_max(at_ms, Ordering::Relaxed);
        before.is_ok()
    }

    /// Forgets a wall no loss confirmed for `WALL_MEMORY_MS`; returns it
    /// when it was forgotten.
    pub fn forget_stale_wall(&self, now_ms: u64) -> Option<u64> {
        let confirmed = self.wall_confirmed_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(confirmed) < WALL_MEMORY_MS {
            return None;
        }
        self.wall_sessions.store(0, Ordering::Relaxed);
        Some(self.wall.swap(0, Ordering::Relaxed)).filter(|w| *w > 0)
    }

    /// Whether a wall was seen here since the last call: the sessions
    /// resident now are what crossed it, and the projections learn from
    /// them before they end (`Sessions::sweep`).
    pub fn take_wall_lesson(&self) -> bool {
        self.wall_lesson.swap(false, Ordering::Relaxed)
    }

    /// The most resident when a session found its prefix after others'
    /// turns, within `WALL_MEMORY_MS` of `now_ms` (zeros: none).
    pub fn kept_beside(&self, now_ms: u64) -> KeptBeside {
        let at = self.kept_beside_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(at) > WALL_MEMORY_MS {
            return KeptBeside::default();
        }
        KeptBeside {
            tokens: self.kept_beside_high.load(Ordering::Relaxed),
            sessions: self.kept_beside_sessions.load(Ordering::Relaxed),
        }
    }

    fn kept_beside_at(&self, tokens: u64, sessions: u64, now_ms: u64) {
        // An old high is forgotten, not kept: what the replica kept then
        // may be gone (a restart, a smaller cache).
        if self.kept_beside(now_ms).tokens == 0 {
            self.kept_beside_high.store(tokens, Ordering::Relaxed);
            self.kept_beside_sessions.store(sessions, Ordering::Relaxed);
        } else {
            self.kept_beside_high.fetch_max(tokens, Ordering::Relaxed);
            self.kept_beside_sessions.fetch_max(sessions, Ordering::Relaxed);
        }
        self.kept_beside_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Reads a pinned turn's receipt with `load` resident: `predicted`
    /// cached tokens (the prefix it should have found on its home) against
    /// the `cached` tokens the engine reported; `others_between`: other
    /// sessions whose turns began here since its previous turn. A lost prefix
    /// lowers the wall to the load it was lost at (the replica takes no new
    /// session above it); a kept one at a higher load raises it. Returns
    /// what it read.
    pub fn receipt(&self, load: Load, predicted: u64, cached: u64, others_between: u32, now_ms: u64) -> Receipt {
        if predicted < MIN_RECEIPT_TOKENS {
            return Receipt::Unclear;
        }
        let (tokens, after_others) = (load.tokens, others_between > 0);
        if cached.saturating_mul(2) < predicted {
            self.lost.fetch_add(1, Ordering::Relaxed);
            let kept_beside = self.kept_beside(now_ms).tokens;
            if kept_beside.saturating_mul(10) >= tokens.saturating_mul(9) {
                return Receipt::Missed { load: tokens, kept_beside };
            }
            self.lower_wall(load, now_ms);
            Receipt::Lost { load: tokens }
        } else if cached.saturating_mul(10) >= predicted.saturating_mul(9) {
            self.kept.fetch_add(1, Ordering::Relaxed);
            self.kept_high.fetch_max(tokens, Ordering::Relaxed);
            // Itself and the sessions whose turns ran here in its gap.
            let kept_across = u64::from(others_between) + 1;
            self.kept_sessions_high.fetch_max(kept_across, Ordering::Relaxed);
            if after_others {
                self.kept_beside_at(tokens, kept_across, now_ms);
            }
            // Above the wall: kept beside others' turns, the wall was not
            // the replica's; kept with nothing run between, it holds at
            // least this load.
            let raised = self.wall.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                (w > 0 && tokens > w).then_some(if after_others { 0 } else { tokens })
            });
            if raised.is_ok() {
                self.raised_ms.fetch_max(now_ms, Ordering::Relaxed);
            }
            match raised {
                Ok(wall) if after_others => {
                    self.wall_sessions.store(0, Ordering::Relaxed);
                    Receipt::Unwalled { wall, load: tokens }
                }
                Ok(_) => {
                    self.wall_sessions.fetch_max(load.sessions, Ordering::Relaxed);
                    Receipt::Kept { load: tokens }
                }
                Err(_) => Receipt::Kept { load: tokens },
            }
        } else {
            Receipt::Unclear
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(tokens: u64) -> Load {
        Load { tokens, sessions: 1 }
    }

    #[test]
    fn a_loss_where_sessions_were_kept_beside_others_is_a_miss_not_a_wall() {
        let w = WallEvidence::default();
        // A prefix kept after others' turns at 3,000 resident.
        assert_eq!(w.receipt(at(3_000), 900, 900, 1, 0), Receipt::Kept { load: 3_000 });
        // A loss at 3,000 (or up to a ninth more) is the engine's miss.
        assert_eq!(w.receipt(at(3_000), 900, 100, 0, 1), Receipt::Missed { load: 3_000, kept_beside: 3_000 });
        assert_eq!(w.receipt(at(3_333), 900, 100, 0, 2), Receipt::Missed { load: 3_333, kept_beside: 3_000 });
        assert_eq!(w.wall(), None);
        // Past that load, a loss is a wall.
        assert_eq!(w.receipt(at(4_333), 900, 100, 0, 3), Receipt::Lost { load: 4_333 });
        assert_eq!(w.wall(), Some(4_333));
        // What was kept long ago says nothing now.
        let w = WallEvidence::default();
        assert_eq!(w.receipt(at(3_000), 900, 900, 1, 0), Receipt::Kept { load: 3_000 });
        assert_eq!(w.receipt(at(3_000), 900, 100, 0, WALL_MEMORY_MS + 1), Receipt::Lost { load: 3_000 });
    }

    #[test]
    fn what_was_kept_beside_others_remembers_the_most_sessions_that_ran_across_its_gap_for_a_while() {
        let w = WallEvidence::default();
        let _ = w.receipt(Load { tokens: 8_000, sessions: 3 }, 900, 900, 2, 0);
        let _ = w.receipt(Load { tokens: 9_000, sessions: 4 }, 900, 900, 1, 1);
        let _ = w.receipt(Load { tokens: 20_000, sessions: 5 }, 900, 900, 0, 2);
        assert_eq!(
            w.kept_beside(3),
            KeptBeside { tokens: 9_000, sessions: 3 },
            "only what was kept after others; the sessions that ran across the gap, not those resident"
        );
        assert_eq!(w.kept_beside(1 + WALL_MEMORY_MS + 1), KeptBeside::default());
        let _ = w.receipt(Load { tokens: 2_000, sessions: 2 }, 900, 900, 1, 2 * WALL_MEMORY_MS);
        assert_eq!(w.kept_beside(2 * WALL_MEMORY_MS), KeptBeside { tokens: 2_000, sessions: 2 }, "started over");
    }

    #[test]
    fn learned_capacity_grows_on_kept_receipts_and_falls_to_the_wall_on_a_miss() {
        let w = WallEvidence::default();
        let declared = Some(4_096); // one slot of 4,096 tokens
        assert_eq!(w.learned().capacity(declared, None), declared, "learning starts from what is declared");
        // 9,000 tokens resident, a returning session finds its prefix: the
        // engine keeps more than its slot (host memory).
        assert_eq!(w.receipt(at(9_000), 2_800, 2_800, 0, 0), Receipt::Kept { load: 9_000 });
        let kept = w.learned();
        assert_eq!((kept.wall_tokens, kept.kept_at_tokens, kept.receipts_kept), (None, 9_000, 1));
        assert_eq!(kept.capacity(declared, None), Some(9_000));
        // More resident, and a returning session finds less than half: the
        // wall is where it was lost.
        assert_eq!(w.receipt(at(15_000), 2_800, 1_000, 0, 1), Receipt::Lost { load: 15_000 });
        assert_eq!(w.receipt(at(12_000), 2_800, 0, 0, 2), Receipt::Lost { load: 12_000 });
        let lost = w.learned();
        assert_eq!((lost.wall_tokens, lost.receipts_lost), (Some(12_000), 2));
        assert_eq!(lost.capacity(declared, None), Some(9_000), "between kept at 9,000 and lost at 12,000: the kept");
        // A later loss below what was kept lowers it.
        assert_eq!(w.receipt(at(6_000), 2_800, 0, 0, 3), Receipt::Lost { load: 6_000 });
        assert_eq!(w.learned().capacity(declared, None), Some(6_000));
    }

    #[test]
    fn the_wall_keeps_the_sessions_held_there_one_fewer_than_at_a_loss_and_a_pool_reads_tokens() {
        let w = WallEvidence::default();
        assert_eq!(w.learned().wall_sessions, None, "no wall: no sessions");
        // Three sessions on two slots of 8,192: one lost its prefix at 7,700.
        let _ = w.receipt(Load { tokens: 7_700, sessions: 3 }, 2_000, 0, 0, 0);
        let learned = w.learned();
        assert_eq!((learned.wall_tokens, learned.wall_sessions), (Some(7_700), Some(2)));
        assert_eq!(learned.wall(Some(8_192)), Some(16_384), "two slots held, not a wall below one slot");
        assert_eq!(learned.wall(None), Some(7_700), "a pool reads tokens");
        assert_eq!(learned.capacity(Some(16_384), Some(8_192)), Some(16_384));
        // Kept above it with nothing between: it held that many.
        let _ = w.receipt(Load { tokens: 9_000, sessions: 3 }, 2_000, 2_000, 0, 1);
        assert_eq!((w.learned().wall_tokens, w.learned().wall_sessions), (Some(9_000), Some(3)));
        // A lone session lost (an engine restarted): still one slot, never none.
        let _ = w.receipt(Load { tokens: 1_000, sessions: 1 }, 900, 0, 0, 2);
        assert_eq!(w.learned().wall(Some(8_192)), Some(8_192));
        // Kept beside others above it: forgotten, sessions and all.
        let _ = w.receipt(Load { tokens: 2_000, sessions: 2 }, 900, 900, 1, 3);
        assert_eq!((w.learned().wall_tokens, w.learned().wall_sessions), (None, None));
    }

    #[test]
    fn on_slots_what_was_kept_counts_whole_slots_as_the_wall_does() {
        let w = WallEvidence::default();
        let slot = Some(8_192);
        // One slot and nothing beyond it: kept with another session
        // resident but none run between proves the one slot only.
        let _ = w.receipt(Load { tokens: 6_000, sessions: 2 }, 2_000, 2_000, 0, 0);
        let _ = w.receipt(Load { tokens: 9_000, sessions: 3 }, 2_000, 0, 0, 1);
        let learned = w.learned();
        assert_eq!((learned.kept_sessions, learned.wall_sessions), (1, Some(2)));
        assert_eq!(learned.capacity(Some(8_192), slot), Some(8_192), "one slot kept, whatever was resident");
        // One slot and a host tier: a session kept across four others'
        // turns, five sessions of 3,000 tokens.
        let w = WallEvidence::default();
        let _ = w.receipt(Load { tokens: 15_000, sessions: 5 }, 2_000, 2_000, 4, 0);
        // Then a loss with seven resident: six held at the wall.
        let _ = w.receipt(Load { tokens: 21_000, sessions: 7 }, 2_000, 0, 0, 1);
        let learned = w.learned();
        assert_eq!((learned.kept_at_tokens, learned.kept_sessions, learned.wall_sessions), (15_000, 5, Some(6)));
        assert_eq!(
            learned.capacity(Some(8_192), slot),
            Some(5 * 8_192),
            "five sessions kept are five slots of room, not 15,000 tokens (one slot)"
        );
        assert_eq!(learned.capacity(Some(8_192), None), Some(15_000), "a pool reads tokens");
    }

    #[test]
    fn engine_preemptions_since_the_last_read_set_the_wall_at_the_load_now() {
        let w = WallEvidence::default();
        assert_eq!(w.engine_preemptions(4, at(6_000), 0), None, "the first read only notes the counter");
        assert_eq!(w.engine_preemptions(4, at(6_000), 0), None, "none since");
        assert_eq!(w.engine_preemptions(6, at(11_000), 0), Some(11_000));
        assert_eq!(w.wall(), Some(11_000));
        // An engine restarted: its counter starts over, and says nothing yet.
        assert_eq!(w.engine_preemptions(0, at(11_000), 0), None);
        assert_eq!(w.engine_preemptions(0, at(11_000), 0), None);
        assert_eq!(w.engine_preemptions(1, at(6_000), 0), Some(6_000));
        assert_eq!(w.wall(), Some(6_000), "lower: the wall follows");
    }

    #[test]
    fn a_full_pool_sets_the_wall_once_per_lowering_and_leaves_a_lesson() {
        let w = WallEvidence::default();
        assert_eq!(w.engine_full(at(0), 0), None, "nothing resident: nothing to say");
        assert!(!w.take_wall_lesson());
        assert_eq!(w.engine_full(at(11_000), 0), Some(11_000));
        assert_eq!(w.wall(), Some(11_000));
        assert_eq!(w.engine_full(at(11_000), 0), None, "the same load again: nothing new");
        assert!(w.take_wall_lesson(), "the projections learn from who crossed it");
        assert!(!w.take_wall_lesson(), "once");
        assert_eq!(w.engine_full(at(5_000), 0), Some(5_000));
    }

    #[test]
    fn a_wall_no_loss_confirmed_for_ten_minutes_is_forgotten() {
        let w = WallEvidence::default();
        let t0 = 1_000_000;
        assert_eq!(w.receipt(at(4_000), 3_000, 0, 0, t0), Receipt::Lost { load: 4_000 });
        assert_eq!(w.forget_stale_wall(t0 + WALL_MEMORY_MS - 1), None, "still fresh");
        // A loss at the wall again confirms it, though it does not move it.
        assert_eq!(w.engine_full(at(5_000), t0 + 60_000), None, "not lower: nothing new to say");
        assert_eq!(w.forget_stale_wall(t0 + WALL_MEMORY_MS), None, "confirmed a minute later");
        assert_eq!(w.wall(), Some(4_000));
        assert_eq!(w.forget_stale_wall(t0 + 60_000 + WALL_MEMORY_MS), Some(4_000));
        assert_eq!(w.wall(), None, "new sessions go up to the capacity again");
        assert_eq!(w.forget_stale_wall(t0 + 60_000 + 2 * WALL_MEMORY_MS), None, "forgotten once");
        // The next loss finds it again.
        assert_eq!(w.receipt(at(5_000), 3_000, 0, 0, t0 + 3 * WALL_MEMORY_MS), Receipt::Lost { load: 5_000 });
        assert_eq!(w.wall(), Some(5_000));
    }

    #[test]
    fn a_lost_prefix_sets_the_wall_at_the_load_it_was_lost_at_and_a_kept_one_raises_it() {
        let w = WallEvidence::default();
        assert_eq!(w.receipt(at(11_000), 100, 0, 0, 0), Receipt::Unclear, "too small to say");
        assert_eq!(w.receipt(at(11_000), 5_000, 4_900, 0, 0), Receipt::Kept { load: 11_000 });
        assert_eq!(w.wall(), None, "no loss seen: no wall");
        assert_eq!(w.receipt(at(11_000), 5_000, 1_000, 0, 0), Receipt::Lost { load: 11_000 });
        assert_eq!(w.wall(), Some(11_000));
        assert_eq!(w.receipt(at(13_000), 5_000, 5_000, 0, 0), Receipt::Kept { load: 13_000 });
        assert_eq!(w.wall(), Some(13_000), "kept at a higher load: the wall is higher");
        assert_eq!(w.receipt(at(11_000), 5_000, 0, 0, 0), Receipt::Lost { load: 11_000 });
        assert_eq!(w.wall(), Some(11_000));
    }
}
