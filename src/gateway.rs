//! The gateway's shared state and the domain operations on it. Handlers (the
//! traffic proxy and the admin API) stay thin and call in here; this is the
//! one place where fleet, pins, events and store change together.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::access::Access;
use crate::admission::Admission;
use crate::capacity::CapacityTracker;
use crate::config::Config;
use crate::error::ApiError;
use crate::events::{EventKind, EventLog};
use crate::fleet::{AdminState, Fleet, Replica, ReplicaSpec};
use crate::metrics::Metrics;
use crate::pins::PinTable;
use crate::policy::{IdentityBlocks, Mode, SpreadCounter};
use crate::store::{MemoryStore, SledStore, Store, StoreError, StoredReplica};

/// The routing settings an operator can change at runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PolicySettings {
    pub mode: Mode,
    pub identity: IdentityBlocks,
}

pub struct Gateway {
    pub config: Config,
    pub fleet: Fleet,
    pub pins: PinTable,
    pub events: EventLog,
    pub store: Arc<dyn Store>,
    pub metrics: Metrics,
    pub spread: SpreadCounter,
    pub access: Access,
    pub admission: Arc<Admission>,
    pub capacity: CapacityTracker,
    policy: RwLock<PolicySettings>,
}

impl Gateway {
    /// Opens the store (sled under `data_dir`, else memory), restores what
    /// it holds, and seeds replicas from the config when the database is new.
    ///
    /// The rule: the config's replica list seeds an empty database only;
    /// afterwards the database (changed through the admin API) is the source
    /// of truth, and replicas in the config file are ignored with a warning.
    pub fn open(config: Config) -> Result<Arc<Gateway>, StoreError> {
        let store: Arc<dyn Store> = match &config.data_dir {
            Some(dir) => Arc::new(SledStore::open(dir)?),
            None => Arc::new(MemoryStore::default()),
        };
        Gateway::with_store(config, store)
    }

    pub fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Arc<Gateway>, StoreError> {
        let fleet = Fleet::default();
        let stored = store.replicas()?;
        if store.is_new() {
            for spec in &config.replicas {
                let r = StoredReplica { spec: spec.clone(), admin: AdminState::Active };
                store.put_replica(&r)?;
                fleet.add(Replica::new(r.spec, r.admin));
            }
        } else {
            if !config.replicas.is_empty() {
                tracing::warn!(
                    "the database already lists replicas; the {} replica(s) in the config are ignored \
                     (manage replicas through the admin API)",
                    config.replicas.len()
                );
            }
            for r in stored {
                fleet.add(Replica::new(r.spec, r.admin));
            }
        }
        let policy = match store.setting("policy")? {
            Some(v) => serde_json::from_value(v)
                .map_err(|e| StoreError::Corrupt { tree: "settings", detail: e.to_string() })?,
            None => PolicySettings { mode: config.policy, identity: config.identity },
        };
        let pins = PinTable::default();
        pins.restore(store.pins()?);
        let events = EventLog::new(config.pins.max_events, Some(store.clone()), store.events()?);
        Ok(Arc::new(Gateway {
            metrics: Metrics::new(),
            access: Access::new(&config),
            admission: Arc::new(Admission::default()),
            capacity: CapacityTracker::default(),
            config,
            fleet,
            pins,
            events,
            store,
            spread: SpreadCounter::default(),
            policy: RwLock::new(policy),
        }))
    }

    pub fn policy(&self) -> PolicySettings {
        *self.policy.read().expect("policy lock")
    }

    pub fn set_policy(&self, next: PolicySettings) -> Result<(), ApiError> {
        if next.identity.block_bytes == 0 || next.identity.block_tokens == 0 {
            return Err(ApiError::Unprocessable("identity block sizes must be at least 1".into()));
        }
        let prev = std::mem::replace(&mut *self.policy.write().expect("policy lock"), next);
        self.store.put_setting("policy", &serde_json::to_value(next).expect("serializable")).map_err(internal)?;
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
        Ok(())
    }

    pub fn replica(&self, id: &str) -> Result<Arc<Replica>, ApiError> {
        self.fleet.get(id).ok_or_else(|| ApiError::NotFound(format!("no replica with id '{id}'")))
    }

    fn persist(&self, r: &Replica) -> Result<(), ApiError> {
        self.store.put_replica(&StoredReplica { spec: (*r.spec()).clone(), admin: r.admin() }).map_err(internal)
    }

    pub fn add_replica(&self, spec: ReplicaSpec) -> Result<Arc<Replica>, ApiError> {
        spec.validate().map_err(ApiError::Unprocessable)?;
        let id = spec.id.clone();
        if !self.fleet.add(Replica::new(spec, AdminState::Active)) {
            return Err(ApiError::Conflict(format!("a replica with id '{id}' already exists")));
        }
        let r = self.replica(&id)?;
        self.persist(&r)?;
        self.events.record(EventKind::ReplicaAdded, Some(&id), None, r.spec().url.clone());
        Ok(r)
    }

    pub fn update_replica(&self, spec: ReplicaSpec) -> Result<Arc<Replica>, ApiError> {
        spec.validate().map_err(ApiError::Unprocessable)?;
        let r = self.replica(&spec.id)?;
        let url = spec.url.clone();
        r.set_spec(spec);
        self.persist(&r)?;
        self.events.record(EventKind::ReplicaUpdated, Some(&r.id), None, url);
        Ok(r)
    }

    pub fn remove_replica(&self, id: &str) -> Result<(), ApiError> {
        self.fleet.remove(id).ok_or_else(|| ApiError::NotFound(format!("no replica with id '{id}'")))?;
        self.store.delete_replica(id).map_err(internal)?;
        let pins = self.pins.remove_replica(id);
        self.events.record(EventKind::ReplicaRemoved, Some(id), None, format!("{pins} pin(s) dropped"));
        Ok(())
    }

    /// Changes the operator's state of a replica and records the event.
    pub fn set_admin(&self, id: &str, next: AdminState) -> Result<Arc<Replica>, ApiError> {
        let r = self.replica(id)?;
        let prev = r.set_admin(next);
        self.persist(&r)?;
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

    /// Waits until a draining replica has nothing in flight.
    pub async fn wait_drained(&self, r: &Replica, timeout: Duration) -> Result<(), ApiError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if r.admin() != AdminState::Draining {
                return Err(ApiError::Conflict(format!("replica '{}' is no longer draining", r.id)));
            }
            if r.inflight() == 0 {
                self.events.record(EventKind::DrainCompleted, Some(&r.id), None, "nothing in flight");
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::Timeout(format!(
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

    /// Writes dirty pins in one batch and makes them durable; called by the
    /// flusher and at shutdown. The explicit flush matters: sled otherwise
    /// keeps writes in memory for up to 500 ms, and a `kill -9` would lose
    /// pins older than our own flush interval.
    pub fn flush_pins(&self) -> Result<usize, StoreError> {
        let changes = self.pins.take_dirty();
        if !changes.is_empty() {
            self.store.write_pins(&changes)?;
            self.store.flush()?;
        }
        Ok(changes.len())
    }

    /// Graceful shutdown's last step: everything to disk.
    pub fn flush_all(&self) -> Result<(), StoreError> {
        self.flush_pins()?;
        self.store.flush()
    }
}

fn internal(e: StoreError) -> ApiError {
    ApiError::Internal(e.to_string())
}
