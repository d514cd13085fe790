//! Fleet-wide large-context slots. `max_large_inflight` is a property of the
//! card, not of a gateway: with several instances sharing a store, a large
//! request holds a lease in the store as well as a slot in its instance's
//! own FIFO queue (`admission.rs`), so N instances with a limit of 1 still
//! send one large request at a time to the card.
//!
//! Leases expire: each instance renews the leases it holds with every
//! heartbeat (every `pins.flush_interval_ms`), so an instance killed with a
//! slot gives it back within `LEASE_TTL_MS`. If the store cannot be reached
//! within `LEASE_BUDGET`, the request goes ahead under the local limit only:
//! a slow or dead store must not stop traffic (the admission is per instance
//! until it is back, and that is logged).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain_error::DomainError;
use crate::store::Store;

/// How long a lease lives without renewal: the longest a killed instance's slot stays taken.
pub const LEASE_TTL_MS: u64 = 5_000;

/// Longest one attempt to take a lease may wait on the store.
const LEASE_BUDGET: Duration = Duration::from_millis(250);

/// Pause between attempts while the card's slots are all leased.
const RETRY_EVERY: Duration = Duration::from_millis(25);

/// The leases this instance holds (lease id -> replica), for renewal.
#[derive(Default)]
pub struct Leases {
    held: Mutex<HashMap<String, String>>,
    next: AtomicU64,
}

/// A held fleet-wide slot; released when dropped, however the request ends.
pub struct FleetLease {
    store: Arc<dyn Store>,
    leases: Arc<Leases>,
    replica: String,
    id: String,
}

impl Drop for FleetLease {
    fn drop(&mut self) {
        self.leases.held.lock().expect("leases lock").remove(&self.id);
        let (store, replica, id) = (self.store.clone(), self.replica.clone(), self.id.clone());
        // Not waited for; if it fails, the lease expires on its own.
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(async move { store.release_lease(&replica, &id).await });
        }
    }
}

impl Leases {
    /// What this instance holds, as (replica, lease id), to renew.
    pub fn held(&self) -> Vec<(String, String)> {
        self.held.lock().expect("leases lock").iter().map(|(id, r)| (r.clone(), id.clone())).collect()
    }

    /// Takes a fleet-wide slot on `replica` (limit `limit`), waiting up to
    /// `wait`; says whether it had to wait. No lease when the store is not
    /// shared, or could not be reached in time (the local limit then
    /// applies alone).
    pub async fn acquire(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        replica: &str,
        limit: u32,
        wait: Duration,
    ) -> Result<(Option<FleetLease>, bool), DomainError> {
        let Some(instance) = store.instance() else { return Ok((None, false)) };
        let id = format!("{instance}:{}", self.next.fetch_add(1, Ordering::Relaxed));
        let try_take = || {
            let mut ask = LeaseAsk::start(store, replica, &id, limit);
            async move {
                let asked = tokio::time::timeout(LEASE_BUDGET, ask.answer()).await;
                match asked {
                    Ok(Ok(took)) => Ok(took),
                    Ok(Err(e)) => Err(e),
                    // `ask` drops here unanswered: a lease it takes later is released.
                    Err(_) => Err("timed out".to_string()),
                }
            }
        };
        match wait_for_slot(wait, try_take).await {
            SlotWait::Taken { waited } => {
                self.held.lock().expect("leases lock").insert(id.clone(), replica.to_string());
                let lease = FleetLease { store: store.clone(), leases: self.clone(), replica: replica.to_string(), id };
                Ok((Some(lease), waited))
            }
            SlotWait::Unreachable { why, waited } => {
                tracing::warn!(
                    replica,
                    "the store could not be asked for a large-context lease ({why}); admitting under this instance's limit"
                );
                Ok((None, waited))
            }
            SlotWait::TimedOut => Err(DomainError::Overloaded {
                message: format!(
                    "replica '{replica}' is at its large-context limit across the gateway fleet and no slot freed up in time; retry later"
                ),
                retry_after: (wait / 2).max(Duration::from_secs(1)),
            }),
        }
    }
}

/// One ask for a lease, running as a task of its own. Its answer may come
/// after the asker stopped waiting (the budget ran out, or the client went
/// away and the request's future was dropped): a lease granted then belongs
/// to nobody, and would keep a slot of the card for its whole TTL. Dropped
/// before its answer was read, the ask releases what it took, at once.
struct LeaseAsk {
    answer: Option<tokio::task::JoinHandle<Result<bool, crate::store::StoreError>>>,
    store: Arc<dyn Store>,
    replica: String,
    id: String,
}

