//! The conversations one replica keeps warm: families (a conversation's
//! turns share one) that came back within the window, with the largest
//! context each holds there. Told as they are served (`touch`), so a report
//! costs O(active families), not O(pins). Kept on the replica's record
//! (`CapacityRecord`): it leaves with the replica.
//!
//! Sharded by family: every returning turn touches one family, and one lock
//! per replica made every continuation to it on both workers take it. A
//! family lives in one shard, so a touch, a move or an expiry locks one shard.

use std::sync::Mutex;

use crate::policy::PrefixKey;

const SHARDS: usize = 8;

/// A family's largest context on the replica, and when it was last served.
#[derive(Debug, Clone, Copy)]
struct FamilyUse {
    tokens: u64,
    last_used_ms: u64,
}

type Shard = foldhash::HashMap<PrefixKey, FamilyUse>;

#[derive(Debug)]
pub struct WorkingSet {
    shards: Vec<Mutex<Shard>>,
}

impl Default for WorkingSet {
    fn default() -> Self {
        WorkingSet { shards: (0..SHARDS).map(|_| Mutex::default()).collect() }
    }
}

impl WorkingSet {
    fn shard(&self, family: PrefixKey) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(family as usize) % SHARDS].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn each_shard(&self) -> impl Iterator<Item = std::sync::MutexGuard<'_, Shard>> {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A returning conversation (second turn or later) was served here; a
    /// family unused for longer than `window_ms` starts afresh.
    pub fn touch(&self, family: PrefixKey, tokens: u64, now_ms: u64, window_ms: u64) {
        let mut shard = self.shard(family);
        let e = shard.entry(family).or_insert(FamilyUse { tokens: 0, last_used_ms: now_ms });
        if now_ms.saturating_sub(e.last_used_ms) > window_ms {
            e.tokens = 0; // expired: its old size says nothing any more
        }
        e.tokens = e.tokens.max(tokens);
        e.last_used_ms = e.last_used_ms.max(now_ms);
    }

    /// The conversation left (its pin moved): it no longer lives here.
    pub fn moved(&self, family: PrefixKey) {
        self.shard(family).remove(&family);
    }

    /// Forgets every family (the replica's pins were deleted).
    pub fn clear(&self) {
        self.each_shard().for_each(|mut s| s.clear());
    }

    /// Families used since `since_ms`, with their largest context.
    pub fn active(&self, since_ms: u64) -> Vec<(PrefixKey, u64)> {
        let mut out = Vec::new();
        for shard in self.each_shard() {
            out.extend(shard.iter().filter(|(_, u)| u.last_used_ms >= since_ms).map(|(f, u)| (*f, u.tokens)));
        }
        out
    }

    /// Drops families unused since `since_ms`.
    pub fn forget_before(&self, since_ms: u64) {
        self.each_shard().for_each(|mut s| s.retain(|_, u| u.last_used_ms >= since_ms));
    }

    /// Families held (for tests).
    pub fn len(&self) -> usize {
        self.each_shard().map(|s| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_set_follows_families_as_they_are_served_move_and_expire() {
        let window = 300_000;
        let (a, b) = (WorkingSet::default(), WorkingSet::default());
        a.touch(1, 50_000, 1_000, window);
        a.touch(1, 60_000, 2_000, window);
        a.touch(2, 10_000, 2_000, window);
        let active = |w: &WorkingSet, now: u64| {
            let mut v = w.active(now.saturating_sub(window));
            v.sort();
            v
        };
        assert_eq!(active(&a, 3_000), vec![(1, 60_000), (2, 10_000)]);
        a.moved(1);
        b.touch(1, 70_000, 3_000, window);
        assert_eq!((active(&a, 3_000), active(&b, 3_000)), (vec![(2, 10_000)], vec![(1, 70_000)]));
        // Past the window, family 2 no longer counts.
        assert!(active(&a, 2_000 + 300_001).is_empty());
        a.forget_before(2_000 + 300_001 - window);
        assert!(a.is_empty(), "expired families are dropped");
        // Touched again after its window, a family's old size is forgotten.
        b.touch(1, 5_000, 3_000 + window + 1, window);
        assert_eq!(active(&b, 3_000 + window + 1), vec![(1, 5_000)]);
        b.clear();
        assert!(b.is_empty());
    }
}
