//! Persistence behind a small trait, so the gateway does not care where its
//! state lives: sled on disk by default, memory for unit tests, and room for
//! a shared networked store when several gateways run side by side.

mod event_writer;
mod memory;
mod migrations;
mod redis_store;
mod sled_store;

pub use event_writer::EventWriter;
pub use memory::MemoryStore;
pub use migrations::{Migration, MIGRATIONS, SCHEMA_VERSION};
pub use redis_store::RedisStore;

/// Longest one Redis command may take before it counts as a failure.
pub fn redis_store_timeout() -> std::time::Duration {
    redis_store::TIMEOUT
}
pub use sled_store::SledStore;

use serde::{Deserialize, Serialize};

use crate::events::Event;
use crate::fleet::{AdminState, ReplicaSource, ReplicaSpec};
use crate::pins::{Pin, PinChange, PinOrigin, PinSource};
use crate::policy::PrefixKey;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage error: {0}")]
    Backend(String),
    #[error("corrupt record in {tree}: {detail}")]
    Corrupt { tree: &'static str, detail: String },
    #[error(
        "the database was written by a newer prefixgate (schema {found}, this build knows up to {supported}); \
         upgrade prefixgate or point --data-dir elsewhere"
    )]
    TooNew { found: u64, supported: u64 },
}

/// What a store makes of a record it cannot read: `.map_err(corrupt("pins"))`.
fn corrupt(tree: &'static str) -> impl Fn(String) -> StoreError {
    move |detail| StoreError::Corrupt { tree, detail }
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Backend(e.to_string())
    }
}

/// A replica as persisted: its spec, the operator's decision about it, and
/// whether the config file (`static`, the default of records written before
/// sources were kept) or the admin API (`api`) named it. Discovered
/// replicas are not persisted: each instance finds them again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReplica {
    pub spec: ReplicaSpec,
    pub admin: AdminState,
    #[serde(default)]
    pub source: ReplicaSource,
}

/// A change one gateway instance made to shared state, as the others hear of
/// it (only a shared store announces changes).
// Externally tagged on purpose: serde's internally tagged enums buffer their
// content, and that buffer cannot hold the u128 in a pin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// Pins written or deleted (`None`), keys as 32 hex digits, and when
    /// they were announced (microseconds since the epoch; 0 from an older
    /// instance): the receiver measures the propagation delay from it.
    Pins {
        pins: Vec<(String, Option<Pin>)>,
        #[serde(default)]
        sent_us: u64,
    },
    /// A replica was added, changed or removed: read it again.
    Replica { id: String },
    /// A setting changed (the routing policy): read it again.
    Setting { name: String },
    /// An event another instance recorded.
    Event { event: Event },
    /// Sessions that idled out on the instance that served them last,
    /// (replica, session as 32 hex digits), and when that was announced
    /// (microseconds since the epoch): their room is free fleet-wide now.
    SessionsReleased {
        sessions: Vec<(String, String)>,
        #[serde(default)]
        sent_us: u64,
    },
    /// A replica was drained with hand-over: the streams on it that may go
    /// on elsewhere move now, on every instance (`proxy::resume`).
    HandOff { replica: String },
    /// Never sent: the listener lost its connection and may have missed changes.
    Lost,
    /// Never sent: the listener is idle (a chance to notice nobody listens).
    Tick,
}

/// One of this instance's resident sessions, as a shared store keeps it:
/// its replica, its id (32 hex digits), its footprint in tokens, and until
/// when it stays there (ms since the epoch: when it idles out, unless renewed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptSession {
    pub replica: String,
    pub session: String,
    pub footprint: u64,
    pub until_ms: u64,
}

