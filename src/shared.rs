//! Several gateway instances, one fleet: what this instance does with the
//! changes the others announce through a shared store (`store/redis_store.rs`).
//! Each instance routes from its own in-memory copy; this keeps the copy in
//! step: pins written elsewhere are added to the local table, a replica added,
//! changed (drained, disabled, its limits) or removed elsewhere is re-read, a
//! policy switch is re-read, and other instances' events join the history.
//!
//! Consistency: read-your-writes on one instance (its own copy is changed
//! first); another instance sees a pin within the writer's
//! `pins.flush_interval_ms` plus one pub/sub hop, and an operator action
//! within one pub/sub hop (a few milliseconds on a LAN). If the listener
//! loses its connection it may miss changes, so it re-reads the replicas, the
//! policy and every pin once it is back.
//!
//! The listener holds only weak references: when the gateway is dropped, it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::admission::Admission;
use crate::capacity::Capacity;
use crate::events::EventLog;
use crate::fleet::{Fleet, Replica};
use crate::pins::PinTable;
use crate::policy::{CurrentPolicy, PolicySettings};
use crate::store::{Change, Store, StoreError};

/// What applying changes needs: the local copies, and the store to re-read.
pub struct Follower {
    pub fleet: Weak<Fleet>,
    pub pins: Weak<PinTable>,
    pub events: Weak<EventLog>,
    pub policy: Weak<CurrentPolicy>,
    pub admission: Weak<Admission>,
    pub capacity: Weak<Capacity>,
    pub store: Weak<dyn Store>,
    /// Set when the listener lost its connection: re-read everything.
    pub resync: AtomicBool,
}

impl Follower {
    /// Applies one change; false once the gateway is gone (the listener stops).
    pub fn apply(&self, change: Change) -> bool {
        let (Some(fleet), Some(pins), Some(events), Some(policy), Some(admission), Some(capacity), Some(store)) = (
            self.fleet.upgrade(),
            self.pins.upgrade(),
            self.events.upgrade(),
            self.policy.upgrade(),
            self.admission.upgrade(),
            self.capacity.upgrade(),
            self.store.upgrade(),
        ) else {
            return false;
        };
        let result = match change {
            Change::Pins { pins: changes } => {
                // Conversations that came back on another instance are part of
                // the fleet's working set here too.
                for p in changes.iter().filter_map(|(_, p)| p.as_ref()) {
                    if p.turns >= 2 && p.origin.source == crate::pins::PinSource::Prefix {
                        capacity.touch_family(&p.replica, p.family, p.est_tokens, p.last_used_ms);
                    }
                }
                pins.apply_remote(
                    changes.into_iter().filter_map(|(k, p)| Some((u128::from_str_radix(&k, 16).ok()?, p))),
                );
                Ok(())
            }
            Change::Replica { id } => reload_replica(&fleet, &pins, &admission, store.as_ref(), &id),
            Change::Setting { name } if name == "policy" => reload_policy(&policy, store.as_ref()),
            Change::Setting { .. } => Ok(()),
            Change::Event { event } => {
                events.insert_remote(event);
                Ok(())
            }
            Change::Lost => {
                self.resync.store(true, Ordering::Release);
                return true;
            }
            Change::Tick => Ok(()),
        };
        // After a lost connection (or at start), re-read everything: on the
        // next message or idle tick, whichever comes first (a busy fleet
        // may never leave the listener idle).
        let result = result.and_then(|()| {
            if self.resync.swap(false, Ordering::AcqRel) {
                resync(&fleet, &pins, &admission, &policy, store.as_ref())
            } else {
                Ok(())
            }
        });
        if let Err(e) = result {
            tracing::warn!("could not apply a change from another instance ({e}); re-reading everything soon");
            self.resync.store(true, Ordering::Release);
        }
        true
    }
}

