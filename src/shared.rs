//! Several gateway instances, one fleet: what this instance does with the
//! changes the others announce through a shared store (`store/redis_store.rs`).
//! Each instance routes from its own in-memory copy; this keeps the copy in
//! step: pins written elsewhere are added to the local table, a replica added,
//! changed (drained, disabled, its limits) or removed elsewhere is re-read, a
//! policy switch is re-read, and other instances' events join the history.
//! Every change is applied by the operator's own apply path
//! (`Operator::apply_replica`, `apply_pins`): a change from another instance
//! does exactly what the same local action does after persisting it.
//!
//! Consistency: read-your-writes on one instance (its own copy is changed
//! first); another instance knows a new pin one pub/sub hop after it exists
//! (announced at once, `announce.rs`; persisted later in the flusher's
//! batch), and an operator action one pub/sub hop after it was persisted. A
//! stored response id that arrives before its announcement is found by
//! asking (`proxy/locate.rs`). If the listener loses its connection it may
//! miss changes, so it re-reads the replicas, the policy and every pin once
//! it is back.
//!
//! The listener holds only weak references: when the gateway is dropped, it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::metrics::Metrics;
use crate::operator::Operator;
use crate::store::{Change, Store, StoreError};

/// What applying changes needs: the operator (whose apply path is the one
/// every change takes, and whose history other instances' events join),
/// and where to count propagation delays.
pub struct Follower {
    pub operator: Weak<Operator>,
    pub metrics: Weak<Metrics>,
    /// Set when the listener lost its connection: re-read everything.
    pub resync: AtomicBool,
}