/// One gateway instance's heartbeat in a shared store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InstanceBeat {
    pub instance: String,
    /// When this beat was written (milliseconds since the epoch).
    pub at_ms: u64,
    /// Requests this instance has in flight, per replica.
    pub inflight: std::collections::BTreeMap<String, i64>,
    /// Where its admin API listens.
    pub admin_url: Option<String>,
    /// Requests it runs now, per replica: (count, estimated prompt tokens).
    #[serde(default)]
    pub running: std::collections::BTreeMap<String, (u64, u64)>,
    /// The walls it holds, per replica (`fleet::wall::SharedWall`): every
    /// instance merges them into its own.
    #[serde(default)]
    pub walls: std::collections::BTreeMap<String, crate::fleet::wall::SharedWall>,
}

/// Every call may wait on a network or a disk: callers await it, and no
/// runtime worker blocks on it (Redis through its async client, sled on the
/// blocking pool). A call's time is bounded by the store itself (Redis:
/// `redis_store::TIMEOUT` per command).
#[async_trait::async_trait]
pub trait Store: Send + Sync {
    /// True when the database was created by this process (config seeds it).
    fn is_new(&self) -> bool;
    async fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError>;
    async fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError>;
    /// Writes the whole fleet back into a store that came back empty, in one
    /// step where the store can (another instance re-reading meanwhile must
    /// not see half of it and drop the other half).
    async fn restore_replicas(&self, all: &[StoredReplica]) -> Result<(), StoreError> {
        for r in all {
            self.put_replica(r).await?;
        }
        Ok(())
    }
    async fn delete_replica(&self, id: &str) -> Result<(), StoreError>;
    async fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError>;
    /// A reader of one page of pins (`pins::pages`), for a store that keeps
    /// them in pages: the gateway then starts serving before they are all
    /// read. None: `pins` is read whole at startup.
    fn pin_pages(&self) -> Option<crate::pins::PageReader> {
        None
    }
    /// Applies a batch of pin changes atomically.
    async fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError>;
    /// Appends an event; drops persisted events with ids up to `dropped_up_to`.
    async fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError>;
    /// Appends a batch of events in order (one write where the store can).
    async fn append_events(&self, batch: &[crate::events::Pending]) -> Result<(), StoreError> {
        for p in batch {
            self.append_event(&p.event, p.dropped_upto).await?;
        }
        Ok(())
    }
    async fn events(&self) -> Result<Vec<Event>, StoreError>;
    async fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, StoreError>;
    async fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), StoreError>;
    /// Every setting whose name starts with `prefix`, by name.
    async fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError>;
    /// Makes everything written so far durable.
    async fn flush(&self) -> Result<(), StoreError>;

    /// This instance's name, when the store is shared between instances.
    fn instance(&self) -> Option<&str> {
        None
    }
    /// Records this instance's heartbeat (shared stores only).
    async fn heartbeat(&self, _beat: &InstanceBeat) -> Result<(), StoreError> {
        Ok(())
    }
    /// Every instance's last heartbeat (shared stores only).
    async fn instances(&self) -> Result<Vec<InstanceBeat>, StoreError> {
        Ok(Vec::new())
    }
    /// Asks every instance to hand over the streams on `replica` (a drain
    /// with hand-over); an embedded store has one instance, which did.
    async fn announce_handoff(&self, _replica: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Takes one of `limit` fleet-wide large-context slots on `replica` as
    /// `lease` for `ttl_ms` (shared stores; an embedded store has one
    /// instance, whose own admission queue is the whole story).
    async fn try_lease(&self, _replica: &str, _lease: &str, _limit: u32, _ttl_ms: u64) -> Result<bool, StoreError> {
        Ok(true)
    }
    /// Gives a slot back.
    async fn release_lease(&self, _replica: &str, _lease: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Extends the leases this instance holds by `ttl_ms` from now.
    async fn renew_leases(&self, _leases: &[(String, String)], _ttl_ms: u64) -> Result<(), StoreError> {
        Ok(())
    }
    /// Places new session `session` (its footprint in tokens) on one of
    /// `candidates` (replica, capacity: None unknown), the first being the
    /// one this instance would pick: among those with room for it when
    /// `enforce_capacity`, the candidate with the most room left across
    /// every instance (when every capacity is known), then the fewest live
    /// sessions, then the first in order. It is then
    /// resident there for `ttl_ms` unless renewed. Returns the candidate's
    /// index, None when none has room. Shared stores do it in one atomic
    /// step, so two instances neither admit into the same last room nor
    /// both put their new sessions on the same replica of two that tie; an
    /// embedded store has one instance: the first candidate.
    async fn place_session(
        &self,
        _candidates: &[(String, Option<u64>)],
        _session: &str,
        _footprint: u64,
        _ttl_ms: u64,
        _enforce_capacity: bool,
    ) -> Result<Option<usize>, StoreError> {
        Ok(Some(0))
    }
    /// The live sessions' footprints on each of `replicas`, summed, across
    /// every instance (shared stores; empty otherwise).
    async fn session_loads(&self, _replicas: &[String]) -> Result<Vec<u64>, StoreError> {
        Ok(Vec::new())
    }
    /// Keeps this instance's resident sessions where they are, each until it
    /// idles out.
    async fn keep_sessions(&self, _sessions: &[KeptSession]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Gives back the room of this instance's sessions that idled out,
    /// (replica, session as 32 hex digits), at once and fleet-wide: their
    /// entries leave the store and the other instances are told, so the
    /// sessions they hold look at the room again now, not when the entries
    /// expire (shared stores only).
    async fn release_sessions(&self, _sessions: &[(String, String)]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Tells the other instances about pin changes at once, and writes
    /// them where a turn that outran the message can read them (`pins_at`).
    /// Shared stores only; the flusher writes them again with the rest.
    async fn publish_pins(&self, _changes: &[PinChange]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Reads pins from the shared store, one answer per key in order
    /// (shared stores only: an embedded store's pins are all in memory
    /// already).
    async fn pins_at(&self, keys: &[PrefixKey]) -> Result<Vec<Option<Pin>>, StoreError> {
        Ok(vec![None; keys.len()])
    }
    /// The changes other instances make, as they come (shared stores only:
    /// others return `None`). A task of the store's own listens, and ends
    /// when the receiver is dropped; `Change::Lost` says it lost its
    /// connection (and may have missed changes), `Change::Tick` that it
    /// (re)subscribed or was idle for a while.
    fn subscribe(&self) -> Option<tokio::sync::mpsc::Receiver<Change>> {
        None
    }
    /// Where the shared store's own tasks run (`OwnRuntime`): shared stores
    /// only (the others have no tasks: nobody to tell, nothing to hear).
    fn runtime(&self) -> Option<&tokio::runtime::Handle> {
        None
    }
}

/// A runtime on a thread of its own, for a shared store's own tasks:
/// announcing new pins, listening to the other instances, applying what
/// they say. A pin announced there is on the critical path of an agent's
/// next turn at another instance, a pub/sub hop later: on its own thread,
/// neither the workers' load nor the main thread's tasks (the prober, the
/// flusher) delay it. The thread ends when the last handle to it is dropped
/// (with its store).
pub struct OwnRuntime {
    handle: tokio::runtime::Handle,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl OwnRuntime {
    pub fn start(name: &str) -> std::io::Result<OwnRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name(name.into()).spawn(move || {
            let _ = runtime.block_on(stopped);
        })?;
        Ok(OwnRuntime { handle, _stop: stop })
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

/// The operator's state of a discovered replica is the setting of this
/// prefix and the replica's name: one key per name, so two instances acting
/// on two replicas at once never overwrite each other (see
/// `operator/discovered.rs`).
pub const DISCOVERED_ADMIN_PREFIX: &str = "discovered_admin/";

/// What `copy` moved.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub replicas: usize,
    pub pins: usize,
    pub events: usize,
    pub settings: usize,
}

/// Copies everything a gateway persists from `src` to `dst` (replicas,
/// pins, events, the policy, the operator's states of discovered replicas),
/// then makes it durable. Existing records with
/// the same keys are overwritten; others in `dst` are left alone.
pub async fn copy(src: &dyn Store, dst: &dyn Store) -> Result<Copied, StoreError> {
    let mut copied = Copied::default();
    for r in src.replicas().await? {
        dst.put_replica(&r).await?;
        copied.replicas += 1;
    }
    let pins: Vec<PinChange> = src.pins().await?.into_iter().map(|(k, p)| (k, Some(p))).collect();
    for batch in pins.chunks(10_000) {
        dst.write_pins(batch).await?;
    }
    copied.pins = pins.len();
    for e in src.events().await? {
        dst.append_event(&e, None).await?;
        copied.events += 1;
    }
    let mut settings = src.settings(DISCOVERED_ADMIN_PREFIX).await?;
    settings.extend(src.setting("policy").await?.map(|v| ("policy".to_string(), v)));
    for (name, v) in settings {
        dst.put_setting(&name, &v).await?;
        copied.settings += 1;
    }
    dst.flush().await?;
    Ok(copied)
}

/// Microseconds since the epoch: the clock announcements are stamped with
/// (instances on one host, or NTP-synchronized hosts, share it).
pub fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Opens the store a URL names: `sled:DIR` (or a plain directory path),
/// `memory:`, or `redis://...` / `redis+unix://...` as `instance`.
pub async fn open_url(url: &str, instance: &str) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    if ["redis://", "rediss://", "redis+unix://", "redis+sentinel://"].iter().any(|s| url.starts_with(s)) {
        return Ok(std::sync::Arc::new(RedisStore::open(url, instance).await?));
    }
    if url == "memory:" {
        return Ok(std::sync::Arc::new(MemoryStore::default()));
    }
    let dir = url.strip_prefix("sled:").unwrap_or(url);
    Ok(std::sync::Arc::new(SledStore::open(std::path::Path::new(dir))?))
}

/// Pin record layout, little endian:
/// `[version u8][created_ms u64][last_used_ms u64][turns u32][est_tokens u64][family u128]`
/// then, from version 2, `[dialect u8][source u8]`, in version 3
/// `[went_on u32]`, then `[replica id utf-8...]`. Version 1 records (no
/// origin) still decode, as chat prefix pins; versions 1 and 2 as a
/// request's own pins (`went_on` 0). A request's own pin is still written
/// as version 2, so that an instance of an older build sharing the store
/// reads every pin but the passed boundaries' marks.
pub fn encode_pin(p: &Pin) -> Vec<u8> {
    let mut v = Vec::with_capacity(51 + p.replica.len());
    v.push(if p.went_on == 0 { 2 } else { 3 });
    v.extend_from_slice(&p.created_ms.to_le_bytes());
    v.extend_from_slice(&p.last_used_ms.to_le_bytes());
    v.extend_from_slice(&p.turns.to_le_bytes());
    v.extend_from_slice(&p.est_tokens.to_le_bytes());
    v.extend_from_slice(&p.family.to_le_bytes());
    v.push(crate::pins::dialect_to_u8(p.origin.dialect));
    v.push(p.origin.source.to_u8());
    if p.went_on > 0 {
        v.extend_from_slice(&p.went_on.to_le_bytes());
    }
    v.extend_from_slice(p.replica.as_bytes());
    v
}

pub fn decode_pin(b: &[u8]) -> Result<Pin, String> {
    decode_pin_named(b, &mut ReplicaNames::default())
}

/// The replica names a load has decoded, each allocated once: a table of
/// millions of pins names a few replicas, not one name per pin.
#[derive(Default)]
pub struct ReplicaNames(foldhash::HashSet<std::sync::Arc<str>>);

impl ReplicaNames {
    fn get(&mut self, name: &str) -> std::sync::Arc<str> {
        if let Some(known) = self.0.get(name) {
            return known.clone();
        }
        let name: std::sync::Arc<str> = name.into();
        self.0.insert(name.clone());
        name
    }
}

/// `decode_pin`, with the replica's name taken from (or added to) `names`.
pub fn decode_pin_named(b: &[u8], names: &mut ReplicaNames) -> Result<Pin, String> {
    let origin = || PinOrigin { dialect: crate::pins::dialect_from_u8(b[45]), source: PinSource::from_u8(b[46]) };
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let (origin, went_on, name_at) = match b.first() {
        Some(1) if b.len() >= 45 => (PinOrigin::default(), 0, 45),
        Some(2) if b.len() >= 47 => (origin(), 0, 47),
        Some(3) if b.len() >= 51 => (origin(), u32_at(47), 51),
        _ => return Err(format!("bad pin record ({} bytes)", b.len())),
    };
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let replica = std::str::from_utf8(&b[name_at..]).map_err(|e| format!("pin replica id: {e}"))?;
    Ok(Pin {
        created_ms: u64_at(1),
        last_used_ms: u64_at(9),
        turns: u32_at(17),
        est_tokens: u64_at(21),
        family: u128::from_le_bytes(b[29..45].try_into().expect("16 bytes")),
        replica: names.get(replica),
        origin,
        went_on,
    })
}

/// Pins are persisted in pages (schema 3): the page of a key is its top 16
/// bits, and a page value is a run of records
/// `[key u128 BE][len u16 LE][encode_pin bytes]`.
pub fn page_of(key: PrefixKey) -> [u8; 2] {
    crate::pins::page_of(key).to_be_bytes()
}

/// A page's records, in order, with each pin still encoded.
pub fn decode_page(b: &[u8]) -> Result<Vec<(PrefixKey, &[u8])>, String> {
    let mut out = Vec::new();
    let mut rest = b;
    while !rest.is_empty() {
        if rest.len() < 18 {
            return Err(format!("truncated pin page record ({} bytes left)", rest.len()));
        }
        let key = u128::from_be_bytes(rest[..16].try_into().expect("16 bytes"));
        let len = u16::from_le_bytes(rest[16..18].try_into().expect("2 bytes")) as usize;
        let record = rest.get(18..18 + len).ok_or("truncated pin record")?;
        out.push((key, record));
        rest = &rest[18 + len..];
    }
    Ok(out)
}

/// Applies `changes` (all of one page) to the page's current bytes.
pub fn merge_page(current: &[u8], changes: &[&PinChange]) -> Result<Vec<u8>, String> {
    let mut records: std::collections::BTreeMap<PrefixKey, Vec<u8>> =
        decode_page(current)?.into_iter().map(|(k, v)| (k, v.to_vec())).collect();
    for (key, pin) in changes {
        match pin {
            Some(p) => records.insert(*key, encode_pin(p)),
            None => records.remove(key),
        };
    }
    let mut out = Vec::with_capacity(records.values().map(|v| v.len() + 18).sum());
    for (key, v) in records {
        out.extend_from_slice(&key.to_be_bytes());
        out.extend_from_slice(&(v.len() as u16).to_le_bytes());
        out.extend_from_slice(&v);
    }
    Ok(out)
}

/// Test stores that wrap a `MemoryStore` in a field `inner` and change a
/// few answers: `store_over_inner!(Type { the methods it answers itself })`
/// implements `Store` with every storage method passed to `inner`.
#[cfg(test)]
macro_rules! store_over_inner {
    ($ty:ty { $($own:tt)* }) => {
        #[async_trait::async_trait]
        impl $crate::store::Store for $ty {
            async fn replicas(&self) -> Result<Vec<$crate::store::StoredReplica>, $crate::store::StoreError> {
                self.inner.replicas().await
            }
            async fn put_replica(&self, r: &$crate::store::StoredReplica) -> Result<(), $crate::store::StoreError> {
                self.inner.put_replica(r).await
            }
            async fn delete_replica(&self, id: &str) -> Result<(), $crate::store::StoreError> {
                self.inner.delete_replica(id).await
            }
            async fn pins(&self) -> Result<Vec<($crate::policy::PrefixKey, $crate::pins::Pin)>, $crate::store::StoreError> {
                self.inner.pins().await
            }
            async fn write_pins(&self, changes: &[$crate::pins::PinChange]) -> Result<(), $crate::store::StoreError> {
                self.inner.write_pins(changes).await
            }
            async fn append_event(
                &self,
                e: &$crate::events::Event,
                up_to: Option<u64>,
            ) -> Result<(), $crate::store::StoreError> {
                self.inner.append_event(e, up_to).await
            }
            async fn events(&self) -> Result<Vec<$crate::events::Event>, $crate::store::StoreError> {
                self.inner.events().await
            }
            async fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, $crate::store::StoreError> {
                self.inner.setting(key).await
            }
            async fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), $crate::store::StoreError> {
                self.inner.put_setting(key, value).await
            }
            async fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, $crate::store::StoreError> {
                self.inner.settings(prefix).await
            }
            async fn flush(&self) -> Result<(), $crate::store::StoreError> {
                Ok(())
            }
            $($own)*
        }
    };
}
#[cfg(test)]
pub(crate) use store_over_inner;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_keep_the_last_change_of_each_key() {
        let pin = |t| Pin {
            replica: "r".into(),
            created_ms: 1,
            last_used_ms: 2,
            turns: t,
            est_tokens: 3,
            family: 4,
            origin: PinOrigin::default(),
            went_on: t,
        };
        let (a, b) = ((7u128 << 112) | 1, (7u128 << 112) | 2);
        assert_eq!(page_of(a), page_of(b));
        let c1: Vec<PinChange> = vec![(a, Some(pin(1))), (b, Some(pin(2)))];
        let page = merge_page(&[], &c1.iter().collect::<Vec<_>>()).unwrap();
        let c2: Vec<PinChange> = vec![(a, None), (b, Some(pin(5)))];
        let page = merge_page(&page, &c2.iter().collect::<Vec<_>>()).unwrap();
        let decoded: Vec<(u128, Pin)> =
            decode_page(&page).unwrap().into_iter().map(|(k, v)| (k, decode_pin(v).unwrap())).collect();
        assert_eq!(decoded, vec![(b, pin(5))]);
        assert!(decode_page(&page[..page.len() - 1]).is_err());
    }

    #[test]
    fn a_load_allocates_each_replica_name_once() {
        let on = |replica: &str| {
            encode_pin(&Pin {
                replica: replica.into(),
                created_ms: 1,
                last_used_ms: 2,
                turns: 1,
                est_tokens: 3,
                family: 4,
                origin: PinOrigin::default(),
                went_on: 0,
            })
        };
        let mut names = ReplicaNames::default();
        let [a, b, c] = [on("gpu-0"), on("gpu-0"), on("gpu-1")].map(|r| decode_pin_named(&r, &mut names).unwrap());
        assert!(std::sync::Arc::ptr_eq(&a.replica, &b.replica));
        assert_eq!((&*a.replica, &*c.replica), ("gpu-0", "gpu-1"));
    }

    #[test]
    fn pins_round_trip_through_the_binary_layout() {
        let p = Pin {
            replica: "gpu-1".into(),
            created_ms: 1,
            last_used_ms: u64::MAX,
            turns: 7,
            est_tokens: 90_000,
            family: 3 << 100,
            origin: PinOrigin { dialect: crate::policy::Dialect::Responses, source: PinSource::Response },
            went_on: 0,
        };
        assert_eq!(decode_pin(&encode_pin(&p)).unwrap(), p);
        assert_eq!(encode_pin(&p)[0], 2, "a request's own pin is still written as version 2");
        let mark = Pin { went_on: 3, origin: PinOrigin { source: PinSource::Passed, ..p.origin }, ..p.clone() };
        assert_eq!(encode_pin(&mark)[0], 3);
        assert_eq!(decode_pin(&encode_pin(&mark)).unwrap(), mark);
        // A version-1 record (before origins) reads as a chat prefix pin.
        let mut v1 = encode_pin(&p);
        v1[0] = 1;
        v1.drain(45..47);
        assert_eq!(decode_pin(&v1).unwrap(), Pin { origin: PinOrigin::default(), ..p.clone() });
        assert!(decode_pin(b"{\"json\":1}").is_err());
        assert!(decode_pin(&[]).is_err());
    }
}
