//! Operator actions: every change an operator makes to the fleet, the pins
//! or the policy goes through here, in one order: validate, persist, apply,
//! record the event. Persisting first means a store failure answers 500 with
//! nothing changed in memory, instead of a gateway that routes by a state it
//! will forget at the next restart. Admin handlers only translate HTTP.
//!
//! Actions are serialized by one lock (they are rare), so two concurrent
//! PATCHes cannot persist in one order and apply in the other.
//!
//! Discovered replicas (`discovered.rs`) belong to their source, not to the
//! store: the source adds, changes and removes them on each instance; the
//! operator's drain or disable of one is kept by name in the store, shared
//! with the other instances, and outlives the replica's absence.

mod discovered;

pub use discovered::{read_discovered_admin, NotApplied};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use utoipa::ToSchema;

use crate::domain_error::DomainError;
use crate::events::{EventKind, EventLog};
use crate::fleet::{normalize_url, validate_url, AdminState, Fleet, Replica, ReplicaSource, ReplicaSpec, ReplicaUrl};
use crate::pins::{PinChange, PinSource, PinTable};
use crate::policy::{CurrentPolicy, PolicySettings, PrefixKey};
use crate::sessions::Heard;
use crate::store::{Store, StoreError, StoredReplica};

/// A heartbeat older than this is a dead instance (beats come every flush interval).
pub const INSTANCE_TIMEOUT_MS: u64 = 2_000;

/// Fields to change on a replica; absent fields keep their value.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"max_large_inflight": 2}))]
pub struct ReplicaPatch {
    pub url: Option<ReplicaUrl>,
    /// Sets the upstream API key (write-only; empty changes nothing).
    #[schema(schema_with = crate::fleet::api_key_schema)]
    pub api_key: Option<String>,
    /// Removes the upstream API key.
    #[serde(default)]
    pub clear_api_key: bool,
    #[schema(schema_with = crate::fleet::health_path_schema)]
    pub health_path: Option<String>,
    #[serde(default, deserialize_with = "crate::json_int::opt_int32")]
    #[schema(minimum = 0, maximum = 2147483647)]
    pub max_large_inflight: Option<u32>,
    #[serde(default)]
    pub clear_max_large_inflight: bool,
    #[serde(default, deserialize_with = "crate::json_int::opt_int64")]
    #[schema(minimum = 0, maximum = 9223372036854775807_i64)]
    pub kv_tokens: Option<u64>,
}

impl ReplicaPatch {
    fn apply_to(self, mut spec: ReplicaSpec) -> ReplicaSpec {
        if let Some(url) = self.url {
            spec.url = normalize_url(&url.0);
        }
        if self.clear_api_key {
            spec.api_key = None;
        }
        if let Some(k) = self.api_key.filter(|k| !k.is_empty()) {
            spec.api_key = Some(k);
        }
        if let Some(h) = self.health_path {
            spec.health_path = Some(h);
        }
        if self.clear_max_large_inflight {
            spec.max_large_inflight = None;
        }
        if let Some(m) = self.max_large_inflight {
            spec.max_large_inflight = Some(m);
        }
        if let Some(k) = self.kv_tokens {
            spec.kv_tokens = Some(k);
        }
        spec
    }
}

/// The handles operator actions change, and the lock that serializes them.
pub struct Operator {
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) pins: Arc<PinTable>,
    pub(crate) events: Arc<EventLog>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policy: Arc<CurrentPolicy>,
    /// Sessions resident on each replica: they leave with it.
    pub(crate) sessions: Arc<crate::sessions::Sessions>,
    /// The operator's state of discovered replicas, by name (`discovered.rs`).
    pub(crate) discovered_admin: Mutex<discovered::AdminByName>,
    pub(crate) serial: tokio::sync::Mutex<()>,
}

fn internal(e: StoreError) -> DomainError {
    DomainError::Store(e.to_string())
}

fn not_found(id: &str) -> DomainError {
    DomainError::NotFound(format!("no replica with id '{id}'"))
}