impl LeaseAsk {
    fn start(store: &Arc<dyn Store>, replica: &str, id: &str, limit: u32) -> LeaseAsk {
        let (s, r, i) = (store.clone(), replica.to_string(), id.to_string());
        let answer = tokio::spawn(async move { s.try_lease(&r, &i, limit, LEASE_TTL_MS).await });
        LeaseAsk { answer: Some(answer), store: store.clone(), replica: replica.to_string(), id: id.to_string() }
    }

    /// The store's answer: whether the lease was taken.
    async fn answer(&mut self) -> Result<bool, String> {
        let answer = self.answer.as_mut().expect("asked once").await;
        self.answer = None; // read: the caller owns what was taken
        match answer {
            Ok(Ok(took)) => Ok(took),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Drop for LeaseAsk {
    fn drop(&mut self) {
        let Some(answer) = self.answer.take() else { return };
        if tokio::runtime::Handle::try_current().is_err() {
            return; // the process is ending: the lease expires on its own
        }
        let (store, replica, id) = (self.store.clone(), self.replica.clone(), self.id.clone());
        tokio::spawn(async move {
            if let Ok(Ok(true)) = answer.await {
                tracing::debug!(replica, "a lease granted after its asker gave up: released");
                let _ = store.release_lease(&replica, &id).await;
            }
        });
    }
}

/// How waiting for a fleet-wide slot ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotWait {
    Taken {
        waited: bool,
    },
    /// The store did not answer: the local limit applies alone.
    Unreachable {
        why: String,
        waited: bool,
    },
    /// Every slot stayed leased for the whole wait.
    TimedOut,
}

/// The waiting, apart from the store so that it runs on paused time in
/// tests: asks `try_take` until it says yes, every `RETRY_EVERY`, for at most
/// `wait`. A slot a killed instance held comes free when its lease expires
/// (it stops renewing it), and the next ask takes it.
pub async fn wait_for_slot<F, Fut>(wait: Duration, mut try_take: F) -> SlotWait
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, String>>,
{
    let deadline = tokio::time::Instant::now() + wait;
    let mut waited = false;
    loop {
        match try_take().await {
            Ok(true) => return SlotWait::Taken { waited },
            Ok(false) => {}
            Err(why) => return SlotWait::Unreachable { why, waited },
        }
        if tokio::time::Instant::now() + RETRY_EVERY >= deadline {
            return SlotWait::TimedOut;
        }
        waited = true;
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, StoreError};
    use std::sync::atomic::AtomicUsize;

    /// A shared store whose lease answers come after the budget.
    #[derive(Default)]
    struct SlowLeases {
        inner: MemoryStore,
        released: AtomicUsize,
    }

    crate::store::store_over_inner!(SlowLeases {
        fn is_new(&self) -> bool {
            true
        }
        fn instance(&self) -> Option<&str> {
            Some("gw-1")
        }
        async fn try_lease(&self, _replica: &str, _lease: &str, _limit: u32, _ttl_ms: u64) -> Result<bool, StoreError> {
            tokio::time::sleep(LEASE_BUDGET * 2).await;
            Ok(true)
        }
        async fn release_lease(&self, _replica: &str, _lease: &str) -> Result<(), StoreError> {
            self.released.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    });

    #[tokio::test]
    async fn a_lease_granted_after_its_asker_gave_up_is_released_at_once() {
        let slow = Arc::new(SlowLeases::default());
        let store: Arc<dyn Store> = slow.clone();
        let leases = Arc::new(Leases::default());
        // The store answers after the budget: admitted under the local limit, no lease held.
        let (lease, _) = leases.acquire(&store, "gpu-0", 1, Duration::from_secs(5)).await.unwrap();
        assert!(lease.is_none());
        assert!(leases.held().is_empty());
        // The late grant is given back, not left to its TTL.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while slow.released.load(Ordering::SeqCst) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the late lease was never released");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // An asker dropped mid-ask (its client went away) gives it back too.
        let asking = leases.acquire(&store, "gpu-0", 1, Duration::from_secs(5));
        assert!(tokio::time::timeout(Duration::from_millis(50), asking).await.is_err());
        while slow.released.load(Ordering::SeqCst) < 2 {
            assert!(tokio::time::Instant::now() < deadline, "the dropped ask's lease was never released");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
