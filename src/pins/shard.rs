//! A pin as kept in memory (`Slot`) and one shard of the table (`Shard`):
//! the map, the keys waiting for the flusher, and the count per replica.

use std::sync::Arc;

use super::interner::ReplicaRef;
use super::{dialect_from_u8, tokens32, Pin, PinOrigin, PinSource};
use crate::policy::PrefixKey;

/// A pin as stored in memory: 64 bytes (the replica's index and generation
/// are two fields, not a struct, so they share the padding with the origin;
/// `went_on` took the size from 48 to 64, the key's 16-byte alignment).
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) family: PrefixKey,
    pub(super) created_ms: u64,
    pub(super) last_used_ms: u64,
    pub(super) est_tokens: u32,
    pub(super) turns: u32,
    pub(super) replica_index: u32,
    pub(super) replica_generation: u16,
    pub(super) went_on: u32,
    /// `dialect_to_u8` and `PinSource::to_u8`: two bytes that fit in the padding.
    pub(super) dialect: u8,
    pub(super) source: u8,
}

impl Slot {
    /// A message's lead (`policy::chain`): a mark where a request ended.
    pub(super) fn is_lead(&self) -> bool {
        self.source == PinSource::Passed.to_u8() && self.went_on == 0
    }

    pub(super) fn replica(&self) -> ReplicaRef {
        ReplicaRef { index: self.replica_index, generation: self.replica_generation }
    }

    pub(super) fn set_replica(&mut self, r: ReplicaRef) {
        (self.replica_index, self.replica_generation) = (r.index, r.generation);
    }
}

// The request path's maps hash with foldhash (seeded per process): their
// keys are already hashes or short names, and SipHash's strength is not
// needed to spread them.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) map: foldhash::HashMap<PrefixKey, Slot>,
    /// Keys changed since the last flush; the flusher reads their current
    /// value (absent: deleted), so a key written twice is written once.
    pub(super) dirty: foldhash::HashSet<PrefixKey>,
    /// Pins per replica in this shard (kept in step, so counting is O(shards)).
    pub(super) counts: foldhash::HashMap<ReplicaRef, usize>,
}

impl Shard {
    pub(super) fn insert(&mut self, key: PrefixKey, slot: Slot) {
        let was = self.map.insert(key, slot).map(|old| old.replica());
        // The same replica (a returning conversation): its count stands.
        if was != Some(slot.replica()) {
            if let Some(was) = was {
                self.uncount(was);
            }
            *self.counts.entry(slot.replica()).or_default() += 1;
        }
        self.dirty.insert(key);
    }

    pub(super) fn remove(&mut self, key: PrefixKey) -> Option<Slot> {
        let old = self.map.remove(&key)?;
        self.uncount(old.replica());
        self.dirty.insert(key);
        Some(old)
    }

    pub(super) fn uncount(&mut self, r: ReplicaRef) {
        if let Some(n) = self.counts.get_mut(&r) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&r);
            }
        }
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&PrefixKey, &Slot) -> bool) -> usize {
        let gone: Vec<PrefixKey> = self.map.iter().filter(|(k, s)| !keep(k, s)).map(|(k, _)| *k).collect();
        for k in &gone {
            self.remove(*k);
        }
        gone.len()
    }
}

/// The slot `record` writes at `key`: the one held there a turn later, or a
/// new one continuing the parent's (turns, family); `origin` as
/// (dialect, source) bytes.
pub(super) fn next_slot(
    held: Option<&Slot>,
    parent: Option<(u32, PrefixKey)>,
    key: PrefixKey,
    replica: ReplicaRef,
    est_tokens: u64,
    now_ms: u64,
    (dialect, source): (u8, u8),
) -> Slot {
    match held {
        Some(old) => Slot {
            last_used_ms: now_ms,
            replica_index: replica.index,
            replica_generation: replica.generation,
            turns: old.turns.saturating_add(1),
            est_tokens: tokens32(est_tokens),
            // A request ended here now: whatever passed it before, it is a request's own pin.
            went_on: 0,
            source: if old.source == PinSource::Passed.to_u8() { source } else { old.source },
            ..*old
        },
        None => Slot {
            family: parent.map_or(key, |(_, f)| f),
            created_ms: now_ms,
            last_used_ms: now_ms,
            est_tokens: tokens32(est_tokens),
            turns: parent.map_or(1, |(t, _)| t.saturating_add(1)),
            replica_index: replica.index,
            replica_generation: replica.generation,
            went_on: 0,
            dialect,
            source,
        },
    }
}

pub(super) fn pin_of(s: Slot, replica: Arc<str>) -> Pin {
    Pin {
        replica,
        created_ms: s.created_ms,
        last_used_ms: s.last_used_ms,
        turns: s.turns,
        est_tokens: u64::from(s.est_tokens),
        family: s.family,
        origin: PinOrigin { dialect: dialect_from_u8(s.dialect), source: PinSource::from_u8(s.source) },
        went_on: s.went_on,
    }
}