/// A discovered replica's spec and presence are its source's: 409 with what to do instead.
fn owned_by_source(r: &Replica, instead: &str) -> Result<(), DomainError> {
    match &r.source {
        ReplicaSource::Discovered(label) => Err(DomainError::Conflict(format!(
            "replica '{}' was found by the discovery source {label} and belongs to it: {instead}",
            r.id
        ))),
        _ => Ok(()),
    }
}

impl Operator {
    /// An operator over empty components and `store`, for unit tests.
    #[cfg(test)]
    pub(crate) fn for_tests(store: Arc<dyn Store>) -> Operator {
        let (events, _writer) = EventLog::new(100, 100, store.instance(), Vec::new());
        let policy = PolicySettings { mode: crate::policy::Mode::Shape, identity: Default::default() };
        Operator {
            fleet: Arc::default(),
            pins: Arc::default(),
            events: Arc::new(events),
            store,
            policy: Arc::new(CurrentPolicy::new(policy)),
            sessions: crate::sessions::Sessions::new(Default::default()),
            discovered_admin: Default::default(),
            serial: Default::default(),
        }
    }

    /// Held across the store write an action makes: an async lock, so a
    /// slow store holds the actions in line and never a runtime worker.
    async fn serial(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.serial.lock().await
    }

    pub fn replica(&self, id: &str) -> Result<Arc<Replica>, DomainError> {
        self.fleet.get(id).ok_or_else(|| not_found(id))
    }

    pub async fn set_policy(&self, next: PolicySettings) -> Result<PolicySettings, DomainError> {
        next.validate().map_err(DomainError::Invalid)?;
        let _serial = self.serial().await;
        self.store.put_setting("policy", &serde_json::to_value(next).expect("serializable")).await.map_err(internal)?;
        let prev = self.policy.replace(next);
        if prev != next {
            self.events.record(
                EventKind::PolicyChanged,
                None,
                None,
                format!(
                    "mode {} -> {}, blocks {}B/{}t -> {}B/{}t",
                    prev.mode.as_str(),
                    next.mode.as_str(),
                    prev.identity.block_bytes,
                    prev.identity.block_tokens,
                    next.identity.block_bytes,
                    next.identity.block_tokens
                ),
            );
        }
        Ok(next)
    }

    pub async fn add_replica(&self, spec: ReplicaSpec) -> Result<Arc<Replica>, DomainError> {
        spec.validate().map_err(DomainError::Invalid)?;
        let _serial = self.serial().await;
        if self.fleet.get(&spec.id).is_some() {
            return Err(DomainError::Conflict(format!("a replica with id '{}' already exists", spec.id)));
        }
        let stored = StoredReplica { spec, admin: AdminState::Active, source: ReplicaSource::Api };
        self.store.put_replica(&stored).await.map_err(internal)?;
        let (id, url) = (stored.spec.id.clone(), stored.spec.url.clone());
        self.apply_replica(&id, Some(stored));
        self.events.record(EventKind::ReplicaAdded, Some(&id), None, url);
        self.replica(&id)
    }

    /// Merges `patch` into the replica's spec. A raised `max_large_inflight`
    /// hands the new slots to requests already waiting.
    pub async fn update_replica(&self, id: &str, patch: ReplicaPatch) -> Result<Arc<Replica>, DomainError> {
        if let Some(url) = &patch.url {
            validate_url(&url.0).map_err(DomainError::Invalid)?;
        }
        let _serial = self.serial().await;
        let r = self.replica(id)?;
        owned_by_source(&r, "change it in its source")?;
        let spec = patch.apply_to((**r.spec()).clone());
        spec.validate().map_err(DomainError::Invalid)?;
        let url = spec.url.clone();
        let stored = StoredReplica { spec, admin: r.admin(), source: r.source.clone() };
        self.store.put_replica(&stored).await.map_err(internal)?;
        self.apply_replica(id, Some(stored));
        self.events.record(EventKind::ReplicaUpdated, Some(&r.id), None, url);
        Ok(r)
    }

    pub async fn remove_replica(&self, id: &str) -> Result<(), DomainError> {
        let _serial = self.serial().await;
        owned_by_source(&*self.replica(id)?, "disable it, or change the source")?;
        self.store.delete_replica(id).await.map_err(internal)?;
        let pins = match self.apply_replica(id, None) {
            Applied::Removed { pins } => pins,
            _ => 0,
        };
        self.events.record(EventKind::ReplicaRemoved, Some(id), None, format!("{pins} pin(s) dropped"));
        Ok(())
    }