fn reload_replica(
    fleet: &Fleet,
    pins: &PinTable,
    admission: &Admission,
    store: &dyn Store,
    id: &str,
) -> Result<(), StoreError> {
    let stored = store.replicas()?.into_iter().find(|r| r.spec.id == id);
    match (stored, fleet.get(id)) {
        (Some(s), Some(r)) => {
            let limit = s.spec.max_large_inflight;
            r.set_spec(s.spec);
            r.set_admin(s.admin);
            admission.rebalance(&r.id, limit);
        }
        (Some(s), None) => {
            fleet.add(Replica::new(s.spec, s.admin));
        }
        (None, Some(_)) => {
            fleet.remove(id);
            pins.remove_replica_pins(id, true);
        }
        (None, None) => {}
    }
    Ok(())
}

fn reload_policy(policy: &CurrentPolicy, store: &dyn Store) -> Result<(), StoreError> {
    if let Some(v) = store.setting("policy")? {
        let next: PolicySettings =
            serde_json::from_value(v).map_err(|e| StoreError::Corrupt { tree: "settings", detail: e.to_string() })?;
        policy.replace(next);
    }
    Ok(())
}

fn resync(
    fleet: &Fleet,
    pins: &PinTable,
    admission: &Admission,
    policy: &CurrentPolicy,
    store: &dyn Store,
) -> Result<(), StoreError> {
    let stored = store.replicas()?;
    if stored.is_empty() && !fleet.snapshot().is_empty() {
        // The store came back empty (a Redis restarted without persistence):
        // its loss is not an operator removing every replica. Put this
        // instance's state back instead; the flusher rewrites every pin.
        tracing::warn!("the shared store came back empty; restoring it from this instance's state");
        for r in fleet.snapshot().iter() {
            store.put_replica(&crate::store::StoredReplica { spec: (**r.spec()).clone(), admin: r.admin() })?;
        }
        store.put_setting("policy", &serde_json::to_value(policy.get()).expect("serializable"))?;
        pins.mark_all_dirty();
    } else {
        let ids: Vec<String> =
            stored.iter().map(|r| r.spec.id.clone()).chain(fleet.snapshot().iter().map(|r| r.id.to_string())).collect();
        for id in ids {
            reload_replica(fleet, pins, admission, store, &id)?;
        }
        reload_policy(policy, store)?;
    }
    // Read in both cases: an instance that reconnected first may already
    // have written its pins into the emptied store (announced before this
    // listener was back) without having restored the replicas yet.
    pins.apply_remote(store.pins()?.into_iter().map(|(k, p)| (k, Some(p))));
    tracing::info!("re-read the shared state (at start, or after the listener lost its connection)");
    Ok(())
}

/// Starts following the other instances (no-op for a store that is not shared).
pub fn follow(follower: Arc<Follower>, store: &dyn Store) -> Result<(), StoreError> {
    store.subscribe(Box::new(move |change| follower.apply(change)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{AdminState, ReplicaSpec};
    use crate::store::MemoryStore;

    /// The race `tests/shared.rs` met one run in four: another instance
    /// wrote its pins into a store that came back empty, before anyone
    /// restored the replicas; this instance's re-read must still take them.
    #[test]
    fn a_resync_against_an_emptied_store_restores_it_and_still_reads_the_pins_others_wrote() {
        let store = MemoryStore::default();
        let pin = crate::pins::Pin {
            replica: Arc::from("a"),
            created_ms: 1,
            last_used_ms: 1,
            turns: 1,
            est_tokens: 10,
            family: 7,
            origin: Default::default(),
        };
        store.write_pins(&[(7, Some(pin))]).unwrap();
        let fleet = Fleet::default();
        fleet.add(Replica::new(ReplicaSpec::new("a", "http://127.0.0.1:1"), AdminState::Active));
        let (pins, admission) = (PinTable::default(), Admission::default());
        let policy =
            CurrentPolicy::new(PolicySettings { mode: crate::policy::Mode::Shape, identity: Default::default() });
        resync(&fleet, &pins, &admission, &policy, &store).unwrap();
        assert_eq!(store.replicas().unwrap().len(), 1, "the fleet is put back");
        assert_eq!(pins.replica_of(7).as_deref(), Some("a"), "the other instance's pin is read");
    }
}
