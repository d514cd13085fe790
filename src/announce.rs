//! Announcing new pins to the other gateway instances the moment they exist.
//!
//! Why: an agent's next turn can reach another instance milliseconds after
//! this one answered the last (a tool call that reads a file, a load
//! balancer that picks any instance). Waiting for the flusher's batch (the
//! flush interval) made that turn cold, and a follow-up naming a stored
//! response a 404. So a pin is announced at the routing decision's response
//! head (a continuation, a session key) or as soon as a stored response's id
//! is read from the body or the stream, while persisting stays batched.
//!
//! No request waits on the shared store for this: `announce` puts the change
//! on a bounded queue and returns; a thread of its own publishes whatever
//! the queue holds in one message. A full queue or a store that does not
//! answer is counted (`prefixgate_shared_announcements_total`), never
//! blocking: the flusher's batch announces every change again once it is
//! persisted, so an instance that missed one still catches up.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use crate::metrics::{Metrics, ResultLabels};
use crate::pins::PinChange;
use crate::store::Store;

/// Changes waiting to be published; beyond this the newest are dropped
/// (and counted): a store that slow is an outage the flusher covers.
const QUEUE: usize = 4_096;

/// Most changes published in one message.
const BATCH: usize = 256;

pub struct Announcer {
    /// None when the store is not shared: nobody to tell.
    queue: Option<SyncSender<PinChange>>,
    metrics: Arc<Metrics>,
}

impl Announcer {
    /// Starts the publishing thread for a shared store; for any other
    /// store, an announcer that does nothing.
    pub fn start(store: &Arc<dyn Store>, metrics: Arc<Metrics>) -> std::io::Result<Announcer> {
        if store.instance().is_none() {
            return Ok(Announcer { queue: None, metrics });
        }
        let (tx, rx) = sync_channel(QUEUE);
        let (store, counts) = (store.clone(), metrics.clone());
        std::thread::Builder::new().name("prefixgate-announce".into()).spawn(move || publish(&rx, &*store, &counts))?;
        Ok(Announcer { queue: Some(tx), metrics })
    }

    /// True when announcing does something (callers skip building the change otherwise).
    pub fn enabled(&self) -> bool {
        self.queue.is_some()
    }

    /// Queues `change` for the other instances; never waits.
    pub fn announce(&self, change: PinChange) {
        let Some(queue) = &self.queue else { return };
        if let Err(TrySendError::Full(_)) = queue.try_send(change) {
            count(&self.metrics, "dropped", 1);
        }
    }
}

fn count(metrics: &Metrics, result: &'static str, n: u64) {
    metrics.announcements.get_or_create(&ResultLabels { result }).inc_by(n);
}

/// The thread's loop: wait for a change, take whatever else is queued, and
/// publish them together. Ends when the announcer (the gateway) is dropped.
fn publish(queue: &Receiver<PinChange>, store: &dyn Store, metrics: &Metrics) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        batch.extend(queue.try_iter().take(BATCH - 1));
        match store.publish_pins(&batch) {
            Ok(()) => count(metrics, "sent", batch.len() as u64),
            Err(e) => {
                tracing::debug!("could not announce {} pin(s) (the flusher will): {e}", batch.len());
                count(metrics, "failed", batch.len() as u64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::MemoryStore;

    /// A shared store that records what it was asked to publish.
    #[derive(Default)]
    struct Recording {
        inner: MemoryStore,
        published: Mutex<Vec<PinChange>>,
        fail: bool,
        /// Held by a test to make publishing hang (a store that does not answer).
        gate: Mutex<()>,
    }

    impl Store for Recording {
        fn is_new(&self) -> bool {
            self.inner.is_new()
        }
        fn replicas(&self) -> Result<Vec<crate::store::StoredReplica>, crate::store::StoreError> {
            self.inner.replicas()
        }
        fn put_replica(&self, r: &crate::store::StoredReplica) -> Result<(), crate::store::StoreError> {
            self.inner.put_replica(r)
        }
        fn delete_replica(&self, id: &str) -> Result<(), crate::store::StoreError> {
            self.inner.delete_replica(id)
        }
        fn pins(&self) -> Result<Vec<(crate::policy::PrefixKey, crate::pins::Pin)>, crate::store::StoreError> {
            self.inner.pins()
        }
        fn write_pins(&self, changes: &[PinChange]) -> Result<(), crate::store::StoreError> {
            self.inner.write_pins(changes)
        }
        fn append_event(&self, e: &crate::events::Event, up_to: Option<u64>) -> Result<(), crate::store::StoreError> {
            self.inner.append_event(e, up_to)
        }
        fn events(&self) -> Result<Vec<crate::events::Event>, crate::store::StoreError> {
            self.inner.events()
        }
        fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, crate::store::StoreError> {
            self.inner.setting(key)
        }
        fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), crate::store::StoreError> {
            self.inner.put_setting(key, value)
        }
        fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, crate::store::StoreError> {
            self.inner.settings(prefix)
        }
        fn flush(&self) -> Result<(), crate::store::StoreError> {
            Ok(())
        }
        fn instance(&self) -> Option<&str> {
            Some("me")
        }
        fn publish_pins(&self, changes: &[PinChange]) -> Result<(), crate::store::StoreError> {
            drop(self.gate.lock().unwrap());
            if self.fail {
                return Err(crate::store::StoreError::Backend("down".into()));
            }
            self.published.lock().unwrap().extend_from_slice(changes);
            Ok(())
        }
    }

    fn counted(m: &Metrics, result: &'static str) -> u64 {
        m.announcements.get_or_create(&ResultLabels { result }).get()
    }

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn every_announced_change_is_published_and_counted() {
        let store = Arc::new(Recording::default());
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store.clone() as Arc<dyn Store>), metrics.clone()).unwrap();
        assert!(announcer.enabled());
        for k in 0..100u128 {
            announcer.announce((k, None));
        }
        wait_for("100 published", || store.published.lock().unwrap().len() == 100);
        let keys: Vec<u128> = store.published.lock().unwrap().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, (0..100).collect::<Vec<_>>(), "in order, none twice");
        assert_eq!(counted(&metrics, "sent"), 100);
    }

    #[test]
    fn a_store_that_fails_is_counted_and_nothing_waits() {
        let store = Arc::new(Recording { fail: true, ..Default::default() });
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store as Arc<dyn Store>), metrics.clone()).unwrap();
        announcer.announce((1, None));
        wait_for("the failure counted", || counted(&metrics, "failed") == 1);
    }

    #[test]
    fn a_store_that_hangs_fills_the_queue_and_what_overflows_is_dropped_not_waited_for() {
        let store = Arc::new(Recording::default());
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store.clone() as Arc<dyn Store>), metrics.clone()).unwrap();
        let hung = store.gate.lock().unwrap();
        let total = (QUEUE + BATCH + 100) as u64;
        for k in 0..u128::from(total) {
            announcer.announce((k, None)); // returns at once, hung store or not
        }
        assert!(counted(&metrics, "dropped") >= 99, "at most a queue and a batch are held");
        drop(hung);
        wait_for("everything accounted for", || counted(&metrics, "sent") + counted(&metrics, "dropped") == total);
    }

    #[test]
    fn an_embedded_store_has_nobody_to_tell() {
        let announcer =
            Announcer::start(&(Arc::new(MemoryStore::default()) as Arc<dyn Store>), Arc::new(Metrics::new())).unwrap();
        assert!(!announcer.enabled());
        announcer.announce((1, None));
    }
}
