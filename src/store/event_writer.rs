//! Writes the history's recorded events to the store in batches, behind the
//! requests (the flusher calls it with the pins, shutdown last).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::{Store, StoreError};
use crate::events::{Pending, RecordedEvents};

pub struct EventWriter {
    recorded: RecordedEvents,
    /// Events whose write failed: written first next time.
    retry: Mutex<VecDeque<Pending>>,
    store: Arc<dyn Store>,
}

impl EventWriter {
    pub fn new(recorded: RecordedEvents, store: Arc<dyn Store>) -> EventWriter {
        EventWriter { recorded, retry: Mutex::default(), store }
    }

    /// Writes everything recorded so far; returns how many events. A failed
    /// write keeps the event for the next call.
    pub fn flush(&self) -> Result<usize, StoreError> {
        let mut retry = self.retry.lock().expect("event writer lock");
        retry.extend(self.recorded.drain());
        let mut n = 0;
        while let Some((event, dropped)) = retry.front() {
            self.store.append_event(event, *dropped)?;
            retry.pop_front();
            n += 1;
        }
        Ok(n)
    }
}
