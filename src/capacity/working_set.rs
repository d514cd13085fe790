//! The conversations each replica keeps warm: families (a conversation's
//! turns share one) that came back within the window, with the largest
//! context each holds there. Told as they are served (`touch`), so a report
//! costs O(active families), not O(pins).
//!
//! Sharded by family: every returning turn touches one family, and one
//! global lock made every continuation on both workers take it. A family
//! lives in one shard, so a touch, a move or an expiry locks one shard.

use std::sync::{Arc, Mutex};

use crate::policy::PrefixKey;

const SHARDS: usize = 16;

/// A family's largest context on one replica, and when it was last served.
#[derive(Debug, Clone, Copy)]
struct FamilyUse {
    tokens: u64,
    last_used_ms: u64,
}

/// One shard: families per replica. Keyed by replica first so that a
/// returning family is found by the name it is given: the shared name is
/// cloned only for a replica's first family in the shard.
type Shard = foldhash::HashMap<Arc<str>, foldhash::HashMap<PrefixKey, FamilyUse>>;

pub struct WorkingSet {
    shards: Vec<Mutex<Shard>>,
    window_ms: u64,
}

impl WorkingSet {
    pub fn new(window_ms: u64) -> WorkingSet {
        WorkingSet { shards: (0..SHARDS).map(|_| Mutex::default()).collect(), window_ms }
    }

    fn shard(&self, family: PrefixKey) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(family as usize) % SHARDS].lock().expect("working set lock")
    }

    /// A returning conversation (second turn or later) was served on `replica`.
    pub fn touch(&self, replica: &Arc<str>, family: PrefixKey, tokens: u64, now_ms: u64) {
        let mut shard = self.shard(family);
        if !shard.contains_key(replica) {
            shard.insert(replica.clone(), foldhash::HashMap::default());
        }
        let on = shard.get_mut(replica).expect("inserted above");
        let e = on.entry(family).or_insert(FamilyUse { tokens: 0, last_used_ms: now_ms });
        if now_ms.saturating_sub(e.last_used_ms) > self.window_ms {
            e.tokens = 0; // expired: its old size says nothing any more
        }
        e.tokens = e.tokens.max(tokens);
        e.last_used_ms = e.last_used_ms.max(now_ms);
    }

    /// The conversation left `replica` (its pin moved): it no longer lives there.
    pub fn moved(&self, family: PrefixKey, from: &str) {
        if let Some(on) = self.shard(family).get_mut(from) {
            on.remove(&family);
        }
    }

    pub fn forget_replica(&self, replica: &str) {
        for shard in &self.shards {
            shard.lock().expect("working set lock").remove(replica);
        }
    }

    /// Families used since `since_ms`: (replica, family, largest context).
    pub fn active(&self, since_ms: u64) -> Vec<(Arc<str>, PrefixKey, u64)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            for (r, fs) in shard.lock().expect("working set lock").iter() {
                let live = fs.iter().filter(|(_, u)| u.last_used_ms >= since_ms);
                out.extend(live.map(|(f, u)| (r.clone(), *f, u.tokens)));
            }
        }
        out
    }

    /// Drops families unused since `since_ms`.
    pub fn forget_before(&self, since_ms: u64) {
        for shard in &self.shards {
            let mut shard = shard.lock().expect("working set lock");
            for fs in shard.values_mut() {
                fs.retain(|_, u| u.last_used_ms >= since_ms);
            }
            shard.retain(|_, fs| !fs.is_empty());
        }
    }

    /// (replica, shard) entries held (for the churn test).
    pub fn replicas(&self) -> usize {
        self.shards.iter().map(|s| s.lock().expect("working set lock").len()).sum()
    }

    /// Families held on `replica` (for tests).
    #[cfg(test)]
    pub fn families_on(&self, replica: &str) -> usize {
        self.shards.iter().map(|s| s.lock().expect("working set lock").get(replica).map_or(0, |f| f.len())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_set_follows_families_as_they_are_served_move_and_expire() {
        let w = WorkingSet::new(300_000);
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        w.touch(&a, 1, 50_000, 1_000);
        w.touch(&a, 1, 60_000, 2_000);
        w.touch(&a, 2, 10_000, 2_000);
        let active = |w: &WorkingSet, now: u64| {
            let since = now.saturating_sub(300_000);
            let mut v: Vec<_> = w.active(since).into_iter().map(|(r, f, t)| (r.to_string(), f, t)).collect();
            v.sort();
            v
        };
        assert_eq!(active(&w, 3_000), vec![("a".into(), 1, 60_000), ("a".into(), 2, 10_000)]);
        w.moved(1, "a");
        w.touch(&b, 1, 70_000, 3_000);
        assert_eq!(active(&w, 3_000), vec![("a".into(), 2, 10_000), ("b".into(), 1, 70_000)]);
        // Past the window, family 2 no longer counts.
        assert_eq!(active(&w, 2_000 + 300_001), vec![("b".into(), 1, 70_000)]);
        w.forget_before(2_000 + 300_001 - 300_000);
        assert_eq!(w.families_on("a"), 0, "expired families are dropped");
        w.forget_replica("b");
        assert!(active(&w, 3_000).iter().all(|(r, _, _)| r != "b"));
    }
}
