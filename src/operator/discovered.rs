//! Discovered replicas: what a discovery source's actions do to the fleet,
//! and the operator's state of a discovered replica, kept by name.
//!
//! Each gateway instance runs its own discovery and keeps its own copy of
//! the replicas a source lists; nothing about them is persisted but the
//! operator's decision (drain, disable), stored under the replica's name
//! (the setting `discovered_admin/NAME`, one per name). That way two
//! instances never fight over a discovered replica (neither writes it where
//! the other reads it), two operators acting on two replicas never
//! overwrite each other, the decision is shared (a setting change is
//! announced like any other), and it outlives the replica leaving its
//! source and coming back.
//!
//! A replica that left its source drains whatever the operator said, and a
//! disabled one stays disabled: the state in force is `in_force`.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{internal, Operator};
use crate::domain_error::DomainError;
use crate::events::EventKind;
use crate::fleet::{AdminState, Replica, ReplicaSource, SourceAction};
use crate::store::{Store, StoreError, DISCOVERED_ADMIN_PREFIX};

/// The operator's state of discovered replicas, by name. Active is the
/// default and is not kept.
pub type AdminByName = BTreeMap<String, AdminState>;

fn key(id: &str) -> String {
    format!("{DISCOVERED_ADMIN_PREFIX}{id}")
}

fn parse(name: &str, v: serde_json::Value) -> Result<AdminState, StoreError> {
    serde_json::from_value(v).map_err(|e| StoreError::Corrupt { tree: "settings", detail: format!("{name}: {e}") })
}

/// Reads the operator's states of discovered replicas from the store.
pub async fn read_discovered_admin(store: &dyn Store) -> Result<AdminByName, StoreError> {
    let mut states = AdminByName::new();
    for (name, v) in store.settings(DISCOVERED_ADMIN_PREFIX).await? {
        let state = parse(&name, v)?;
        if state != AdminState::Active {
            states.insert(name[DISCOVERED_ADMIN_PREFIX.len()..].to_string(), state);
        }
    }
    Ok(states)
}

/// The state in force: the operator's, except that a replica gone from its
/// source drains (a disabled one stays disabled).
pub fn in_force(operator: AdminState, left_source: bool) -> AdminState {
    match (operator, left_source) {
        (AdminState::Active, true) => AdminState::Draining,
        (state, _) => state,
    }
}

/// Why a source's action was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotApplied {
    /// The name belongs to a replica from elsewhere (static, api, or another source).
    NameTaken { id: String, by: String },
}

impl std::fmt::Display for NotApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotApplied::NameTaken { id, by } => write!(f, "the name '{id}' is taken by a replica from {by}"),
        }
    }
}

impl Operator {
    fn admin_of(&self, id: &str) -> AdminState {
        self.discovered_admin.lock().unwrap_or_else(|e| e.into_inner()).get(id).copied().unwrap_or(AdminState::Active)
    }

    /// Keeps the operator's `next` state of discovered replica `r` (persisted
    /// first), then applies the state in force. Returns the state before.
    /// Called under the operator lock.
    pub(super) async fn set_discovered_admin(&self, r: &Replica, next: AdminState) -> Result<AdminState, DomainError> {
        let value = serde_json::to_value(next).expect("serializable");
        self.store.put_setting(&key(&r.id), &value).await.map_err(internal)?;
        self.keep_discovered_admin(&r.id, next);
        Ok(r.set_admin(in_force(next, r.left_source_ms().is_some())))
    }

    fn keep_discovered_admin(&self, id: &str, state: AdminState) {
        let mut states = self.discovered_admin.lock().unwrap_or_else(|e| e.into_inner());
        match state {
            AdminState::Active => states.remove(id),
            other => states.insert(id.to_string(), other),
        };
    }

    /// Re-reads the operator's state of discovered replica `id` (another
    /// instance changed it) and applies it.
    pub(crate) async fn reload_discovered_admin_of(&self, id: &str) -> Result<(), StoreError> {
        let _serial = self.serial().await;
        let state = match self.store.setting(&key(id)).await? {
            Some(v) => parse(&key(id), v)?,
            None => AdminState::Active,
        };
        self.keep_discovered_admin(id, state);
        if let Some(r) = self.fleet.get(id).filter(|r| r.source.is_discovered()) {
            r.set_admin(in_force(state, r.left_source_ms().is_some()));
        }
        Ok(())
    }

