//! The pin table: which replica holds which prompt prefix, in memory for
//! routing. Writes are tracked as "dirty" and persisted behind the requests
//! by the store's flusher, never on a request's critical path.
//!
//! Why sharded: every served chat request writes a pin, and a continuation
//! looks up one key per boundary. One global lock made every request
//! serialize on it; 64 shards keyed by the low bits of the (already
//! uniformly hashed) key keep writers apart, and `lookup_longest` takes each
//! shard's read lock only for the one probe it needs.
//!
//! Why compact: a million pins is a normal fleet. A pin in memory is a
//! 64-byte `Slot` (replica as an index and generation into an interner,
//! tokens as u32) beside its 16-byte key; the public `Pin` (with the replica's name)
//! is built only for callers outside the hot path.
//!
//! Pruning is per shard: TTL exactly, the size cap as `max / SHARDS` per
//! shard (keys are uniform, so this is LRU within a fraction of a percent).
//!
//! Time is passed in (`now_ms`), so expiry and LRU eviction are testable
//! without sleeping.
//!
//! After a start from sled the table fills page by page (`pages.rs`): a
//! key's page is read on its first touch, so every access by key goes
//! through `shard`, which reads it first; only restore and the page reader
//! itself use `raw_shard`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use crate::policy::{Boundary, Dialect, Passed, PrefixKey};

mod interner;
mod pages;
mod shard;
pub use pages::{page_of, OnLoaded, PageReader, PAGES};

use interner::{Interner, ReplicaRef};
use shard::{next_slot, pin_of, Shard, Slot};

const SHARDS: usize = 64;

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
    /// What wrote this pin: which API, and which kind of key.
    pub origin: PinOrigin,
    /// How many boundaries the request that wrote it went on past it: 0
    /// for a request's own pin (its last boundary), more for a boundary it
    /// passed through (`PinSource::Passed`; `SHARED` once several
    /// conversations passed it). A later request continues the
    /// conversation from a passed boundary only if it goes on further
    /// (`policy::continues`): a rewritten tail, not a shared prompt.
    #[serde(default)]
    pub went_on: u32,
}

/// Which kind of key a pin is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PinSource {
    /// A prompt prefix (the hash chain).
    #[default]
    Prefix,
    /// The body's `prompt_cache_key`.
    PromptCacheKey,
    /// A session header (`x-session-id`, Claude Code's, Codex's, ...).
    SessionHeader,
    /// A stored response's id (Responses API).
    Response,
    /// A boundary a served request passed through (not its last): where a
    /// later turn whose tail was rewritten finds its conversation.
    Passed,
}

impl PinSource {
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    pub fn from_u8(v: u8) -> PinSource {
        match v {
            1 => PinSource::PromptCacheKey,
            2 => PinSource::SessionHeader,
            3 => PinSource::Response,
            4 => PinSource::Passed,
            _ => PinSource::Prefix,
        }
    }
}

/// The API that wrote a pin and the kind of key it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinOrigin {
    pub dialect: Dialect,
    pub source: PinSource,
}

pub fn dialect_to_u8(d: Dialect) -> u8 {
    match d {
        Dialect::Chat => 0,
        Dialect::Completions => 1,
        Dialect::Responses => 2,
        Dialect::Messages => 3,
        Dialect::Other => 4,
    }
}

pub fn dialect_from_u8(v: u8) -> Dialect {
    match v {
        1 => Dialect::Completions,
        2 => Dialect::Responses,
        3 => Dialect::Messages,
        4 => Dialect::Other,
        _ => Dialect::Chat,
    }
}

/// A change waiting to be persisted: `None` means deleted.
pub type PinChange = (PrefixKey, Option<Pin>);

/// A mark's `went_on` once several conversations passed its boundary: no
/// request goes further than that, so none continues from it
/// (`policy::continues`); it names a holder of the shared prompt.
pub const SHARED: u32 = u32::MAX;

/// How long a message's lead (a mark where a request ended, `went_on` 0:
/// see `policy::chain`) is kept: it serves the conversation's next turn
/// only, which comes after a tool call or a person's reply. So the table
/// holds one lead per turn served in the last 15 minutes, not one per turn
/// a conversation ever took.
pub const LEAD_TTL_MS: u64 = 15 * 60 * 1000;

/// The key of the mark that `replica` holds the shared prompt `key`: a
/// shared prompt's own mark names only the latest replica to serve it, and
/// placement prefers any replica that holds it. A hash of both, so it is
/// no boundary's key and the same on every instance (these marks are
/// persisted, announced, expired and removed with their replica as any).
pub fn holder_key(key: PrefixKey, replica: &str) -> PrefixKey {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"prefixgate/holder\0");
    h.update(&key.to_le_bytes());
    h.update(replica.as_bytes());
    h.digest128()
}

/// What `lookup_longest` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    /// The longest boundary (or lead) the request continues a conversation from.
    pub continued: Option<(Boundary, Pin)>,
    /// A longer boundary it passed that another conversation passed too and
    /// went on from differently: a shared prompt (a system prompt and
    /// tools, a document), which names a replica that holds it.
    pub shared: Option<(Boundary, Pin)>,
}

/// What `record` did, for the callers that keep derived state (the working set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub turns: u32,
    pub family: PrefixKey,
    /// The replica the parent prefix lived on, when the conversation moved.
    pub moved_from: Option<Arc<str>>,
}

pub struct PinTable {
    shards: Vec<RwLock<Shard>>,
    replicas: Interner,
    /// The pages still on disk after a start (`pages.rs`); None when the
    /// table was loaded whole, or began empty.
    pages: Option<pages::Pages>,
}

