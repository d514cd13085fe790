//! Values a worker derives from a shared `Arc` (a replica's spec or name)
//! once, instead of on every request: a parsed URL, a header value, metric
//! handles. Keyed by the `Arc`'s address; an entry keeps its `Arc` alive, so
//! the address cannot be reused by another value while it is cached, and a
//! replaced value (a new `Arc`) is derived afresh. Per worker (a `RefCell`,
//! no lock): nothing here is shared between threads.

use std::cell::RefCell;
use std::sync::Arc;

/// Values replaced over a worker's life are forgotten past this many entries.
const MAX_ENTRIES: usize = 1024;

pub struct ByArc<K: ?Sized, V>(RefCell<foldhash::HashMap<usize, (Arc<K>, V)>>);

impl<K: ?Sized, V> Default for ByArc<K, V> {
    fn default() -> Self {
        ByArc(RefCell::default())
    }
}

impl<K: ?Sized, V> ByArc<K, V> {
    /// Forgets everything derived so far.
    pub fn clear(&self) {
        self.0.borrow_mut().clear();
    }
}

impl<K: ?Sized, V: Clone> ByArc<K, V> {
    /// The value derived from `key`, deriving it with `derive` the first time.
    pub fn get(&self, key: &Arc<K>, derive: impl FnOnce(&K) -> V) -> V {
        let address = Arc::as_ptr(key).cast::<()>() as usize;
        if let Some((_, v)) = self.0.borrow().get(&address) {
            return v.clone();
        }
        let v = derive(key);
        let mut map = self.0.borrow_mut();
        if map.len() >= MAX_ENTRIES {
            map.clear();
        }
        map.insert(address, (key.clone(), v.clone()));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_derived_once_per_arc_and_again_for_a_new_arc_with_equal_contents() {
        let cache: ByArc<str, usize> = ByArc::default();
        let derived = std::cell::Cell::new(0);
        let derive = |s: &str| {
            derived.set(derived.get() + 1);
            s.len()
        };
        let a: Arc<str> = Arc::from("gpu-a");
        assert_eq!(cache.get(&a, derive), 5);
        assert_eq!(cache.get(&a, derive), 5);
        assert_eq!(derived.get(), 1);
        let a_again: Arc<str> = Arc::from("gpu-a");
        assert_eq!(cache.get(&a_again, derive), 5);
        assert_eq!(derived.get(), 2, "a new Arc is derived afresh");
    }
}
