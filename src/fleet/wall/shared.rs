//! One replica's wall, shared between gateway instances (a shared store):
//! each instance's heartbeat carries the wall it holds (`SharedWall`), and
//! every instance merges the others' into its own (`WallEvidence::merge`).
//!
//! Why: a wall is the replica's, not the instance's. Without sharing, every
//! other instance went on placing new sessions above a wall one instance
//! had seen, until a session of its own lost its prefix there: a re-prefill
//! per instance and replica, again after each wall was forgotten.
//!
//! The rule: losses meet at the lowest (each is evidence of the wall),
//! unless a kept receipt above the wall came after them (it raised the
//! wall, or showed it was not the replica's): then the state of the
//! instance that read that receipt wins. Forgetting a stale wall needs no
//! message: every instance holds the same confirmation time, so each
//! forgets it at the same moment, and a stale report is never taken back.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::{WallEvidence, WALL_MEMORY_MS};

/// A replica's wall as one instance holds it, for the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SharedWall {
    /// The wall, tokens resident (0: none).
    pub tokens: u64,
    /// The sessions held at it (0: not known).
    pub sessions: u64,
    /// When a loss last confirmed it, ms since the epoch (0: never).
    pub confirmed_ms: u64,
    /// When a kept receipt above a wall last raised it or showed it was
    /// not the replica's, ms since the epoch (0: never).
    pub raised_ms: u64,
}

/// What merging another instance's wall changed here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    Nothing,
    /// A wall appeared or came lower: new sessions above it wait.
    Seen(u64),
    /// The wall here (this many tokens) was not the replica's.
    Forgotten(u64),
}

impl WallEvidence {
    /// What this instance holds of the replica's wall, for the others;
    /// None: nothing to tell (no wall, and none ever raised).
    pub fn shared(&self) -> Option<SharedWall> {
        let wall = SharedWall {
            tokens: self.wall.load(Ordering::Relaxed),
            sessions: self.wall_sessions.load(Ordering::Relaxed),
            confirmed_ms: self.wall_confirmed_ms.load(Ordering::Relaxed),
            raised_ms: self.raised_ms.load(Ordering::Relaxed),
        };
        (wall.tokens > 0 || wall.raised_ms > 0).then_some(wall)
    }

    /// Merges another instance's wall (`other`, from its heartbeat) into
    /// this one at `now_ms`. A loss it saw lowers the wall here, unless a
    /// kept receipt here came after it; a kept receipt it read after every
    /// loss seen here makes its wall this one's. A wall no loss confirmed
    /// for `WALL_MEMORY_MS` is not taken. The steps are atomic each, not
    /// together: a receipt read between them is merged again on the next
    /// heartbeat, a fraction of a second later.
    pub fn merge(&self, other: SharedWall, now_ms: u64) -> Merged {
        let before = self.wall();
        let fresh = now_ms.saturating_sub(other.confirmed_ms) < WALL_MEMORY_MS;
        let raised = self.raised_ms.load(Ordering::Relaxed);
        let confirmed = self.wall_confirmed_ms.load(Ordering::Relaxed);
        if other.raised_ms > raised.max(confirmed) {
            self.raised_ms.fetch_max(other.raised_ms, Ordering::Relaxed);
            let tokens = if fresh { other.tokens } else { 0 };
            self.wall.store(tokens, Ordering::Relaxed);
            self.wall_sessions.store(if tokens > 0 { other.sessions } else { 0 }, Ordering::Relaxed);
            self.wall_confirmed_ms.fetch_max(other.confirmed_ms, Ordering::Relaxed);
        } else if other.tokens > 0 && fresh && other.confirmed_ms > raised {
            self.lower_wall_to(other.tokens, other.sessions.max(1), other.confirmed_ms);
        }
        match (before, self.wall()) {
            (Some(was), None) => Merged::Forgotten(was),
            (None, Some(now)) => Merged::Seen(now),
            (Some(was), Some(now)) if now < was => Merged::Seen(now),
            _ => Merged::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Load, Receipt};
    use super::*;

    const MIN: u64 = 60_000;

    fn lose(w: &WallEvidence, tokens: u64, sessions: u64, now_ms: u64) {
        assert_eq!(w.receipt(Load { tokens, sessions }, 2_000, 0, 0, now_ms), Receipt::Lost { load: tokens });
    }

    /// Each instance merges the other's heartbeat, as the flusher does.
    fn beat(a: &WallEvidence, b: &WallEvidence, now_ms: u64) -> (Merged, Merged) {
        let merged_into_b = a.shared().map_or(Merged::Nothing, |s| b.merge(s, now_ms));
        let merged_into_a = b.shared().map_or(Merged::Nothing, |s| a.merge(s, now_ms));
        (merged_into_a, merged_into_b)
    }

    #[test]
    fn a_wall_one_instance_saw_is_every_instances_and_losses_meet_at_the_lowest() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        assert_eq!(a.shared(), None, "nothing to tell");
        lose(&a, 12_000, 4, MIN);
        assert_eq!(beat(&a, &b, MIN + 200), (Merged::Nothing, Merged::Seen(12_000)));
        assert_eq!((b.wall(), b.learned().wall_sessions), (Some(12_000), Some(3)), "the sessions held too");
        assert!(b.take_wall_lesson(), "the projections here learn from it as from a wall seen here");
        // Each instance's own loss, lower on the other: both at the lowest.
        lose(&b, 9_000, 3, 2 * MIN);
        assert_eq!(beat(&a, &b, 2 * MIN + 200), (Merged::Seen(9_000), Merged::Nothing));
        assert_eq!((a.wall(), b.wall()), (Some(9_000), Some(9_000)));
        // A higher loss lowers nothing, on either.
        lose(&a, 15_000, 5, 3 * MIN);
        assert_eq!(beat(&a, &b, 3 * MIN + 200), (Merged::Nothing, Merged::Nothing));
        assert_eq!((a.wall(), b.wall()), (Some(9_000), Some(9_000)));
    }

