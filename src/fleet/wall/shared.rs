//! One replica's wall, shared between gateway instances (a shared store):
//! each instance's heartbeat carries the wall it holds (`SharedWall`), and
//! every instance merges the others' into its own (`WallEvidence::merge`).
//!
//! Why: a wall is the replica's, not the instance's. Without sharing, every
//! other instance went on placing new sessions above a wall one instance
//! had seen, until a session of its own lost its prefix there: a re-prefill
//! per instance and replica, again after each wall was forgotten.
//!
//! What is shared is losses: they meet at the lowest, unless a kept
//! receipt above the wall came after them on the instance merging them
//! (it raised the wall there, or showed it was not the replica's). A kept
//! receipt is not shared: it raises or forgets the wall only where it was
//! read. Why: sharing those too (a first version) spread every forgetting
//! to every instance, and with three instances on slot-declared replicas
//! that keep partial prefixes (`SETS=2 SIM_ARGS="--slots 1"
//! bench/wall-instances.sh`) the second set took 4.3-6.7 s in four of six
//! runs, against 3.65 s in all six before; with losses alone, 3.64-3.67 s
//! in six of six. Forgetting a stale wall needs no message: every instance
//! holds the same confirmation time, so each forgets it at the same
//! moment, and a stale report is never taken back.

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
}

impl WallEvidence {
    /// What this instance holds of the replica's wall, for the others;
    /// None: no wall.
    pub fn shared(&self) -> Option<SharedWall> {
        let wall = SharedWall {
            tokens: self.wall.load(Ordering::Relaxed),
            sessions: self.wall_sessions.load(Ordering::Relaxed),
            confirmed_ms: self.wall_confirmed_ms.load(Ordering::Relaxed),
        };
        (wall.tokens > 0).then_some(wall)
    }

    /// Merges another instance's wall (`other`, from its heartbeat) into
    /// this one at `now_ms`: it lowers the wall here as a loss seen here
    /// would, unless a kept receipt here came after it (`raised_ms`) or no
    /// loss confirmed it for `WALL_MEMORY_MS`. Returns the wall when it
    /// appeared or came lower here (new sessions above it wait).
    pub fn merge(&self, other: SharedWall, now_ms: u64) -> Option<u64> {
        let fresh = now_ms.saturating_sub(other.confirmed_ms) < WALL_MEMORY_MS;
        if other.tokens == 0 || !fresh || other.confirmed_ms <= self.raised_ms.load(Ordering::Relaxed) {
            return None;
        }
        self.lower_wall_to(other.tokens, other.sessions.max(1), other.confirmed_ms).then_some(other.tokens)
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
    /// What each saw of the other's wall: (into a, into b).
    fn beat(a: &WallEvidence, b: &WallEvidence, now_ms: u64) -> (Option<u64>, Option<u64>) {
        let merged_into_b = a.shared().and_then(|s| b.merge(s, now_ms));
        let merged_into_a = b.shared().and_then(|s| a.merge(s, now_ms));
        (merged_into_a, merged_into_b)
    }

    #[test]
    fn a_wall_one_instance_saw_is_every_instances_and_losses_meet_at_the_lowest() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        assert_eq!(a.shared(), None, "nothing to tell");
        lose(&a, 12_000, 4, MIN);
        assert_eq!(beat(&a, &b, MIN + 200), (None, Some(12_000)));
        assert_eq!((b.wall(), b.learned().wall_sessions), (Some(12_000), Some(3)), "the sessions held too");
        assert!(b.take_wall_lesson(), "the projections here learn from it as from a wall seen here");
        // Each instance's own loss, lower on the other: both at the lowest.
        lose(&b, 9_000, 3, 2 * MIN);
        assert_eq!(beat(&a, &b, 2 * MIN + 200), (Some(9_000), None));
        assert_eq!((a.wall(), b.wall()), (Some(9_000), Some(9_000)));
        // A higher loss lowers nothing, on either.
        lose(&a, 15_000, 5, 3 * MIN);
        assert_eq!(beat(&a, &b, 3 * MIN + 200), (None, None));
        assert_eq!((a.wall(), b.wall()), (Some(9_000), Some(9_000)));
    }

    #[test]
    fn a_kept_receipt_above_the_wall_moves_it_only_where_it_was_read_and_older_losses_do_not_undo_it() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        lose(&a, 9_000, 3, MIN);
        let _ = beat(&a, &b, MIN + 200);
        // Kept above it with nothing run between: raised on a alone, and
        // b's copy of the older loss does not lower a's again.
        let kept = a.receipt(Load { tokens: 12_000, sessions: 4 }, 2_000, 2_000, 0, 2 * MIN);
        assert_eq!(kept, Receipt::Kept { load: 12_000 });
        assert_eq!(beat(&a, &b, 2 * MIN + 200), (None, None));
        assert_eq!((a.wall(), b.wall()), (Some(12_000), Some(9_000)));
        // Kept beside others' turns above it on b: forgotten on b alone,
        // and a's copy of the older loss does not bring it back.
        let kept_beside = b.receipt(Load { tokens: 10_000, sessions: 3 }, 2_000, 2_000, 1, 3 * MIN);
        assert_eq!(kept_beside, Receipt::Unwalled { wall: 9_000, load: 10_000 });
        assert_eq!(beat(&a, &b, 3 * MIN + 200), (None, None));
        assert_eq!((a.wall(), b.wall()), (Some(12_000), None));
        // A loss after that, on a, is b's wall again.
        lose(&a, 11_000, 3, 4 * MIN);
        assert_eq!(beat(&a, &b, 4 * MIN + 200), (None, Some(11_000)));
    }

    #[test]
    fn a_stale_wall_is_forgotten_on_each_instance_and_never_taken_back() {
        let (a, b) = (WallEvidence::default(), WallEvidence::default());
        lose(&a, 9_000, 3, MIN);
        let _ = beat(&a, &b, MIN + 200);
        let stale = MIN + WALL_MEMORY_MS;
        assert_eq!(a.forget_stale_wall(stale), Some(9_000));
        assert_eq!(beat(&a, &b, stale), (None, None), "b's copy is as stale");
        assert_eq!(a.wall(), None);
        assert_eq!(b.forget_stale_wall(stale), Some(9_000), "b forgets it at the same moment");
    }
}
