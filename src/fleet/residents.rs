//! The sessions resident on one replica (the KV wall, `sessions/`): kept on
//! the replica's record, so they leave with it. `Sessions` decides who is
//! resident where and keeps the index from a session to its replica; this
//! is only the replica's side of it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::policy::PrefixKey;

/// One resident session.
#[derive(Debug, Clone, Copy)]
pub struct Resident {
    pub tokens: u64,
    pub last_ms: u64,
    /// Turns running now: a session mid-turn is never idle.
    pub running: u32,
    /// A turn of it ran here (not only another instance's pins say so):
    /// this instance keeps it alive in a shared store.
    pub ours: bool,
}

#[derive(Debug, Default)]
pub struct Residents {
    sessions: Mutex<foldhash::HashMap<PrefixKey, Resident>>,
    /// With a shared store: the footprints of every instance's live
    /// sessions here, as last read (`store.session_loads`).
    fleet_load: AtomicU64,
}

impl Residents {
    /// The sessions resident here. `Sessions` takes its own lock first,
    /// then this one: always in that order.
    pub fn lock(&self) -> MutexGuard<'_, foldhash::HashMap<PrefixKey, Resident>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn fleet_load(&self) -> u64 {
        self.fleet_load.load(Ordering::Relaxed)
    }

    pub fn set_fleet_load(&self, tokens: u64) {
        self.fleet_load.store(tokens, Ordering::Relaxed);
    }
}
