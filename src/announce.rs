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
//! on a bounded queue and returns; a task of its own publishes whatever
//! the queue holds in one message. A full queue or a store that does not
//! answer is counted (`prefixgate_shared_announcements_total`), never
//! blocking: the flusher's batch announces every change again once it is
//! persisted, so an instance that missed one still catches up.

use std::sync::Arc;

use tokio::sync::mpsc::{channel, error::TrySendError, Receiver, Sender};

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
    queue: Option<Sender<PinChange>>,
    metrics: Arc<Metrics>,
}

impl Announcer {
    /// Starts the publishing task for a shared store (on the store's own
    /// runtime, `Store::runtime`); for any other store, an announcer that
    /// does nothing.
    pub fn start(store: &Arc<dyn Store>, metrics: Arc<Metrics>) -> Announcer {
        let Some(runtime) = store.runtime() else {
            return Announcer { queue: None, metrics };
        };
        let (tx, rx) = channel(QUEUE);
        let (task_store, counts) = (store.clone(), metrics.clone());
        runtime.spawn(async move { publish(rx, &*task_store, &counts).await });
        Announcer { queue: Some(tx), metrics }
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

/// The task's loop: wait for a change, take whatever else is queued, and
/// publish them together. Ends when the announcer (the gateway) is dropped.
async fn publish(mut queue: Receiver<PinChange>, store: &dyn Store, metrics: &Metrics) {
    let mut batch = Vec::with_capacity(BATCH);
    while queue.recv_many(&mut batch, BATCH).await > 0 {
        match store.publish_pins(&batch).await {
            Ok(()) => count(metrics, "sent", batch.len() as u64),
            Err(e) => {
                tracing::debug!("could not announce {} pin(s) (the flusher will): {e}", batch.len());
                count(metrics, "failed", batch.len() as u64);
            }
        }
        batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::MemoryStore;
    use crate::store::StoreError;

    /// A shared store that records what it was asked to publish.
    #[derive(Default)]
    struct Recording {
        inner: MemoryStore,
        published: Mutex<Vec<PinChange>>,
        fail: bool,
        /// Held by a test to make publishing hang (a store that does not answer).
        gate: tokio::sync::Mutex<()>,
    }

    crate::store::store_over_inner!(Recording {
        fn is_new(&self) -> bool {
            self.inner.is_new()
        }
        fn instance(&self) -> Option<&str> {
            Some("me")
        }
        fn runtime(&self) -> Option<&tokio::runtime::Handle> {
            static RUNTIME: std::sync::LazyLock<crate::store::OwnRuntime> =
                std::sync::LazyLock::new(|| crate::store::OwnRuntime::start("test-store").unwrap());
            Some(RUNTIME.handle())
        }
        async fn publish_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
            drop(self.gate.lock().await);
            if self.fail {
                return Err(StoreError::Backend("down".into()));
            }
            self.published.lock().unwrap().extend_from_slice(changes);
            Ok(())
        }
    });

    fn counted(m: &Metrics, result: &'static str) -> u64 {
        m.announcements.get_or_create(&ResultLabels { result }).get()
    }

    async fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn every_announced_change_is_published_and_counted() {
        let store = Arc::new(Recording::default());
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store.clone() as Arc<dyn Store>), metrics.clone());
        assert!(announcer.enabled());
        for k in 0..100u128 {
            announcer.announce((k, None));
        }
        wait_for("100 published", || store.published.lock().unwrap().len() == 100).await;
        let keys: Vec<u128> = store.published.lock().unwrap().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, (0..100).collect::<Vec<_>>(), "in order, none twice");
        assert_eq!(counted(&metrics, "sent"), 100);
    }

    #[tokio::test]
    async fn a_store_that_fails_is_counted_and_nothing_waits() {
        let store = Arc::new(Recording { fail: true, ..Default::default() });
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store as Arc<dyn Store>), metrics.clone());
        announcer.announce((1, None));
        wait_for("the failure counted", || counted(&metrics, "failed") == 1).await;
    }

    #[tokio::test]
    async fn a_store_that_hangs_fills_the_queue_and_what_overflows_is_dropped_not_waited_for() {
        let store = Arc::new(Recording::default());
        let metrics = Arc::new(Metrics::new());
        let announcer = Announcer::start(&(store.clone() as Arc<dyn Store>), metrics.clone());
        let hung = store.gate.lock().await;
        let total = (QUEUE + BATCH + 100) as u64;
        for k in 0..u128::from(total) {
            announcer.announce((k, None)); // returns at once, hung store or not
        }
        assert!(counted(&metrics, "dropped") >= 99, "at most a queue and a batch are held");
        drop(hung);
        wait_for("everything accounted for", || counted(&metrics, "sent") + counted(&metrics, "dropped") == total)
            .await;
    }

    #[tokio::test]
    async fn an_embedded_store_has_nobody_to_tell() {
        let announcer =
            Announcer::start(&(Arc::new(MemoryStore::default()) as Arc<dyn Store>), Arc::new(Metrics::new()));
        assert!(!announcer.enabled());
        announcer.announce((1, None));
    }
}
