//! An in-memory store: the same contract as sled, nothing survives the process.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::{Store, StoreError, StoredReplica};
use crate::events::Event;
use crate::pins::{Pin, PinChange};
use crate::policy::PrefixKey;

#[derive(Default)]
pub struct MemoryStore {
    replicas: Mutex<BTreeMap<String, StoredReplica>>,
    pins: Mutex<HashMap<PrefixKey, Pin>>,
    events: Mutex<BTreeMap<u64, Event>>,
    settings: Mutex<HashMap<String, serde_json::Value>>,
    /// Reads of the whole replica list (a resync must read it once).
    replica_reads: std::sync::atomic::AtomicU64,
    /// Events are not kept (see `history_elsewhere`).
    skip_events: bool,
}

impl MemoryStore {
    /// The store of a gateway that persists nothing (no data dir, no store
    /// URL): events are not kept here, since the gateway's in-memory history
    /// (`events.rs`) is their only reader and nothing here outlives the
    /// process. A second copy doubled the history's memory.
    pub fn history_elsewhere() -> MemoryStore {
        MemoryStore { skip_events: true, ..MemoryStore::default() }
    }

    /// How many times the whole replica list was read.
    pub fn replica_reads(&self) -> u64 {
        self.replica_reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn is_new(&self) -> bool {
        self.replicas.lock().expect("lock").is_empty()
    }
    async fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        self.replica_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.replicas.lock().expect("lock").values().cloned().collect())
    }
    async fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        self.replicas.lock().expect("lock").insert(r.spec.id.clone(), r.clone());
        Ok(())
    }
    async fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        self.replicas.lock().expect("lock").remove(id);
        Ok(())
    }
    async fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        Ok(self.pins.lock().expect("lock").iter().map(|(k, p)| (*k, p.clone())).collect())
    }
    async fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        let mut pins = self.pins.lock().expect("lock");
        for (k, p) in changes {
            match p {
                Some(p) => pins.insert(*k, p.clone()),
                None => pins.remove(k),
            };
        }
        Ok(())
    }
    async fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        if self.skip_events {
            return Ok(());
        }
        let mut events = self.events.lock().expect("lock");
        events.insert(e.id, e.clone());
        if let Some(upto) = dropped_up_to {
            events.retain(|id, _| *id > upto);
        }
        Ok(())
    }
    async fn events(&self) -> Result<Vec<Event>, StoreError> {
        Ok(self.events.lock().expect("lock").values().cloned().collect())
    }
    async fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, StoreError> {
        Ok(self.settings.lock().expect("lock").get(key).cloned())
    }
    async fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), StoreError> {
        self.settings.lock().expect("lock").insert(key.to_string(), value.clone());
        Ok(())
    }
    async fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let settings = self.settings.lock().expect("lock");
        Ok(settings.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(k, v)| (k.clone(), v.clone())).collect())
    }
    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
