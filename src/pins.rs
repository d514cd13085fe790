//! The pin table: which replica holds which prompt prefix, in memory for
//! routing. Writes are tracked as "dirty" and persisted behind the requests
//! by the store's flusher, never on a request's critical path.
//!
//! Time is passed in (`now_ms`), so expiry and LRU eviction are testable
//! without sleeping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};

use crate::policy::PrefixKey;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub replica: Arc<str>,
    pub created_ms: u64,
    pub last_used_ms: u64,
    /// Turns of this conversation served so far (1 for a first turn).
    pub turns: u32,
    /// Estimated prompt tokens of the prefix this pin names.
    pub est_tokens: u64,
    /// The key of the conversation's first pin: all turns of one
    /// conversation share it (the working-set estimate counts families).
    pub family: PrefixKey,
}

/// A change waiting to be persisted: `None` means deleted.
pub type PinChange = (PrefixKey, Option<Pin>);

#[derive(Debug, Default)]
pub struct PinTable {
    map: RwLock<HashMap<PrefixKey, Pin>>,
    dirty: Mutex<HashMap<PrefixKey, Option<Pin>>>,
}

impl PinTable {
    pub fn replica_of(&self, key: PrefixKey) -> Option<Arc<str>> {
        self.map.read().expect("pins lock").get(&key).map(|p| p.replica.clone())
    }

    pub fn get(&self, key: PrefixKey) -> Option<Pin> {
        self.map.read().expect("pins lock").get(&key).cloned()
    }

