//! Stored response ids nobody held, remembered for a short window.
//!
//! Why: an id this instance does not know is looked for on every replica
//! (`proxy/locate.rs`). A client that keeps naming an id nobody holds (a
//! response its engine lost in a restart, a typo in a script) made every
//! replica do that lookup on every request: ten requests, twenty lookups at
//! each replica. Within the window, an id asked about once is not asked
//! about again: the request goes on as it is, and the engine answers for itself.
//!
//! The claim is taken before asking, so concurrent requests naming the same
//! id ask once between them. Bounded: the oldest claims go first past
//! `MAX_IDS`. Time is passed in.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Most ids remembered at once (a few hundred KiB at worst).
const MAX_IDS: usize = 10_000;

#[derive(Default)]
struct Claims {
    /// id -> until when it is not asked about again (ms).
    until: foldhash::HashMap<String, u64>,
    /// Claims in the order they were taken (the window is the same for
    /// all, so also in the order they expire).
    order: VecDeque<(String, u64)>,
}

pub struct UnknownIds {
    window_ms: u64,
    claims: Mutex<Claims>,
}

impl UnknownIds {
    /// `window_ms` 0: every request asks.
    pub fn new(window_ms: u64) -> UnknownIds {
        UnknownIds { window_ms, claims: Mutex::default() }
    }

    /// True when the replicas may be asked about `id` now (and nobody else
    /// will be until the window ends); false when it was asked about within
    /// the window.
    pub fn claim(&self, id: &str, now_ms: u64) -> bool {
        if self.window_ms == 0 {
            return true;
        }
        let mut c = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        if c.until.get(id).is_some_and(|until| *until > now_ms) {
            return false;
        }
        while let Some((old, until)) = c.order.front().cloned() {
            if until > now_ms && c.order.len() < MAX_IDS {
                break;
            }
            c.order.pop_front();
            // A later claim of the same id stands.
            if c.until.get(&old) == Some(&until) {
                c.until.remove(&old);
            }
        }
        let until = now_ms + self.window_ms;
        c.until.insert(id.to_string(), until);
        c.order.push_back((id.to_string(), until));
        true
    }

    /// The id was found: later requests find its pin, the claim can go.
    pub fn found(&self, id: &str) {
        self.claims.lock().unwrap_or_else(|e| e.into_inner()).until.remove(id);
    }

    pub fn len(&self) -> usize {
        self.claims.lock().unwrap_or_else(|e| e.into_inner()).until.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_asked_about_once_per_window() {
        let u = UnknownIds::new(1_000);
        assert!(u.claim("resp_1", 0));
        assert!(!u.claim("resp_1", 500), "within the window");
        assert!(u.claim("resp_2", 500), "another id");
        assert!(u.claim("resp_1", 1_000), "the window ended");
        u.found("resp_2");
        assert!(u.claim("resp_2", 600), "a found id's claim is gone");
        assert!(UnknownIds::new(0).claim("x", 0) && UnknownIds::new(0).claim("x", 0));
    }

    #[test]
    fn it_holds_at_most_max_ids() {
        let u = UnknownIds::new(u64::MAX / 2);
        for i in 0..MAX_IDS + 500 {
            assert!(u.claim(&format!("resp_{i}"), i as u64));
        }
        assert_eq!(u.len(), MAX_IDS);
        assert!(u.claim("resp_0", 1), "the oldest claim went first");
    }
}