    /// Makes this instance's copy of replica `id` what the store holds
    /// (`None`: removed). The one place a replica's state is applied: by
    /// the actions above once persisted, and by `shared.rs` for the changes
    /// other instances made. Records no event (the instance that acted did).
    pub(crate) fn apply_replica(&self, id: &str, stored: Option<StoredReplica>) -> Applied {
        match (stored, self.fleet.get(id)) {
            // Its source owns it here; a stored replica of the same name
            // (added on an instance that did not find it) does not replace it.
            (_, Some(r)) if r.source.is_discovered() => Applied::Nothing,
            (Some(s), Some(r)) => {
                let limit = s.spec.max_large_inflight;
                r.set_spec(s.spec);
                let was = r.set_admin(s.admin);
                r.large_slots.rebalance(limit);
                Applied::Changed { was }
            }
            (Some(s), None) => {
                self.fleet.add(Replica::from_source(s.spec, s.admin, s.source));
                Applied::Added
            }
            (None, Some(_)) => Applied::Removed { pins: self.forget_replica(id) },
            (None, None) => Applied::Nothing,
        }
    }

    /// Takes replica `id` out of the fleet with everything kept about it.
    /// What is kept per replica (calibration, capacity figures and warning,
    /// working set, admission slots, resident sessions, counters) lives on
    /// its record, `fleet::Replica`: dropping the record is the removal, and
    /// a request still in flight keeps it only until it ends. Besides the
    /// record: its pins and interned name (the pin table's own index, by
    /// design). Its metric series are listed on the record and leave the
    /// exposition as it leaves the fleet (`Fleet::remove`).
    /// Returns how many pins went. A follow-up naming a response the
    /// replica stored must hear that its replica is gone: those pins stay
    /// (see `PinTable`) until they expire, and the name with them.
    ///
    /// The one removal path: an operator's, a source's, and another
    /// instance's removal all come here, so nothing kept per replica
    /// outlives it (a fleet whose pods return under new names runs for months).
    pub(crate) fn forget_replica(&self, id: &str) -> usize {
        self.fleet.remove(id);
        self.pins.remove_replica_pins(id, true)
    }

    /// Re-reads replica `id` from the store and applies it (another
    /// instance changed it), under the same lock as local actions.
    pub(crate) async fn reload_replica(&self, id: &str) -> Result<Applied, StoreError> {
        let _serial = self.serial().await;
        let stored = self.store.replicas().await?.into_iter().find(|r| r.spec.id == id);
        Ok(self.apply_replica(id, stored))
    }

    /// Makes this instance's replicas what the store's whole list says (a
    /// resync at start or after a lost connection), the list read once and
    /// applied under the same lock as local actions: an action cannot land
    /// between the read and the apply and be undone by a stale list.
    /// Replicas here that the list lacks were removed elsewhere. A store that
    /// came back empty while this instance has replicas lost its data (a
    /// Redis restarted without persistence): its replicas are put back
    /// instead, and true says so.
    pub(crate) async fn resync_replicas(&self) -> Result<bool, StoreError> {
        let _serial = self.serial().await;
        let stored = self.store.replicas().await?;
        let fleet = self.fleet.snapshot_owned();
        if stored.is_empty() && !fleet.is_empty() {
            tracing::warn!("the shared store came back empty; restoring it from this instance's state");
            let all: Vec<StoredReplica> = fleet
                .iter()
                .filter(|r| !r.source.is_discovered())
                .map(|r| StoredReplica { spec: (**r.spec()).clone(), admin: r.admin(), source: r.source.clone() })
                .collect();
            self.store.restore_replicas(&all).await?;
            return Ok(true);
        }
        let mut stored: std::collections::BTreeMap<String, StoredReplica> =
            stored.into_iter().map(|r| (r.spec.id.clone(), r)).collect();
        for r in fleet.iter() {
            let s = stored.remove(&*r.id);
            self.apply_replica(&r.id, s);
        }
        for (id, s) in stored {
            self.apply_replica(&id, Some(s));
        }
        Ok(false)
    }