impl Default for PinTable {
    fn default() -> Self {
        PinTable {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            replicas: Interner::default(),
            pages: None,
        }
    }
}

/// Whether a pin heard or read (`pin`) replaces the one held (`held`): a
/// request's own pin outranks a mark whenever each came (an instance that
/// had not heard of the pin yet marked the boundary a request ended at);
/// otherwise the later use wins.
fn replaces(held: &Slot, pin: &Pin) -> bool {
    match (held.source == PinSource::Passed.to_u8(), pin.origin.source == PinSource::Passed) {
        (false, true) => false,
        (true, false) => true,
        _ => held.last_used_ms <= pin.last_used_ms,
    }
}

fn shard_of(key: PrefixKey) -> usize {
    (key as usize) % SHARDS
}

fn tokens32(t: u64) -> u32 {
    u32::try_from(t).unwrap_or(u32::MAX)
}

impl PinTable {
    /// A table whose pins are still on disk, read page by page by `read`
    /// as keys are touched and by `load_all` (`pages.rs`); `on_loaded` is
    /// told of each page's pins.
    pub fn paged(read: PageReader, on_loaded: Option<OnLoaded>) -> PinTable {
        PinTable { pages: Some(pages::Pages::new(read, on_loaded)), ..PinTable::default() }
    }

    /// The shard of `key`, its page read from disk first if it is still there.
    fn shard(&self, key: PrefixKey) -> &RwLock<Shard> {
        self.read_page(page_of(key));
        self.raw_shard(key)
    }

    /// The shard of `key` as it is (for pins read from disk, and restore).
    fn raw_shard(&self, key: PrefixKey) -> &RwLock<Shard> {
        &self.shards[shard_of(key)]
    }

    fn read_page(&self, page: u16) {
        if let Some(pages) = self.pages.as_ref().filter(|p| p.left() > 0) {
            // Nothing in the table is in this page yet: every access by
            // key reads its page first, so the disk's pins go in as they
            // are, but those of a replica removed since the start.
            pages.once(page, |mut pins| {
                let dropped = pages.dropped.lock().expect("dropped lock");
                if !dropped.is_empty() {
                    pins.retain(|(key, pin)| {
                        let gone = dropped.iter().any(|d| d.drops(pin));
                        if gone {
                            // Absent and dirty: the next flush deletes it from disk.
                            self.raw_shard(*key).write().expect("pins lock").dirty.insert(*key);
                        }
                        !gone
                    });
                }
                if let Some(told) = &pages.on_loaded {
                    told(&pins);
                }
                self.restore(pins);
            });
        }
    }

    /// Reads every page still on disk (the background loader, and whatever
    /// must see the whole table). Returns at once when none is left.
    pub fn load_all(&self) {
        if self.pages.as_ref().is_some_and(|p| p.left() > 0) {
            for page in 0..PAGES {
                self.read_page(page as u16);
            }
        }
        if let Some(pages) = &self.pages {
            // Nothing left to drop from.
            pages.dropped.lock().expect("dropped lock").clear();
        }
    }

    /// Pages still on disk (0 once the table is whole).
    pub fn pages_left(&self) -> usize {
        self.pages.as_ref().map_or(0, |p| p.left())
    }

    fn read(&self, key: PrefixKey) -> Option<Slot> {
        self.shard(key).read().expect("pins lock").map.get(&key).copied()
    }

    /// The pin `s` is, with its replica's name; None when the name was
    /// released under it (a stale pin, which reads as absent).
    fn to_pin(&self, s: Slot) -> Option<Pin> {
        Some(pin_of(s, self.replicas.name(s.replica())?))
    }

    fn to_slot_with(&self, p: &Pin, replica: ReplicaRef) -> Slot {
        Slot {
            family: p.family,
            created_ms: p.created_ms,
            last_used_ms: p.last_used_ms,
            est_tokens: tokens32(p.est_tokens),
            turns: p.turns,
            replica_index: replica.index,
            replica_generation: replica.generation,
            went_on: p.went_on,
            dialect: dialect_to_u8(p.origin.dialect),
            source: p.origin.source.to_u8(),
        }
    }

    pub fn replica_of(&self, key: PrefixKey) -> Option<Arc<str>> {
        self.read(key).and_then(|s| self.replicas.name(s.replica()))
    }

    pub fn get(&self, key: PrefixKey) -> Option<Pin> {
        self.read(key).and_then(|s| self.to_pin(s))
    }

    /// The one lookup a routing decision needs, walking from the end: the
    /// longest boundary whose pin the request continues, and the longest
    /// it shares with a conversation it does not continue (both with their
    /// index). `ends_at` is the index of the request's own last boundary
    /// (its pin's); the rule is `policy::continues`.
    ///
    /// At each boundary it passes, after the boundary itself, its message's
    /// lead (`leads`, beside `boundaries`; see `policy::chain`): a request
    /// that ended at a message beginning the same way.
    pub fn lookup_longest(&self, boundaries: &[Boundary], leads: &[Option<Boundary>], ends_at: usize) -> Found {
        let mut shared = None;
        for (i, b) in boundaries.iter().enumerate().rev() {
            let lead = leads.get(i).copied().flatten().filter(|_| i < ends_at);
            for probe in std::iter::once(*b).chain(lead) {
                let Some(pin) = self.get(probe.key) else { continue };
                if crate::policy::continues(ends_at, i, pin.went_on) {
                    return Found { continued: Some((probe, pin)), shared };
                }
                shared.get_or_insert((probe, pin));
            }
        }
        Found { continued: None, shared }
    }

