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
        // Off the runtime thread; if it fails, the lease expires on its own.
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::task::spawn_blocking(move || store.release_lease(&replica, &id));
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
            let (store, replica, id) = (store.clone(), replica.to_string(), id.clone());
            async move {
                let asked = tokio::time::timeout(
                    LEASE_BUDGET,
                    tokio::task::spawn_blocking(move || store.try_lease(&replica, &id, limit, LEASE_TTL_MS)),
                )
                .await;
                match asked {
                    Ok(Ok(Ok(took))) => Ok(took),
                    Ok(Ok(Err(e))) => Err(e.to_string()),
                    Ok(Err(e)) => Err(e.to_string()),
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