    /// Re-reads the policy from the store and applies it, under the lock a
    /// local change takes (a stale read applied after it would undo it).
    pub(crate) async fn reload_policy(&self) -> Result<(), StoreError> {
        let _serial = self.serial().await;
        if let Some(v) = self.store.setting("policy").await? {
            let next: PolicySettings = serde_json::from_value(v)
                .map_err(|e| StoreError::Corrupt { tree: "settings", detail: e.to_string() })?;
            self.policy.replace(next);
        }
        Ok(())
    }

    /// Pins read back from the store (at a start, or a resync after a lost
    /// connection): applied as pins only. Sessions are not made resident
    /// from them: a read-back pin says where a session was, not that it is
    /// alive. Those that ended on an instance that stopped (a rolling
    /// restart's new instances read the stopped ones' pins) would hold a
    /// phantom room here for `ELSEWHERE_FACTOR` x `idle_ms`, and their
    /// release was announced before this instance listened. The room of
    /// the live ones is in the store's loads, which placement reads; each
    /// becomes resident here at its next turn's announcement.
    pub(crate) fn restore_pins(&self, changes: impl IntoIterator<Item = PinChange>) {
        self.pins.apply(changes.into_iter().collect::<Vec<_>>());
    }

    /// Applies pin changes that are in the store already (not marked dirty):
    /// another instance's, or an operator's deletion once persisted.
    pub(crate) fn apply_pins(&self, changes: impl IntoIterator<Item = PinChange>) {
        let changes: Vec<PinChange> = changes.into_iter().collect();
        // A pin to a replica this instance does not have changes nothing.
        for p in changes.iter().filter_map(|(_, p)| p.as_ref()) {
            let Some(r) = self.fleet.get(&p.replica) else { continue };
            // Residency is the fleet's view: a conversation that came back,
            // or one named by a session key, lives where its pin says (and
            // is part of the fleet's working set here too).
            // A passed boundary's mark says nothing of the turn (its request's own pin does).
            let turn = p.origin.source != PinSource::Passed && p.turns >= 2;
            if turn || matches!(p.origin.source, PinSource::PromptCacheKey | PinSource::SessionHeader) {
                // A session's id is its family (a session key's pin is its own family).
                let heard = Heard::from_pins(p, self.pins.get(p.family).as_ref());
                self.sessions.seen_elsewhere(&r, p.family, heard);
            }
        }
        self.pins.apply(changes);
    }

    pub async fn drain(&self, id: &str) -> Result<Arc<Replica>, DomainError> {
        self.set_admin(id, AdminState::Draining).await
    }

    /// Undoes a drain. A disabled replica stays disabled: that takes `enable`.
    pub async fn resume(&self, id: &str) -> Result<Arc<Replica>, DomainError> {
        if self.replica(id)?.admin() == AdminState::Disabled {
            return Err(DomainError::Conflict(format!("replica '{id}' is disabled; use enable")));
        }
        self.set_admin(id, AdminState::Active).await
    }

    pub async fn disable(&self, id: &str) -> Result<Arc<Replica>, DomainError> {
        self.set_admin(id, AdminState::Disabled).await
    }

    pub async fn enable(&self, id: &str) -> Result<Arc<Replica>, DomainError> {
        self.set_admin(id, AdminState::Active).await
    }

    /// Changes the operator's state of a replica and records the event.
    pub async fn set_admin(&self, id: &str, next: AdminState) -> Result<Arc<Replica>, DomainError> {
        let _serial = self.serial().await;
        let r = self.replica(id)?;
        let prev = if r.source.is_discovered() {
            self.set_discovered_admin(&r, next).await?
        } else {
            let stored = StoredReplica { spec: (**r.spec()).clone(), admin: next, source: r.source.clone() };
            self.store.put_replica(&stored).await.map_err(internal)?;
            match self.apply_replica(id, Some(stored)) {
                Applied::Changed { was } => was,
                _ => next,
            }
        };
        if prev != next {
            let kind = match (prev, next) {
                (_, AdminState::Draining) => EventKind::DrainStarted,
                (_, AdminState::Disabled) => EventKind::Disabled,
                (AdminState::Disabled, AdminState::Active) => EventKind::Enabled,
                (_, AdminState::Active) => EventKind::Resumed,
            };
            self.events.record(kind, Some(id), None, format!("{} in flight", r.inflight()));
        }
        Ok(r)
    }

