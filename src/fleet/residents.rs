//! The sessions resident on one replica (the KV wall, `sessions/`): kept on
//! the replica's record, so they leave with it. `Sessions` decides who is
//! resident where and keeps the index from a session to its replica; this
//! is only the replica's side of it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::policy::PrefixKey;

/// One resident session.
#[derive(Debug, Clone, Copy, Default)]
pub struct Resident {
    /// Its context now, tokens (its latest turn's).
    pub tokens: u64,
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
    pub last_ms: u64,
    /// Turns running now: a session mid-turn is never idle.
    pub running: u32,
    /// A turn of it ran here (not only another instance's pins say so):
    /// this instance keeps it alive in a shared store.
    pub ours: bool,
    /// The longest silence between two of its turns seen here, ms (0: none
    /// yet): how long this agent's tool calls take, so when it has left.
    pub longest_gap_ms: u64,
}

/// A session idles out after this many times its longest gap between turns.
pub const GAP_FACTOR: u64 = 3;

/// ... and never sooner than this: a loop that returns at once still gets
/// a moment (the client's own work, a pub/sub hop to another instance).
pub const MIN_IDLE_MS: u64 = 500;

impl Resident {
    /// What it counts for against its replica's room, tokens.
    pub fn counted_tokens(&self) -> u64 {
        self.tokens.max(self.projected)
    }

    /// How long after its last turn this session idles out: a few times its
    /// longest gap, between `MIN_IDLE_MS` and `idle_ms` (`sessions.idle_ms`,
    /// also what a session with one turn so far gets). An agent that returns
    /// at once gives its room back soon after it stops; one running long
    /// tool calls keeps it through them (up to `idle_ms`).
    pub fn idle_after_ms(&self, idle_ms: u64) -> u64 {
        match self.longest_gap_ms {
            0 => idle_ms,
            gap => gap.saturating_mul(GAP_FACTOR).clamp(MIN_IDLE_MS.min(idle_ms), idle_ms),
        }
    }
}

#[derive(Debug, Default)]
pub struct Residents {
    sessions: Mutex<foldhash::HashMap<PrefixKey, Resident>>,
    /// With a shared store: the footprints of every instance's live
    /// sessions here, as last read (`store.session_loads`).
    fleet_load: AtomicU64,
}

impl Residents {
    /// The sessions resident here. `Sessions` takes its own lock first,
    /// then this one: always in that order.
    pub fn lock(&self) -> MutexGuard<'_, foldhash::HashMap<PrefixKey, Resident>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn fleet_load(&self) -> u64 {
        self.fleet_load.load(Ordering::Relaxed)
    }

    pub fn set_fleet_load(&self, tokens: u64) {
        self.fleet_load.store(tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