    pub fn len(&self) -> usize {
        self.map.read().expect("pins lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that `replica` served the prefix `key`. `parent` is the
    /// matched shorter prefix of the same conversation, if any: it stays
    /// alive too, and its turn count carries over.
    pub fn record(&self, key: PrefixKey, replica: &Arc<str>, parent: Option<PrefixKey>, est_tokens: u64, now_ms: u64) {
        let mut map = self.map.write().expect("pins lock");
        let mut dirty = self.dirty.lock().expect("dirty lock");
        let parent_info = parent.filter(|p| *p != key).and_then(|p| {
            let pin = map.get_mut(&p)?;
            pin.last_used_ms = now_ms;
            if pin.replica != *replica {
                // The conversation moved: the old prefix lives where it moved to.
                pin.replica = replica.clone();
            }
            dirty.insert(p, Some(pin.clone()));
            Some((pin.turns, pin.family))
        });
        let pin = map
            .entry(key)
            .and_modify(|p| {
                p.last_used_ms = now_ms;
                p.replica = replica.clone();
                p.turns += 1;
                p.est_tokens = est_tokens;
            })
            .or_insert_with(|| Pin {
                replica: replica.clone(),
                created_ms: now_ms,
                last_used_ms: now_ms,
                turns: parent_info.map_or(1, |(t, _)| t + 1),
                est_tokens,
                family: parent_info.map_or(key, |(_, f)| f),
            });
        dirty.insert(key, Some(pin.clone()));
    }

    /// Loads persisted pins at startup (not marked dirty).
    pub fn restore(&self, pins: impl IntoIterator<Item = (PrefixKey, Pin)>) {
        self.map.write().expect("pins lock").extend(pins);
    }

    pub fn remove(&self, key: PrefixKey) -> bool {
        let removed = self.map.write().expect("pins lock").remove(&key).is_some();
        if removed {
            self.dirty.lock().expect("dirty lock").insert(key, None);
        }
        removed
    }

    /// Removes every pin of `replica`; returns how many.
    pub fn remove_replica(&self, replica: &str) -> usize {
        self.remove_where(|_, p| &*p.replica == replica)
    }

    /// Forgets pins idle for longer than `ttl_ms`, then the least recently
    /// used beyond `max`. Returns how many went.
    pub fn prune(&self, now_ms: u64, ttl_ms: u64, max: usize) -> usize {
        let expired = self.remove_where(|_, p| now_ms.saturating_sub(p.last_used_ms) > ttl_ms);
        let mut map = self.map.write().expect("pins lock");
        if map.len() <= max {
            return expired;
        }
        let excess = map.len() - max;
        let mut ages: Vec<(u64, PrefixKey)> = map.iter().map(|(k, p)| (p.last_used_ms, *k)).collect();
        ages.select_nth_unstable(excess - 1);
        let mut dirty = self.dirty.lock().expect("dirty lock");
        for (_, key) in &ages[..excess] {
            map.remove(key);
            dirty.insert(*key, None);
        }
        expired + excess
    }

    fn remove_where(&self, pred: impl Fn(&PrefixKey, &Pin) -> bool) -> usize {
        let mut map = self.map.write().expect("pins lock");
        let mut dirty = self.dirty.lock().expect("dirty lock");
        let before = map.len();
        map.retain(|k, p| {
            let gone = pred(k, p);
            if gone {
                dirty.insert(*k, None);
            }
            !gone
        });
        before - map.len()
    }

    /// The changes since the last call, for the write-behind flusher.
    pub fn take_dirty(&self) -> Vec<PinChange> {
        std::mem::take(&mut *self.dirty.lock().expect("dirty lock")).into_iter().collect()
    }

    pub fn count_by_replica(&self) -> HashMap<Arc<str>, usize> {
        let mut counts = HashMap::new();
        for p in self.map.read().expect("pins lock").values() {
            *counts.entry(p.replica.clone()).or_default() += 1;
        }
        counts
    }

    /// A page of pins, most recently used first.
    pub fn page(&self, replica: Option<&str>, offset: usize, limit: usize) -> (usize, Vec<(PrefixKey, Pin)>) {
        let map = self.map.read().expect("pins lock");
        let mut all: Vec<(PrefixKey, Pin)> = map
            .iter()
            .filter(|(_, p)| replica.is_none_or(|r| &*p.replica == r))
            .map(|(k, p)| (*k, p.clone()))
            .collect();
        drop(map);
        let total = all.len();
        all.sort_unstable_by(|a, b| b.1.last_used_ms.cmp(&a.1.last_used_ms).then(a.0.cmp(&b.0)));
        (total, all.into_iter().skip(offset).take(limit).collect())
    }

    /// Pins of conversations that came back (a second turn or more), used
    /// since `since_ms`: the working-set estimate. One-shot pins, usually the
    /// vast majority, are not copied out.
    pub fn conversations_active_since(&self, since_ms: u64) -> Vec<Pin> {
        let map = self.map.read().expect("pins lock");
        map.values().filter(|p| p.turns >= 2 && p.last_used_ms >= since_ms).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn turns_carry_over_and_a_move_updates_the_parent() {
        let t = PinTable::default();
        t.record(1, &id("a"), None, 10, 100);
        t.record(2, &id("a"), Some(1), 20, 200);
        assert_eq!(t.get(2).unwrap().turns, 2);
        t.record(3, &id("b"), Some(2), 30, 300);
        assert_eq!(&*t.get(2).unwrap().replica, "b");
        assert_eq!(t.get(3).unwrap().turns, 3);
        assert_eq!(t.get(3).unwrap().family, 1);
        assert_eq!(t.take_dirty().len(), 3);
        assert!(t.take_dirty().is_empty());
    }

    #[test]
    fn prune_drops_expired_then_least_recently_used() {
        let t = PinTable::default();
        for k in 0..10u128 {
            t.record(k, &id("a"), None, 1, k as u64 * 10);
        }
        t.take_dirty();
        assert_eq!(t.prune(100, 55, 100), 5); // last used 0..=40 are idle for more than 55 ms
        assert_eq!(t.prune(100, 1_000, 3), 2); // keep the three most recent
        let (total, page) = t.page(None, 0, 10);
        assert_eq!(total, 3);
        assert_eq!(page.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![9, 8, 7]);
        assert_eq!(t.take_dirty().iter().filter(|(_, p)| p.is_none()).count(), 7);
    }

    #[test]
    fn removing_a_replica_removes_only_its_pins() {
        let t = PinTable::default();
        t.record(1, &id("a"), None, 1, 1);
        t.record(2, &id("b"), None, 1, 1);
        assert_eq!(t.remove_replica("a"), 1);
        assert_eq!(t.replica_of(2).as_deref(), Some("b"));
        assert_eq!(t.replica_of(1), None);
    }
}