    /// The boundaries a request passed through on its way to its own pin
    /// (`passed`: their keys and estimated tokens, in order, the pin's
    /// excluded), as marks to write now for `replica`: each one absent, on
    /// another replica, or not written for `refresh_ms` (so a long
    /// conversation's early marks do not expire under it, while its turns
    /// rewrite only what changed). A mark keeps the conversation it was
    /// first written for; a request's own pin is never made a mark.
    pub fn passed_marks(
        &self,
        passed: &[Passed],
        replica: &Arc<str>,
        conversation: (u32, PrefixKey),
        now_ms: u64,
        refresh_ms: u64,
        dialect: Dialect,
    ) -> Vec<(PrefixKey, Pin)> {
        let (turns, family) = conversation;
        let mut out = Vec::new();
        for &Passed { key, tokens: est_tokens, went_on } in passed {
            match self.get(key) {
                None => out.push((
                    key,
                    Pin {
                        replica: replica.clone(),
                        created_ms: now_ms,
                        last_used_ms: now_ms,
                        turns,
                        est_tokens,
                        family,
                        origin: PinOrigin { dialect, source: PinSource::Passed },
                        went_on,
                    },
                )),
                Some(held) if held.origin.source != PinSource::Passed => {}
                // Another conversation passed it too: a prompt they share
                // (a system prompt and tools), which no request continues.
                Some(held) if held.family != family && held.went_on != SHARED => {
                    // Both conversations' replicas hold it now.
                    self.holder_mark(key, &held, &held.replica, held.last_used_ms, refresh_ms, &mut out);
                    self.holder_mark(key, &held, replica, now_ms, refresh_ms, &mut out);
                    out.push((key, Pin { replica: replica.clone(), last_used_ms: now_ms, went_on: SHARED, ..held }));
                }
                Some(held) => {
                    if held.went_on == SHARED {
                        self.holder_mark(key, &held, replica, now_ms, refresh_ms, &mut out);
                    }
                    if held.replica != *replica || now_ms.saturating_sub(held.last_used_ms) > refresh_ms {
                        let went_on = if held.went_on == SHARED { SHARED } else { went_on };
                        let pin = Pin { replica: replica.clone(), last_used_ms: now_ms, went_on, ..held };
                        out.push((key, pin));
                    }
                }
            }
        }
        out
    }

    /// Adds to `out` the mark that `replica` holds the shared prompt `key`
    /// (`shared` is its mark), unless one was written within `refresh_ms`.
    fn holder_mark(
        &self,
        key: PrefixKey,
        shared: &Pin,
        replica: &Arc<str>,
        now_ms: u64,
        refresh_ms: u64,
        out: &mut Vec<(PrefixKey, Pin)>,
    ) {
        let at = holder_key(key, replica);
        if self.get(at).is_some_and(|h| now_ms.saturating_sub(h.last_used_ms) <= refresh_ms) {
            return;
        }
        let pin = Pin { replica: replica.clone(), created_ms: now_ms, last_used_ms: now_ms, ..shared.clone() };
        out.push((at, Pin { went_on: SHARED, ..pin }));
    }

    /// Whether `replica` served a request that passed the shared prompt
    /// `key` (within the pins' TTL): one of its holders, the latest or not.
    pub fn holds(&self, key: PrefixKey, replica: &str) -> bool {
        self.replica_of(holder_key(key, replica)).is_some_and(|r| &*r == replica)
    }