    /// Requests other live gateway instances have in flight on `replica`,
    /// from their heartbeats (a shared store; zero otherwise). A beat older
    /// than `INSTANCE_TIMEOUT_MS` is a dead instance and counts for nothing.
    /// A live instance whose last beat predates `since_ms` has not reported
    /// since the drain began (a request it started just before would not be
    /// in that beat yet): it counts as busy until it does.
    async fn inflight_elsewhere(&self, replica: &str, since_ms: u64) -> i64 {
        let Some(me) = self.store.instance().map(str::to_string) else { return 0 };
        let beats = self.store.instances().await;
        let now = crate::clock::now_ms();
        match beats {
            Ok(beats) => beats
                .iter()
                .filter(|b| b.instance != me && now.saturating_sub(b.at_ms) <= INSTANCE_TIMEOUT_MS)
                .map(|b| if b.at_ms < since_ms { 1 } else { b.inflight.get(replica).copied().unwrap_or(0) })
                .sum(),
            // Unknown is not zero: keep waiting until the store answers.
            _ => 1,
        }
    }

    /// Waits until a draining replica has nothing in flight, on this
    /// instance and (with a shared store) on every live instance.
    pub async fn wait_drained(&self, r: &Replica, timeout: Duration) -> Result<(), DomainError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Beats must postdate the drain by a pub/sub hop to count (see `inflight_elsewhere`).
        let since_ms = crate::clock::now_ms() + 100;
        loop {
            if r.admin() != AdminState::Draining {
                return Err(DomainError::Conflict(format!("replica '{}' is no longer draining", r.id)));
            }
            if r.inflight() == 0 && self.inflight_elsewhere(&r.id, since_ms).await == 0 {
                self.events.record(EventKind::DrainCompleted, Some(&r.id), None, "nothing in flight");
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(DomainError::Timeout(format!(
                    "replica '{}' still has {} request(s) in flight after {} s",
                    r.id,
                    r.inflight(),
                    timeout.as_secs()
                )));
            }
            // Polling at 50 ms is plenty for an operator script and costs nothing.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Deletes one pin: persisted first, as every operator action is.
    pub async fn delete_pin(&self, key: PrefixKey) -> Result<(), DomainError> {
        let _serial = self.serial().await;
        let Some(replica) = self.pins.replica_of(key) else {
            return Err(DomainError::NotFound(format!("no pin {key:032x}")));
        };
        self.store.write_pins(&[(key, None)]).await.map_err(internal)?;
        self.apply_pins([(key, None)]);
        self.events.record(EventKind::PinsDeleted, Some(&replica), None, format!("pin {key:032x} deleted"));
        Ok(())
    }

    /// Deletes every pin a replica holds (persisted first); returns how many.
    pub async fn delete_replica_pins(&self, id: &str) -> Result<usize, DomainError> {
        let _serial = self.serial().await;
        self.replica(id)?;
        // Off the workers: after a start it may first read the pages still on disk.
        let (pins, replica) = (self.pins.clone(), id.to_string());
        let keys = tokio::task::spawn_blocking(move || pins.keys_of(&replica))
            .await
            .map_err(|e| DomainError::Store(format!("listing the replica's pins failed: {e}")))?;
        let deleted: Vec<PinChange> = keys.into_iter().map(|k| (k, None)).collect();
        self.store.write_pins(&deleted).await.map_err(internal)?;
        self.apply_pins(deleted.iter().cloned());
        if let Some(r) = self.fleet.get(id) {
            r.capacity.forget();
            r.residents.forget_ended();
        }
        let n = deleted.len();
        self.events.record(EventKind::PinsDeleted, Some(id), None, format!("{n} pin(s) deleted"));
        Ok(n)
    }
}

/// What applying a replica's stored state did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applied {
    Added,
    /// Changed in place; `was` is the operator state before.
    Changed {
        was: AdminState,
    },
    Removed {
        pins: usize,
    },
    Nothing,
}