    #[test]
    fn a_kept_receipt_above_the_wall_on_one_instance_raises_or_forgets_it_on_every_one() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        lose(&a, 9_000, 3, MIN);
        let _ = beat(&a, &b, MIN + 200);
        // Kept above it with nothing run between: raised on a, then on b,
        // and b's older copy of the loss does not lower a's again.
        assert_eq!(
            a.receipt(Load { tokens: 12_000, sessions: 4 }, 2_000, 2_000, 0, 2 * MIN),
            Receipt::Kept { load: 12_000 }
        );
        assert_eq!(beat(&a, &b, 2 * MIN + 200), (Merged::Nothing, Merged::Nothing));
        assert_eq!((a.wall(), b.wall()), (Some(12_000), Some(12_000)));
        // A loss after the raise lowers it everywhere again.
        lose(&b, 10_000, 3, 3 * MIN);
        assert_eq!(beat(&a, &b, 3 * MIN + 200), (Merged::Seen(10_000), Merged::Nothing));
        // Kept beside others' turns above it: not the replica's wall, anywhere.
        let kept_beside = b.receipt(Load { tokens: 11_000, sessions: 3 }, 2_000, 2_000, 1, 4 * MIN);
        assert_eq!(kept_beside, Receipt::Unwalled { wall: 10_000, load: 11_000 });
        assert_eq!(beat(&a, &b, 4 * MIN + 200), (Merged::Forgotten(10_000), Merged::Nothing));
        assert_eq!((a.wall(), b.wall()), (None, None));
        assert_eq!(a.learned().wall_sessions, None);
        // And it stays forgotten: the older losses are not taken back.
        assert_eq!(beat(&a, &b, 4 * MIN + 400), (Merged::Nothing, Merged::Nothing));
        assert_eq!((a.wall(), b.wall()), (None, None));
    }

    #[test]
    fn a_stale_wall_is_forgotten_on_each_instance_and_never_taken_back() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        lose(&a, 9_000, 3, MIN);
        let _ = beat(&a, &b, MIN + 200);
        let stale = MIN + WALL_MEMORY_MS;
        assert_eq!(a.forget_stale_wall(stale), Some(9_000));
        assert_eq!(beat(&a, &b, stale), (Merged::Nothing, Merged::Nothing), "b's copy is as stale");
        assert_eq!(a.wall(), None);
        assert_eq!(b.forget_stale_wall(stale), Some(9_000), "b forgets it at the same moment");
    }
}
