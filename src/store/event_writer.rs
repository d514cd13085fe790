//! Writes the history's recorded events to the store in batches, behind the
//! requests (the flusher calls it with the pins, shutdown last).

use std::sync::Arc;

use super::{Store, StoreError};
use crate::events::RecordedEvents;

/// Most events in one write (one sled batch, one Redis pipeline).
const BATCH: usize = 512;

pub struct EventWriter {
    recorded: RecordedEvents,
    /// One writer at a time: a batch put back after a failure stays in order.
    writing: tokio::sync::Mutex<()>,
    store: Arc<dyn Store>,
}

impl EventWriter {
    pub fn new(recorded: RecordedEvents, store: Arc<dyn Store>) -> EventWriter {
        EventWriter { recorded, writing: Default::default(), store }
    }

    /// Writes everything recorded so far, in batches; returns how many
    /// events. A failed batch goes back to the backlog for the next call
    /// (which is bounded: see `events.rs`).
    pub async fn flush(&self) -> Result<usize, StoreError> {
        let _writing = self.writing.lock().await;
        let mut n = 0;
        loop {
            let batch = self.recorded.take(BATCH);
            if batch.is_empty() {
                return Ok(n);
            }
            if let Err(e) = self.store.append_events(&batch).await {
                self.recorded.put_back(batch);
                return Err(e);
            }
            n += batch.len();
        }
    }

    /// Events waiting to be written.
    pub fn backlog(&self) -> usize {
        self.recorded.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{EventKind, EventLog};
    use crate::store::MemoryStore;

    #[tokio::test]
    async fn events_are_written_in_batches_and_in_order() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
        let (log, unwritten) = EventLog::new(10_000, 10_000, None, Vec::new());
        let writer = EventWriter::new(unwritten, store.clone());
        for i in 0..1_200 {
            log.record(EventKind::ReplicaUp, Some("a"), None, format!("{i}"));
        }
        assert_eq!(writer.backlog(), 1_200);
        assert_eq!(writer.flush().await.unwrap(), 1_200);
        assert_eq!(writer.backlog(), 0);
        let stored = store.events().await.unwrap();
        assert_eq!(stored.len(), 1_200);
        assert!(stored.windows(2).all(|w| w[0].id < w[1].id));
    }
}
