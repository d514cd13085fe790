//! A value every worker reads on the request path and an operator (or a
//! first-time event) replaces rarely. Reads take no lock and write no shared
//! cache line (`arc-swap`); a lock's reader count or an `Arc` clone would be
//! a write both cores contend for on every request. Writers copy the value,
//! change the copy and swap it in, one at a time.

use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, Guard};

#[derive(Debug, Default)]
pub struct ReadMostly<T> {
    value: ArcSwap<T>,
    writer: Mutex<()>,
}

impl<T: Clone> ReadMostly<T> {
    /// The value now. Hold the guard briefly, never across an await: it
    /// takes one of arc-swap's few per-thread slots.
    pub fn load(&self) -> Guard<Arc<T>> {
        self.value.load()
    }

    /// The value now, to keep (across an await, or for long).
    pub fn load_full(&self) -> Arc<T> {
        self.value.load_full()
    }

    /// Changes a copy of the value and publishes it; `change` returns None
    /// to leave the value as it is. Writers run one at a time.
    pub fn update<R>(&self, change: impl FnOnce(&mut T) -> Option<R>) -> Option<R> {
        let _writer = self.writer.lock().expect("writer lock");
        let mut next = T::clone(&self.value.load());
        let result = change(&mut next)?;
        self.value.store(Arc::new(next));
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_publish_a_new_value_and_declined_ones_change_nothing() {
        let list: ReadMostly<Vec<u32>> = ReadMostly::default();
        let before = list.load_full();
        let push = |v: &mut Vec<u32>| {
            v.push(1);
            Some(v.len())
        };
        assert_eq!(list.update(push), Some(1));
        assert_eq!(list.update(|v| if v.contains(&1) { None } else { push(v) }), None);
        assert_eq!(*list.load_full(), vec![1]);
        assert!(before.is_empty(), "a reader's earlier copy is not changed under it");
    }
}