    /// Writes marks `passed_marks` chose (dirty: persisted like any pin).
    pub fn write_marks(&self, marks: Vec<(PrefixKey, Pin)>) {
        let passed = PinSource::Passed.to_u8();
        for (key, pin) in marks {
            let idx = self.replicas.intern(&pin.replica);
            let slot = self.to_slot_with(&pin, idx);
            let mut shard = self.shard(key).write().expect("pins lock");
            // A request's own pin written since `passed_marks` read it stays one.
            if shard.map.get(&key).is_none_or(|held| held.source == passed) {
                shard.insert(key, slot);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().expect("pins lock").map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that `replica` served the prefix `key`. `parent` is the
    /// matched shorter prefix of the same conversation, if any: it stays
    /// alive too, and its turn count carries over.
    pub fn record(
        &self,
        key: PrefixKey,
        replica: &Arc<str>,
        parent: Option<PrefixKey>,
        est_tokens: u64,
        now_ms: u64,
        origin: PinOrigin,
    ) -> Recorded {
        let (dialect, source) = (dialect_to_u8(origin.dialect), origin.source.to_u8());
        let idx = self.replicas.intern(replica);
        let mut moved_from = None;
        // Parent and child may share a shard: take one lock at a time.
        let parent_info = parent.filter(|p| *p != key).and_then(|p| {
            let mut shard = self.shard(p).write().expect("pins lock");
            let mut slot = *shard.map.get(&p)?;
            slot.last_used_ms = now_ms;
            if slot.replica() != idx {
                // The conversation moved: the old prefix lives where it moved to.
                moved_from = self.replicas.name(slot.replica());
                slot.set_replica(idx);
            }
            shard.insert(p, slot);
            Some((slot.turns, slot.family))
        });
        let mut shard = self.shard(key).write().expect("pins lock");
        let slot = next_slot(shard.map.get(&key), parent_info, key, idx, est_tokens, now_ms, (dialect, source));
        shard.insert(key, slot);
        Recorded { turns: slot.turns, family: slot.family, moved_from }
    }

    /// The pin `record` would write at `key` now, continuing `parent` (the
    /// conversation's pinned prefix, if any), without writing it: what the
    /// other instances are told at the routing decision.
    pub fn next_pin(
        &self,
        key: PrefixKey,
        replica: &Arc<str>,
        parent: Option<&Pin>,
        est_tokens: u64,
        now_ms: u64,
        origin: PinOrigin,
    ) -> Pin {
        let idx = self.replicas.intern(replica);
        let parent = parent.map(|p| (p.turns, p.family));
        let held = self.read(key);
        let origin = (dialect_to_u8(origin.dialect), origin.source.to_u8());
        // Named by what we were given: `idx` may be released under us.
        pin_of(next_slot(held.as_ref(), parent, key, idx, est_tokens, now_ms, origin), replica.clone())
    }

    /// Applies pin changes that are in the store already (another
    /// instance's, or an operator's deletion once persisted): not marked
    /// dirty. A pin older than the one held here is ignored: the flusher
    /// announces its batch again after persisting, and that second notice
    /// must not undo a turn served since.
    pub fn apply(&self, changes: impl IntoIterator<Item = PinChange>) {
        let mut newer = Vec::new();
        for (key, pin) in changes {
            match pin {
                Some(pin) => {
                    if self.read(key).is_none_or(|held| replaces(&held, &pin)) {
                        newer.push((key, pin));
                    }
                }
                None => {
                    // In order: what came before the deletion is applied first.
                    self.restore(std::mem::take(&mut newer));
                    let mut shard = self.shard(key).write().expect("pins lock");
                    if let Some(old) = shard.map.remove(&key) {
                        shard.uncount(old.replica());
                    }
                }
            }
        }
        // One call: `restore` interns each replica name once per batch.
        self.restore(newer);
    }

    /// The keys of every pin `replica` holds.
    pub fn keys_of(&self, replica: &str) -> Vec<PrefixKey> {
        self.load_all();
        let Some(idx) = self.replicas.find(replica) else { return Vec::new() };
        let mut keys = Vec::new();
        for shard in &self.shards {
            keys.extend(
                shard.read().expect("pins lock").map.iter().filter(|(_, s)| s.replica() == idx).map(|(k, _)| *k),
            );
        }
        keys
    }

    /// Marks keys dirty again after a flush that failed, so the next one retries them.
    pub fn mark_dirty(&self, keys: impl IntoIterator<Item = PrefixKey>) {
        for key in keys {
            self.shard(key).write().expect("pins lock").dirty.insert(key);
        }
    }

    /// Marks every pin dirty: the next flush rewrites the whole table (to a
    /// shared store that lost its data).
    pub fn mark_all_dirty(&self) {
        for shard in &self.shards {
            let mut shard = shard.write().expect("pins lock");
            let keys: Vec<PrefixKey> = shard.map.keys().copied().collect();
            shard.dirty.extend(keys);
        }
    }

    /// Loads persisted pins (at startup, or a page read from disk; not
    /// marked dirty). Each shard is
    /// sized once for its share of them (keys are uniform), instead of
    /// growing, and rehashing, as they come; with the store's names shared
    /// (`store::ReplicaNames`), 4M pins restore in 1.45 s against 1.90 s
    /// (`examples/pin_sizes`, 100k conversations x 40, side by side).
    pub fn restore(&self, pins: impl IntoIterator<Item = (PrefixKey, Pin)>) {
        let pins = pins.into_iter();
        let each = pins.size_hint().0 / SHARDS;
        for shard in &self.shards {
            let mut shard = shard.write().expect("pins lock");
            let more = (each + each / 16).saturating_sub(shard.map.capacity() - shard.map.len());
            shard.map.reserve(more);
        }
        // A million pins name a few replicas: intern each name once.
        let mut names: foldhash::HashMap<Arc<str>, ReplicaRef> = Default::default();
        for (key, pin) in pins {
            let idx = match names.get(&pin.replica) {
                Some(i) => *i,
                None => *names.entry(pin.replica.clone()).or_insert_with(|| self.replicas.intern(&pin.replica)),
            };
            let slot = self.to_slot_with(&pin, idx);
            let mut shard = self.raw_shard(key).write().expect("pins lock");
            if let Some(old) = shard.map.insert(key, slot) {
                shard.uncount(old.replica());
            }
            *shard.counts.entry(slot.replica()).or_default() += 1;
        }
    }

    pub fn remove(&self, key: PrefixKey) -> bool {
        self.shard(key).write().expect("pins lock").remove(key).is_some()
    }

    /// Removes every pin of `replica`; returns how many.
    pub fn remove_replica(&self, replica: &str) -> usize {
        self.remove_replica_pins(replica, false)
    }

    /// Removes the pins of `replica`, but with `keep_stored_responses` not
    /// the ids of responses it stored: a follow-up naming one must hear that
    /// its replica is gone, not be sent to another that never had it. Those
    /// expire with the pin TTL.
    ///
    /// With no pin left on it, the name is released at once (its index is
    /// reused); kept stored-response pins release it once they expire.
    ///
    /// Pins still on disk after a start are dropped as their page is read
    /// (`pages.rs`), not waited for; the count is of those in memory.
    pub fn remove_replica_pins(&self, replica: &str, keep_stored_responses: bool) -> usize {
        let pages = self.pages.as_ref();
        let mut dropped = pages.map(|p| p.dropped.lock().expect("dropped lock"));
        if let Some(dropped) = dropped.as_mut().filter(|_| self.pages_left() > 0) {
            dropped.push(pages::Dropped { name: replica.into(), keep_stored_responses });
        }
        let Some(idx) = self.replicas.find(replica) else { return 0 };
        let response = PinSource::Response.to_u8();
        let removed = self
            .shards
            .iter()
            .map(|s| {
                s.write()
                    .expect("pins lock")
                    .retain(|_, slot| slot.replica() != idx || (keep_stored_responses && slot.source == response))
            })
            .sum();
        if self.pins_of(idx) == 0 {
            self.replicas.release(|_, r| r == idx);
        }
        removed
    }

    fn pins_of(&self, r: ReplicaRef) -> usize {
        self.shards.iter().map(|s| s.read().expect("pins lock").counts.get(&r).copied().unwrap_or(0)).sum()
    }

    /// Releases the names no pin refers to any more, except those `in_use`
    /// keeps (the fleet's replicas, which will pin again): names that only
    /// pins carried (another instance's replicas, a removed replica's kept
    /// stored responses) leave with their last pin. The housekeeping task
    /// calls it after pruning. Returns how many names went.
    pub fn release_unused(&self, in_use: impl Fn(&str) -> bool) -> usize {
        let mut pinned: foldhash::HashSet<ReplicaRef> = Default::default();
        for shard in &self.shards {
            pinned.extend(shard.read().expect("pins lock").counts.keys().copied());
        }
        // A name interned after this scan (a pin being written) is released
        // only if nothing uses it; a pin written under it meanwhile carries
        // the old generation and reads as absent: a lost pin, never a wrong one.
        self.replicas.release(|name, r| !pinned.contains(&r) && !in_use(name))
    }

    /// Names interned now (for tests and the churn measurement).
    pub fn interned(&self) -> usize {
        self.replicas.len()
    }

    /// Forgets pins idle for longer than `ttl_ms` (leads: `LEAD_TTL_MS`),
    /// then the least recently used beyond `max` (per shard: `max / 64`).
    /// Returns how many went.
    /// One shard is locked at a time, so requests on other shards go on.
    /// While pages are still on disk the cap waits: the least recently used
    /// of a part of the table are not the table's (what was written was
    /// within the cap already).
    pub fn prune(&self, now_ms: u64, ttl_ms: u64, max: usize) -> usize {
        let per_shard = if self.pages_left() > 0 { usize::MAX } else { max.div_ceil(SHARDS) };
        let lead_ttl_ms = ttl_ms.min(LEAD_TTL_MS);
        let mut gone = 0;
        for shard in &self.shards {
            let mut shard = shard.write().expect("pins lock");
            gone += shard.retain(|_, s| {
                let ttl = if s.is_lead() { lead_ttl_ms } else { ttl_ms };
                now_ms.saturating_sub(s.last_used_ms) <= ttl
            });
            if shard.map.len() > per_shard {
                let excess = shard.map.len() - per_shard;
                let mut ages: Vec<(u64, PrefixKey)> = shard.map.iter().map(|(k, s)| (s.last_used_ms, *k)).collect();
                ages.select_nth_unstable(excess - 1);
                for (_, key) in &ages[..excess] {
                    shard.remove(*key);
                }
                gone += excess;
            }
        }
        gone
    }

    /// The changes since the last call, for the write-behind flusher.
    pub fn take_dirty(&self) -> Vec<PinChange> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.write().expect("pins lock");
            let keys = std::mem::take(&mut shard.dirty);
            out.extend(keys.into_iter().map(|k| (k, shard.map.get(&k).copied())));
        }
        // A stale pin (its name released under it) is written as deleted.
        out.into_iter().map(|(k, s)| (k, s.and_then(|s| self.to_pin(s)))).collect()
    }

    /// Pins held per replica (kept incrementally: no scan of the table).
    pub fn count_by_replica(&self) -> HashMap<Arc<str>, usize> {
        let mut by_idx: HashMap<ReplicaRef, usize> = HashMap::new();
        for shard in &self.shards {
            for (r, n) in &shard.read().expect("pins lock").counts {
                *by_idx.entry(*r).or_default() += n;
            }
        }
        by_idx.into_iter().filter_map(|(r, n)| Some((self.replicas.name(r)?, n))).collect()
    }

    /// A page of pins, most recently used first, optionally only those of
    /// `replica` and whose key starts with the hex digits `key_prefix`.
    /// Admin-only: a scan, one shard lock at a time.
    pub fn page(
        &self,
        replica: Option<&str>,
        key_prefix: &str,
        offset: usize,
        limit: usize,
    ) -> (usize, Vec<(PrefixKey, Pin)>) {
        self.load_all();
        let idx = match replica {
            Some(r) => match self.replicas.find(r) {
                Some(i) => Some(i),
                None => return (0, Vec::new()),
            },
            None => None,
        };
        let mut all: Vec<(PrefixKey, Slot)> = Vec::new();
        for shard in &self.shards {
            let shard = shard.read().expect("pins lock");
            all.extend(
                shard
                    .map
                    .iter()
                    .filter(|(k, s)| {
                        idx.is_none_or(|i| s.replica() == i)
                            && (key_prefix.is_empty() || format!("{k:032x}").starts_with(key_prefix))
                    })
                    .map(|(k, s)| (*k, *s)),
            );
        }
        all.retain(|(_, s)| self.replicas.name(s.replica()).is_some());
        let total = all.len();
        all.sort_unstable_by(|a, b| b.1.last_used_ms.cmp(&a.1.last_used_ms).then(a.0.cmp(&b.0)));
        let page = all.into_iter().skip(offset).take(limit);
        (total, page.filter_map(|(k, s)| Some((k, self.to_pin(s)?))).collect())
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
        t.record(1, &id("a"), None, 10, 100, PinOrigin::default());
        t.record(2, &id("a"), Some(1), 20, 200, PinOrigin::default());
        assert_eq!(t.get(2).unwrap().turns, 2);
        let r = t.record(3, &id("b"), Some(2), 30, 300, PinOrigin::default());
        assert_eq!(r.moved_from.as_deref(), Some("a"));
        assert_eq!(&*t.get(2).unwrap().replica, "b");
        assert_eq!(t.get(3).unwrap().turns, 3);
        assert_eq!(t.get(3).unwrap().family, 1);
        assert_eq!(t.take_dirty().len(), 3);
        assert!(t.take_dirty().is_empty());
    }

    #[test]
    fn the_pin_announced_ahead_is_the_pin_record_writes() {
        let t = PinTable::default();
        let origin = PinOrigin { dialect: Dialect::Messages, source: PinSource::Prefix };
        t.record(1, &id("a"), None, 10, 100, origin);
        let parent = t.get(1).unwrap();
        // A new prefix continuing a conversation, then the same prefix again.
        for (now, tokens) in [(200, 20), (300, 30)] {
            let ahead = t.next_pin(2, &id("b"), Some(&parent), tokens, now, origin);
            t.record(2, &id("b"), Some(1), tokens, now, origin);
            assert_eq!(t.get(2).unwrap(), ahead, "at {now}");
        }
        assert_eq!((t.get(2).unwrap().turns, t.get(2).unwrap().family), (3, 1));
    }

    #[test]
    fn prune_drops_expired_then_least_recently_used() {
        let t = PinTable::default();
        // Keys 0..10 land in ten different shards; the cap is per shard, so
        // test it within one shard: keys k * SHARDS share shard 0.
        for k in 0..10u128 {
            t.record(k * SHARDS as u128, &id("a"), None, 1, k as u64 * 10, PinOrigin::default());
        }
        t.take_dirty();
        assert_eq!(t.prune(100, 55, usize::MAX), 5); // last used 0..=40 are idle for more than 55 ms
        assert_eq!(t.prune(100, 1_000, 3 * SHARDS), 2); // keep the three most recent
        let (total, page) = t.page(None, "", 0, 10);
        assert_eq!(total, 3);
        assert_eq!(page.iter().map(|(k, _)| *k / SHARDS as u128).collect::<Vec<_>>(), vec![9, 8, 7]);
        assert_eq!(t.take_dirty().iter().filter(|(_, p)| p.is_none()).count(), 7);
    }

    #[test]
    fn removing_a_replica_removes_only_its_pins_and_counts_follow() {
        let t = PinTable::default();
        t.record(1, &id("a"), None, 1, 1, PinOrigin::default());
        t.record(2, &id("b"), None, 1, 1, PinOrigin::default());
        t.record(3, &id("a"), None, 1, 1, PinOrigin::default());
        t.record(3, &id("b"), None, 1, 2, PinOrigin::default()); // moved: counted once, on b
        assert_eq!(t.count_by_replica().get("a"), Some(&1));
        assert_eq!(t.count_by_replica().get("b"), Some(&2));
        t.record(2, &id("b"), None, 1, 3, PinOrigin::default()); // a returning turn: still counted once
        assert_eq!(t.count_by_replica().get("b"), Some(&2));
        assert_eq!(t.remove_replica("a"), 1);
        assert_eq!(t.replica_of(2).as_deref(), Some("b"));
        assert_eq!(t.replica_of(1), None);
        assert_eq!(t.count_by_replica().get("a"), None);
    }

    #[test]
    fn lookup_longest_finds_the_last_pinned_boundary() {
        let t = PinTable::default();
        let b = |key| Boundary { key, bytes: 0 };
        t.record(11, &id("a"), None, 1, 1, PinOrigin::default());
        t.record(13, &id("b"), None, 1, 1, PinOrigin::default());
        let (at, pin) = t.lookup_longest(&[b(10), b(11), b(12), b(13), b(14)], &[], 4).continued.unwrap();
        assert_eq!((at.key, &*pin.replica), (13, "b"));
        assert_eq!(t.lookup_longest(&[b(1), b(2)], &[], 1), Found::default());
    }

    /// A turn's boundaries as (key, tokens), its pin at the last.
    fn served(t: &PinTable, keys: &[u128], replica: &str, now: u64) -> Recorded {
        let (last, passed) = keys.split_last().unwrap();
        let recorded = t.record(*last, &id(replica), None, 10, now, PinOrigin::default());
        let n = passed.len();
        let passed: Vec<Passed> =
            passed.iter().enumerate().map(|(i, k)| Passed { key: *k, tokens: 5, went_on: (n - i) as u32 }).collect();
        let marks = t.passed_marks(&passed, &id(replica), (recorded.turns, recorded.family), now, 1_000, Dialect::Chat);
        t.write_marks(marks);
        recorded
    }

    #[test]
    fn a_rewritten_tail_finds_its_conversation_at_the_boundary_it_passed_and_a_shared_prompt_does_not() {
        let t = PinTable::default();
        let b = |key| Boundary { key, bytes: 0 };
        // Turn 1: system, user, status (replaced every turn).
        let first = served(&t, &[1, 2, 3], "a", 10);
        assert_eq!(t.get(2).unwrap().origin.source, PinSource::Passed);
        assert_eq!((t.get(2).unwrap().went_on, t.get(1).unwrap().went_on), (1, 2));
        // Turn 2 drops the status and goes on: answer, tool result, new status.
        let turn2 = [b(1), b(2), b(20), b(21), b(22)];
        let found = t.lookup_longest(&turn2, &[], 4);
        let (at, pin) = found.continued.unwrap();
        assert_eq!((at.key, &*pin.replica, pin.family), (2, "a", first.family));
        // Another conversation's first turn after the same system prompt goes
        // no further than turn 1 went past it: it shares a prompt.
        let other = t.lookup_longest(&[b(1), b(9)], &[], 1);
        assert_eq!(other.continued, None);
        assert_eq!(other.shared.map(|(at, p)| (at.key, p.replica)), Some((1, id("a"))));
        // A request's own pin is never made a mark, and a mark becomes a pin
        // where a request ends.
        served(&t, &[1, 2, 3, 4], "a", 20);
        assert_eq!(t.get(3).unwrap().origin.source, PinSource::Prefix);
        served(&t, &[1, 2], "a", 30);
        assert_eq!((t.get(2).unwrap().origin.source, t.get(2).unwrap().went_on), (PinSource::Prefix, 0));
    }

    #[test]
    fn a_lead_where_a_request_ended_continues_its_conversation_unless_another_ended_there_too() {
        let t = PinTable::default();
        let b = |key| Boundary { key, bytes: 0 };
        // A turn that ended at a message whose lead is 50, as served.
        let ended_at_lead_50 = |keys: &[u128], replica: &str, now| {
            let turn = served(&t, keys, replica, now);
            let lead = [Passed { key: 50, tokens: 5, went_on: 0 }];
            t.write_marks(t.passed_marks(&lead, &id(replica), (turn.turns, turn.family), now, 1_000, Dialect::Chat));
            turn
        };
        // Turn 1 ends at a message with a reminder (key 2).
        let first = ended_at_lead_50(&[1, 2], "a", 10);
        // Turn 2 sends that message bare (key 20, the same lead) and goes on.
        let turn2 = [b(1), b(20), b(21), b(22)];
        let leads = [None, Some(b(50)), None, None];
        let (at, pin) = t.lookup_longest(&turn2, &leads, 3).continued.unwrap();
        assert_eq!((at.key, &*pin.replica, pin.family), (50, "a", first.family));
        // Its own last message's lead is never asked: a request that ends
        // where another ended with the same opening is not its next turn.
        assert_eq!(t.lookup_longest(&turn2[..2], &leads[..2], 1).continued, None);
        // Another conversation ended at a message opening the same way: shared.
        ended_at_lead_50(&[1, 3], "b", 20);
        assert_eq!(t.get(50).unwrap().went_on, SHARED);
        assert_eq!(t.lookup_longest(&turn2, &leads, 3).continued, None);
        // A lead serves the next turn only: it goes after LEAD_TTL_MS, the
        // conversation's boundaries with the TTL.
        t.write_marks(vec![(60, Pin { went_on: 0, ..t.get(2).unwrap() })]);
        t.write_marks(vec![(61, Pin { went_on: 1, origin: t.get(1).unwrap().origin, ..t.get(2).unwrap() })]);
        assert_eq!(t.get(60).unwrap().origin.source, PinSource::Prefix, "a request's own pin: not a lead");
        let lead = Pin {
            went_on: 0,
            origin: PinOrigin { source: PinSource::Passed, ..Default::default() },
            ..t.get(2).unwrap()
        };
        t.write_marks(vec![(62, lead)]);
        let hour = 3_600_000;
        t.prune(20 + LEAD_TTL_MS + 1, hour, usize::MAX);
        assert_eq!(t.get(62), None, "the lead went");
        assert!(t.get(60).is_some() && t.get(61).is_some() && t.get(2).is_some(), "the rest stays");
    }

    #[test]
    fn marks_are_written_again_only_when_moved_or_stale_and_keep_their_conversation() {
        let t = PinTable::default();
        let first = served(&t, &[1, 2, 3], "a", 10);
        t.take_dirty();
        let passed = [Passed { key: 1, tokens: 5, went_on: 2 }, Passed { key: 2, tokens: 5, went_on: 1 }];
        let again = |replica, now| t.passed_marks(&passed, &id(replica), (9, first.family), now, 1_000, Dialect::Chat);
        assert!(again("a", 500).is_empty(), "fresh and on the same replica");
        let moved = again("b", 600);
        assert_eq!(moved.len(), 2);
        assert!(moved.iter().all(|(_, p)| &*p.replica == "b" && p.family == first.family));
        assert_eq!(again("a", 1_011).len(), 2, "stale: written again");
    }

    #[test]
    fn another_instances_mark_never_replaces_a_requests_own_pin() {
        let t = PinTable::default();
        t.record(5, &id("a"), None, 10, 100, PinOrigin::default());
        let mark = Pin {
            replica: id("b"),
            created_ms: 200,
            last_used_ms: 200,
            turns: 2,
            est_tokens: 10,
            family: 5,
            origin: PinOrigin { source: PinSource::Passed, ..Default::default() },
            went_on: 1,
        };
        t.apply([(5, Some(mark.clone()))]);
        assert_eq!((t.get(5).unwrap().origin.source, t.get(5).unwrap().went_on), (PinSource::Prefix, 0));
        // Where nothing ended, it is applied as any newer pin; a request's
        // own pin there later replaces it, whenever it was written.
        t.apply([(6, Some(mark.clone()))]);
        assert_eq!(t.get(6), Some(mark.clone()));
        let own = Pin { origin: PinOrigin::default(), went_on: 0, last_used_ms: 150, ..mark };
        t.apply([(6, Some(own.clone()))]);
        assert_eq!(t.get(6), Some(own));
    }

    #[test]
    fn a_boundary_another_conversation_passes_becomes_a_shared_prompt_no_request_continues() {
        let t = PinTable::default();
        let b = |key| Boundary { key, bytes: 0 };
        served(&t, &[1, 2], "a", 10); // system, task A
        assert!(t.lookup_longest(&[b(1), b(8), b(9), b(10)], &[], 3).continued.is_some(), "one conversation passed it");
        served(&t, &[1, 3], "b", 20); // system, task B: another conversation
        assert_eq!(t.get(1).unwrap().went_on, SHARED);
        let found = t.lookup_longest(&[b(1), b(8), b(9), b(10)], &[], 3);
        assert_eq!(found.continued, None);
        assert_eq!(found.shared.map(|(_, p)| p.replica), Some(id("b")), "the latest holder");
        t.take_dirty();
        served(&t, &[1, 2, 4], "a", 30); // task A goes on: the mark stays shared
        assert_eq!(t.get(1).unwrap().went_on, SHARED);
    }

    #[test]
    fn every_replica_that_served_a_shared_prompt_holds_it_not_only_the_latest() {
        let t = PinTable::default();
        served(&t, &[1, 2], "a", 10); // system, task A on a
        assert!(!t.holds(1, "a"), "one conversation passed it: not shared yet");
        served(&t, &[1, 3], "b", 20); // task B on b: shared
        served(&t, &[1, 4], "c", 30); // task C on c
        assert_eq!(t.get(1).unwrap().replica, id("c"), "the shared prompt's mark names the latest");
        assert!(["a", "b", "c"].iter().all(|r| t.holds(1, r)));
        assert!(!t.holds(1, "d") && !t.holds(2, "a"));
        // A holder leaves with its replica.
        t.remove_replica("b");
        assert!(!t.holds(1, "b") && t.holds(1, "a"));
    }

    #[test]
    fn restored_pins_round_trip_and_are_not_dirty() {
        let t = PinTable::default();
        let origin = PinOrigin { dialect: Dialect::Messages, source: PinSource::SessionHeader };
        let p = Pin {
            replica: id("gpu-1"),
            created_ms: 5,
            last_used_ms: 9,
            turns: 4,
            est_tokens: 90_000,
            family: 77,
            origin,
            went_on: 0,
        };
        t.restore([(42, p.clone())]);
        assert_eq!(t.get(42), Some(p));
        assert!(t.take_dirty().is_empty());
        assert_eq!(t.count_by_replica().get("gpu-1"), Some(&1));
    }

    #[test]
    fn seventy_thousand_names_churn_through_the_table_and_nothing_grows() {
        let t = PinTable::default();
        let one = Boundary { key: 0, bytes: 0 };
        // More names over the table's life than a u16 index ever held: each
        // pins, is looked up, and leaves (a pod restarting under a new name).
        for i in 0..70_000u32 {
            let name: Arc<str> = Arc::from(format!("pod-{i}"));
            let key = u128::from(i);
            t.record(key, &name, None, 1, u64::from(i), PinOrigin::default());
            let found = t.lookup_longest(&[Boundary { key, ..one }], &[], 0).continued;
            assert_eq!(found.map(|(_, p)| p.replica), Some(name));
            assert_eq!(t.remove_replica(&format!("pod-{i}")), 1);
        }
        assert_eq!((t.len(), t.interned()), (0, 0));
        assert!(t.replicas.indexes() <= 1, "one index, reused: {}", t.replicas.indexes());
    }

    #[test]
    fn a_stale_pin_never_reaches_the_replica_that_reuses_its_index() {
        let t = PinTable::default();
        t.record(1, &id("old"), None, 1, 1, PinOrigin::default());
        // The name is released under a pin (a pin written as its replica
        // left), and its index goes to a new replica.
        assert_eq!(t.replicas.release(|name, _| name == "old"), 1);
        t.record(2, &id("new"), None, 1, 2, PinOrigin::default());
        assert_eq!(t.replicas.find("new").map(|r| r.index), Some(0), "the index was reused");
        assert_eq!(t.get(1), None, "the stale pin reads as absent");
        assert_eq!(t.replica_of(1), None);
        assert_eq!(t.count_by_replica().get("new"), Some(&1));
        assert_eq!(t.page(None, "", 0, 10).0, 1);
        // The flusher writes it as deleted; pruning removes it.
        assert!(t.take_dirty().iter().any(|(k, p)| *k == 1 && p.is_none()));
    }

    #[test]
    fn names_only_pins_carried_leave_with_their_last_pin() {
        let t = PinTable::default();
        let mut response = Pin {
            replica: id("gone"),
            created_ms: 1,
            last_used_ms: 1,
            turns: 1,
            est_tokens: 1,
            family: 9,
            origin: PinOrigin { dialect: Dialect::Responses, source: PinSource::Response },
            went_on: 0,
        };
        t.restore([(9, response.clone())]);
        t.record(10, &id("live"), None, 1, 100, PinOrigin::default());
        // A removed replica's stored responses are kept: its name stays.
        assert_eq!(t.remove_replica_pins("gone", true), 0);
        assert_eq!(t.release_unused(|_| false), 0, "both names still carry pins");
        t.prune(1_000, 500, usize::MAX);
        assert_eq!(t.len(), 0, "both expired");
        assert_eq!(t.release_unused(|n| n == "live"), 1, "'gone' left with its last pin");
        assert_eq!(t.interned(), 1, "'live' is still in the fleet: its name stays");
        response.replica = id("again");
        t.restore([(9, response)]);
        assert_eq!(t.replica_of(9).as_deref(), Some("again"));
    }
}