    /// Re-reads every operator state of discovered replicas (a resync) and applies them.
    pub(crate) async fn reload_discovered_admin(&self) -> Result<(), StoreError> {
        let _serial = self.serial().await;
        let states = read_discovered_admin(self.store.as_ref()).await?;
        for r in self.fleet.snapshot().iter().filter(|r| r.source.is_discovered()) {
            let state = states.get(&*r.id).copied().unwrap_or(AdminState::Active);
            r.set_admin(in_force(state, r.left_source_ms().is_some()));
        }
        *self.discovered_admin.lock().unwrap_or_else(|e| e.into_inner()) = states;
        Ok(())
    }

    /// Writes this instance's copy of the states back (a shared store that
    /// came back empty).
    pub(crate) async fn persist_discovered_admin(&self) -> Result<(), StoreError> {
        let states = self.discovered_admin.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (id, state) in states {
            self.store.put_setting(&key(&id), &serde_json::to_value(state).expect("serializable")).await?;
        }
        Ok(())
    }

    /// Applies one action of discovery source `source` (its label) at
    /// `now_ms`, and records its event.
    pub async fn apply_discovered(&self, source: &str, action: SourceAction, now_ms: u64) -> Result<(), NotApplied> {
        let _serial = self.serial().await;
        let id = match &action {
            SourceAction::Add(spec) | SourceAction::Update(spec) => spec.id.clone(),
            SourceAction::Drain(id) | SourceAction::Return(id) | SourceAction::Remove(id) => id.clone(),
        };
        let existing = self.fleet.get(&id);
        if let Some(r) = &existing {
            if r.source.label() != source {
                return Err(NotApplied::NameTaken { id, by: r.source.label().to_string() });
            }
        }
        let record = |kind, detail: String| self.events.record(kind, Some(&id), None, detail);
        match (action, existing) {
            (SourceAction::Add(spec), None) => {
                let url = spec.url.clone();
                let admin = in_force(self.admin_of(&id), false);
                self.fleet.add(Replica::from_source(spec, admin, ReplicaSource::Discovered(Arc::from(source))));
                // It takes traffic once probed: probe it now, not at the next round.
                self.fleet.probe_now.notify_one();
                let kept = match admin {
                    AdminState::Active => String::new(),
                    kept => format!(", {} by an operator", kept.as_str()),
                };
                record(EventKind::ReplicaDiscovered, format!("found by {source} at {url}{kept}"));
            }
            (SourceAction::Add(spec) | SourceAction::Update(spec), Some(r)) => {
                let (url, limit) = (spec.url.clone(), spec.max_large_inflight);
                r.set_spec(spec);
                r.large_slots.rebalance(limit);
                record(EventKind::ReplicaUpdated, format!("changed in {source}: {url}"));
            }
            (SourceAction::Drain(_), Some(r)) => {
                r.set_left_source(Some(now_ms));
                r.set_admin(in_force(self.admin_of(&id), true));
                record(EventKind::ReplicaLeftSource, format!("left {source}: draining, {} in flight", r.inflight()));
            }
            (SourceAction::Return(_), Some(r)) => {
                r.set_left_source(None);
                let admin = in_force(self.admin_of(&id), false);
                r.set_admin(admin);
                let state = match admin {
                    AdminState::Active => "back in rotation".to_string(),
                    kept => format!("stays {} (an operator's decision)", kept.as_str()),
                };
                record(EventKind::ReplicaReturned, format!("back in {source}: {state}"));
            }
            (SourceAction::Remove(_), Some(r)) => {
                let pins = self.forget_replica(&id);
                record(
                    EventKind::ReplicaRemoved,
                    format!("left {source}, removed with {} in flight; {pins} pin(s) dropped", r.inflight()),
                );
            }
            // The replica is not here (removed by the source already): nothing to do.
            (_, None) => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::ReplicaSpec;
    use crate::store::MemoryStore;

    fn spec(id: &str) -> ReplicaSpec {
        ReplicaSpec::new(id, "http://127.0.0.2:8000")
    }

    #[test]
    fn the_state_in_force_drains_a_departed_replica_and_keeps_a_disabled_one() {
        assert_eq!(in_force(AdminState::Active, false), AdminState::Active);
        assert_eq!(in_force(AdminState::Active, true), AdminState::Draining);
        assert_eq!(in_force(AdminState::Disabled, true), AdminState::Disabled);
        assert_eq!(in_force(AdminState::Draining, false), AdminState::Draining);
    }

    #[tokio::test]
    async fn an_operators_disable_outlives_removal_and_is_shared_through_the_store() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
        let (here, there) = (Operator::for_tests(store.clone()), Operator::for_tests(store.clone()));
        for op in [&here, &there] {
            op.apply_discovered("dns:e:8000", SourceAction::Add(spec("e-1")), 1).await.unwrap();
        }
        here.disable("e-1").await.unwrap();
        there.reload_discovered_admin_of("e-1").await.unwrap();
        assert_eq!(there.replica("e-1").unwrap().admin(), AdminState::Disabled, "shared by name");
        // It leaves its source, is removed, and comes back: still disabled.
        here.apply_discovered("dns:e:8000", SourceAction::Drain("e-1".into()), 2).await.unwrap();
        assert_eq!(here.replica("e-1").unwrap().admin(), AdminState::Disabled);
        here.apply_discovered("dns:e:8000", SourceAction::Remove("e-1".into()), 3).await.unwrap();
        assert!(here.fleet.get("e-1").is_none());
        here.apply_discovered("dns:e:8000", SourceAction::Add(spec("e-1")), 4).await.unwrap();
        assert_eq!(here.replica("e-1").unwrap().admin(), AdminState::Disabled);
        // Two names are two keys: deciding on one never overwrites the other.
        there.apply_discovered("dns:e:8000", SourceAction::Add(spec("e-2")), 5).await.unwrap();
        there.drain("e-2").await.unwrap();
        let both = AdminByName::from([("e-1".into(), AdminState::Disabled), ("e-2".into(), AdminState::Draining)]);
        assert_eq!(read_discovered_admin(store.as_ref()).await.unwrap(), both);
        there.reload_discovered_admin().await.unwrap();
        assert_eq!(there.replica("e-1").unwrap().admin(), AdminState::Disabled);
        // Enabling forgets the decision: the next appearance is active.
        here.enable("e-1").await.unwrap();
        let left = AdminByName::from([("e-2".into(), AdminState::Draining)]);
        assert_eq!(read_discovered_admin(store.as_ref()).await.unwrap(), left);
    }

    #[tokio::test]
    async fn a_departed_replica_drains_until_it_returns_and_the_api_cannot_delete_it() {
        let op = Operator::for_tests(Arc::new(MemoryStore::default()));
        op.apply_discovered("file:/e.toml", SourceAction::Add(spec("e-1")), 1).await.unwrap();
        op.apply_discovered("file:/e.toml", SourceAction::Drain("e-1".into()), 2).await.unwrap();
        let r = op.replica("e-1").unwrap();
        assert_eq!((r.admin(), r.left_source_ms()), (AdminState::Draining, Some(2)));
        // A resume while it is gone keeps it draining: its source does not list it.
        op.resume("e-1").await.unwrap();
        assert_eq!(r.admin(), AdminState::Draining);
        op.apply_discovered("file:/e.toml", SourceAction::Return("e-1".into()), 3).await.unwrap();
        assert_eq!((r.admin(), r.left_source_ms()), (AdminState::Active, None));
        let refused = op.remove_replica("e-1").await.unwrap_err().to_string();
        assert!(refused.contains("file:/e.toml") && refused.contains("disable"), "{refused}");
        // Another source cannot take the name.
        let taken = op.apply_discovered("dns:other:1", SourceAction::Add(spec("e-1")), 4).await.unwrap_err();
        assert_eq!(taken, NotApplied::NameTaken { id: "e-1".into(), by: "file:/e.toml".into() });
        // The store's replica records do not touch it.
        assert_eq!(op.apply_replica("e-1", None), super::super::Applied::Nothing);
        assert!(op.fleet.get("e-1").is_some());
    }
}
