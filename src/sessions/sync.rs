//! The sessions' own task, and their half of a shared store: sessions idle
//! out (the sweep), this instance's resident ones are kept alive in the
//! store with every instance's loads read back, the ones that ended here
//! are released at once, and the ones another instance released leave here
//! (`released_elsewhere`, from the store's change feed). Spawned by
//! `lib.rs` beside the prober; without a shared store it only sweeps.

use std::sync::Arc;
use std::time::Duration;

use super::{Sessions, MIN_SWEEP_SPACING, RECHECK};
use crate::fleet::{Fleet, Replica};
use crate::policy::PrefixKey;
use crate::store::{Store, StoreError};

/// The sessions' task: what it needs of the gateway.
pub struct SessionSync {
    pub sessions: Arc<Sessions>,
    pub store: Arc<dyn Store>,
    pub fleet: Arc<Fleet>,
    /// How often this instance's residents are kept in the store and the
    /// fleet's loads read back (`pins.flush_interval_ms`).
    pub keep_every: Duration,
}

impl SessionSync {
    fn shared(&self) -> bool {
        self.store.instance().is_some()
    }

    /// Runs until aborted: sweeps at the next idle-out (at most every
    /// `RECHECK`), releasing what ended here at once; keeps and reads
    /// loads every `keep_every`.
    pub async fn run(self) {
        // Deadlines, not sleeps made anew each round: a keep that is due
        // often must not put the sweep off.
        let now = tokio::time::Instant::now();
        let (mut next_sweep, mut next_keep) = (now + RECHECK, now + self.keep_every);
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_sweep) => next_sweep = tokio::time::Instant::now() + self.sweep(),
                // A turn ended at its session's peak: its room goes now.
                _ = self.sessions.sweep_wanted() => next_sweep = tokio::time::Instant::now() + self.sweep(),
                _ = tokio::time::sleep_until(next_keep), if self.shared() => {
                    // At most every `MIN_SWEEP_SPACING`: a flush interval of 0 does not spin.
                    next_keep = tokio::time::Instant::now() + self.keep_every.max(MIN_SWEEP_SPACING);
                    if let Err(e) = self.keep().await {
                        tracing::debug!("could not keep this instance's sessions in the store (retrying): {e}");
                    }
                }
            }
        }
    }

    /// Sessions idle out, and the held look at the room again (capacity
    /// read by the prober, replicas added, other instances' pins). A
    /// session of this instance's that idled out is given back to the
    /// fleet at once: the others' held sessions need not wait for its entry
    /// to expire. Returns when to sweep next: at the next idle-out if
    /// sooner, so a paused turn or a held session gets the room the moment
    /// it opens.
    fn sweep(&self) -> Duration {
        let now_ms = crate::clock::now_ms();
        let swept = self.sessions.sweep(now_ms);
        if !swept.any && self.sessions.held() > 0 {
            self.sessions.recheck();
        }
        if self.shared() && !swept.released.is_empty() {
            let released: Vec<(String, String)> =
                swept.released.iter().map(|(r, s)| (r.to_string(), store_key(*s))).collect();
            let store = self.store.clone();
            actix_web::rt::spawn(async move {
                if let Err(e) = store.release_sessions(&released).await {
                    tracing::debug!("could not release {} session(s) at once (they expire): {e}", released.len());
                }
            });
        }
        swept
            .next_idle_out_ms
            .map(|at| Duration::from_millis(at.saturating_sub(now_ms)))
            .map_or(RECHECK, |due| due.clamp(MIN_SWEEP_SPACING, RECHECK))
    }

    /// The sessions resident here, kept alive in the shared store; and every
    /// instance's loads read back, so this instance places by the fleet's room.
    async fn keep(&self) -> Result<(), StoreError> {
        let ours = self.sessions.kept(crate::clock::now_ms());
        self.store.keep_sessions(&ours).await?;
        self.sessions.read_fleet_loads(self.store.as_ref(), &self.fleet.snapshot_owned()).await
    }
}

/// A session's id as the store keys it.
pub fn store_key(session: PrefixKey) -> String {
    format!("{session:032x}")
}

/// Reads every instance's session loads on `fleet` from the shared store
/// into the sessions' view, waiting at most `STORE_BUDGET`: a slow
/// or dead store leaves the last read, and the request goes on.
pub async fn read_loads(sessions: &Sessions, store: &dyn Store, fleet: &[Arc<Replica>]) {
    let _ = tokio::time::timeout(super::STORE_BUDGET, sessions.read_fleet_loads(store, fleet)).await;
}

/// A stopping instance's word on its sessions: those whose last turn it
/// served (none runs here any more: its servers stopped) leave the shared
/// store at once, and the other instances are told, instead of holding
/// their room until their entries expire. Only it knew they had ended; a
/// session whose next turn runs elsewhere is kept there again by that
/// instance (its own entry, renewed every flush), and the others forget
/// only sessions with no turn running (`released_elsewhere`).
pub async fn release_ours(sessions: &Sessions, store: &dyn Store) -> Result<usize, StoreError> {
    if store.instance().is_none() {
        return Ok(0);
    }
    let ours: Vec<(String, String)> =
        sessions.kept(crate::clock::now_ms()).into_iter().map(|k| (k.replica, k.session)).collect();
    store.release_sessions(&ours).await?;
    Ok(ours.len())
}

/// Another instance released these sessions (the store's change feed): each
/// leaves here too unless a turn of it runs here now.
pub fn released_elsewhere(sessions: &Sessions, released: &[(String, String)]) {
    for (replica, session) in released {
        if let Ok(session) = u128::from_str_radix(session, 16) {
            sessions.released_elsewhere(replica, session);
        }
    }
}