impl Follower {
    /// Applies one change; false once the gateway is gone (the listener stops).
    pub async fn apply(&self, change: Change) -> bool {
        let (Some(operator), Some(metrics)) = (self.operator.upgrade(), self.metrics.upgrade()) else {
            return false;
        };
        let result = match change {
            Change::Pins { pins, sent_us } => {
                operator
                    .apply_pins(pins.into_iter().filter_map(|(k, p)| Some((u128::from_str_radix(&k, 16).ok()?, p))));
                observe_propagation(&metrics, sent_us);
                Ok(())
            }
            Change::Replica { id } => operator.reload_replica(&id).await.map(|_| ()),
            Change::Setting { name } if name == "policy" => operator.reload_policy().await,
            Change::Setting { name } if name.starts_with(crate::store::DISCOVERED_ADMIN_PREFIX) => {
                operator.reload_discovered_admin_of(&name[crate::store::DISCOVERED_ADMIN_PREFIX.len()..]).await
            }
            Change::Setting { .. } => Ok(()),
            Change::Event { event } => {
                operator.events.insert_remote(event);
                Ok(())
            }
            Change::SessionsReleased { sessions, sent_us } => {
                crate::sessions::sync::released_elsewhere(&operator.sessions, &sessions);
                observe_propagation(&metrics, sent_us);
                Ok(())
            }
            Change::HandOff { replica } => {
                if let Some(r) = operator.fleet.get(&replica) {
                    r.hand_off();
                }
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
        let result = match result {
            Ok(()) if self.resync.swap(false, Ordering::AcqRel) => resync(&operator).await,
            other => other,
        };
        if let Err(e) = result {
            tracing::warn!("could not apply a change from another instance ({e}); re-reading everything soon");
            self.resync.store(true, Ordering::Release);
        }
        true
    }
}

/// The delay from another instance announcing a change (`sent_us`; 0 from
/// an older instance: unknown) to this one applying it.
fn observe_propagation(metrics: &Metrics, sent_us: u64) {
    if sent_us > 0 {
        let delay = crate::store::now_us().saturating_sub(sent_us);
        metrics.propagation.observe(delay as f64 / 1e6);
    }
}

async fn resync(operator: &Operator) -> Result<(), StoreError> {
    if operator.resync_replicas().await? {
        // The store came back empty: the rest of this instance's state goes
        // back too; the flusher rewrites every pin.
        operator.persist_discovered_admin().await?;
        let policy = serde_json::to_value(operator.policy.get()).expect("serializable");
        operator.store.put_setting("policy", &policy).await?;
        operator.pins.mark_all_dirty();
    } else {
        operator.reload_policy().await?;
        operator.reload_discovered_admin().await?;
    }
    // Read in both cases: an instance that reconnected first may already
    // have written its pins into the emptied store (announced before this
    // listener was back) without having restored the replicas yet.
    operator.restore_pins(operator.store.pins().await?.into_iter().map(|(k, p)| (k, Some(p))));
    tracing::info!("re-read the shared state (at start, or after the listener lost its connection)");
    Ok(())
}

/// Starts following the other instances (no-op for a store that is not
/// shared): a task applies each change the store's listener hears, until the
/// gateway is gone.
pub fn follow(follower: Arc<Follower>, store: &dyn Store) {
    let (Some(mut changes), Some(runtime)) = (store.subscribe(), store.runtime()) else { return };
    runtime.spawn(async move {
        while let Some(change) = changes.recv().await {
            if !follower.apply(change).await {
                return;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{AdminState, Replica, ReplicaSpec};
    use crate::store::MemoryStore;

    /// The race `tests/it/shared.rs` met one run in four: another instance
    /// wrote its pins into a store that came back empty, before anyone
    /// restored the replicas; this instance's re-read must still take them.
    #[tokio::test]
    async fn a_resync_against_an_emptied_store_restores_it_and_still_reads_the_pins_others_wrote() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
        let pin = crate::pins::Pin {
            replica: Arc::from("a"),
            created_ms: 1,
            last_used_ms: 1,
            turns: 1,
            est_tokens: 10,
            family: 7,
            origin: Default::default(),
            went_on: 0,
        };
        store.write_pins(&[(7, Some(pin))]).await.unwrap();
        let operator = Operator::for_tests(store.clone());
        operator.fleet.add(Replica::new(ReplicaSpec::new("a", "http://127.0.0.1:1"), AdminState::Active));
        resync(&operator).await.unwrap();
        assert_eq!(store.replicas().await.unwrap().len(), 1, "the fleet is put back");
        assert_eq!(operator.pins.replica_of(7).as_deref(), Some("a"), "the other instance's pin is read");
    }

    /// A resync reads the replica list once, whatever the fleet's size, and
    /// applies it whole: added, changed and removed elsewhere.
    #[tokio::test]
    async fn a_resync_reads_the_replica_list_once() {
        let memory = Arc::new(MemoryStore::default());
        let store: Arc<dyn Store> = memory.clone();
        let operator = Operator::for_tests(store.clone());
        for i in 0..20 {
            let spec = ReplicaSpec::new(&format!("r{i}"), "http://127.0.0.1:1");
            operator.fleet.add(Replica::new(spec.clone(), AdminState::Active));
            if i != 3 {
                let admin = if i == 5 { AdminState::Disabled } else { AdminState::Active };
                store
                    .put_replica(&crate::store::StoredReplica { spec, admin, source: Default::default() })
                    .await
                    .unwrap();
            }
        }
        let added = ReplicaSpec::new("new", "http://127.0.0.1:2");
        store
            .put_replica(&crate::store::StoredReplica {
                spec: added,
                admin: AdminState::Active,
                source: Default::default(),
            })
            .await
            .unwrap();
        let before = memory.replica_reads();
        resync(&operator).await.unwrap();
        assert_eq!(memory.replica_reads() - before, 1);
        assert!(operator.fleet.get("r3").is_none(), "removed elsewhere");
        assert_eq!(operator.fleet.get("r5").unwrap().admin(), AdminState::Disabled, "changed elsewhere");
        assert!(operator.fleet.get("new").is_some(), "added elsewhere");
        assert_eq!(operator.fleet.snapshot().len(), 20);
    }

    /// A replica removed on another instance is removed here exactly as a
    /// local removal does it: out of the fleet, its pins and its capacity
    /// state forgotten (a remote removal used to keep the capacity state).
    #[tokio::test]
    async fn a_removal_from_another_instance_forgets_what_a_local_one_forgets() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
        let (local, remote) = (Operator::for_tests(store.clone()), Operator::for_tests(store.clone()));
        let mut records = Vec::new();
        for op in [&local, &remote] {
            op.fleet.add(Replica::new(ReplicaSpec::new("a", "http://127.0.0.1:1"), AdminState::Active));
            op.pins.record(9, &Arc::from("a"), None, 10, 1, Default::default());
            let r = op.fleet.get("a").unwrap();
            r.residents.remember(9, 10_000, crate::clock::now_ms());
            assert_eq!(r.residents.working_set(0).len(), 1);
            records.push(Arc::downgrade(&r));
        }
        store
            .put_replica(&crate::store::StoredReplica {
                spec: ReplicaSpec::new("a", "http://127.0.0.1:1"),
                admin: AdminState::Active,
                source: Default::default(),
            })
            .await
            .unwrap();
        local.remove_replica("a").await.unwrap();
        remote.reload_replica("a").await.unwrap();
        for (op, record) in [&local, &remote].into_iter().zip(records) {
            assert!(op.fleet.get("a").is_none());
            assert_eq!(op.pins.replica_of(9), None);
            assert!(record.upgrade().is_none(), "the replica's record, its working set with it, is gone");
            assert_eq!(op.fleet.records_alive(), 0);
        }
    }
}
