//! Pins read from disk page by page after a start, instead of all at once.
//!
//! Why: a table of every boundary agents passed is tens of millions of pins
//! (1M conversations of 40 messages: 40M); reading and inserting them all
//! took ~22 s before the gateway could route. sled keeps pins in 65,536
//! pages by their key's top 16 bits (`store::page_of`); the gateway serves
//! at once, and a page is read the first time any key in it is touched (a
//! request's boundaries, a session, a stored response, an operator's
//! action) while a background thread reads the rest in order. Either way a
//! page is read exactly once (a `OnceLock` per page: a second reader waits
//! for the first), so the table reads as if it had been loaded whole.
//!
//! Nothing written since the start is lost to what is read: a key is
//! written (a turn served, another instance's pin heard, a deletion) only
//! through its shard, which reads the key's page first.
//!
//! A replica removed while pages are still on disk does not wait for them:
//! its pins there are dropped as their page is read (`Dropped`), and the
//! next flush deletes them from disk. Listing every pin (the admin page, an
//! operator deleting a replica's pins) reads the pages still on disk first
//! (`load_all`), off the request workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::{Pin, PinSource};
use crate::policy::PrefixKey;

/// How many pages there are: a key's top 16 bits.
pub const PAGES: usize = 1 << 16;

/// The page a key lives in (as the sled store lays them out).
pub fn page_of(key: PrefixKey) -> u16 {
    (key >> 112) as u16
}

/// Reads one page's pins from the store.
pub type PageReader = Box<dyn Fn(u16) -> Result<Vec<(PrefixKey, Pin)>, String> + Send + Sync>;

/// Told of each page's pins as it is read, just before they go into the
/// table (startup seeds the working set from them).
pub type OnLoaded = Box<dyn Fn(&[(PrefixKey, Pin)]) + Send + Sync>;

pub(super) struct Pages {
    loaded: Box<[OnceLock<()>]>,
    /// Pages still on disk: 0 makes every check one atomic load.
    left: AtomicUsize,
    read: PageReader,
    pub(super) on_loaded: Option<OnLoaded>,
    /// Replicas removed while pages were on disk. Held across a page's
    /// filtering and insertion, and across a removal, so a page is read
    /// either wholly before a removal (which then removes its pins from the
    /// table) or wholly after (which drops them on the way in).
    pub(super) dropped: Mutex<Vec<Dropped>>,
}

/// A replica whose pins still on disk are dropped as they are read. Every
/// pin on disk predates the removal (later ones are written through the
/// table), so a replica added again under the name loses nothing of its own.
pub(super) struct Dropped {
    pub(super) name: Arc<str>,
    /// Its stored responses' ids stay (`PinTable::remove_replica_pins`).
    pub(super) keep_stored_responses: bool,
}

impl Dropped {
    pub(super) fn drops(&self, pin: &Pin) -> bool {
        *pin.replica == *self.name && !(self.keep_stored_responses && pin.origin.source == PinSource::Response)
    }
}

impl Pages {
    pub(super) fn new(read: PageReader, on_loaded: Option<OnLoaded>) -> Pages {
        Pages {
            loaded: (0..PAGES).map(|_| OnceLock::new()).collect(),
            left: AtomicUsize::new(PAGES),
            read,
            on_loaded,
            dropped: Mutex::default(),
        }
    }

    pub(super) fn left(&self) -> usize {
        self.left.load(Ordering::Acquire)
    }

    /// Runs `load` with the page's pins the first time `page` is asked
    /// for; later callers return at once, concurrent ones once it is done.
    pub(super) fn once(&self, page: u16, load: impl FnOnce(Vec<(PrefixKey, Pin)>)) {
        self.loaded[usize::from(page)].get_or_init(|| {
            match (self.read)(page) {
                Ok(pins) => load(pins),
                // A page that cannot be read loses its pins (their
                // conversations start cold), not the gateway.
                Err(e) => tracing::error!(page, "a pin page could not be read, its pins are lost: {e}"),
            }
            self.left.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::pins::PinTable;

    fn pin(replica: &str, last_used_ms: u64) -> Pin {
        Pin {
            replica: replica.into(),
            created_ms: 1,
            last_used_ms,
            turns: 2,
            est_tokens: 100,
            family: 1,
            origin: Default::default(),
            went_on: 0,
        }
    }

    fn key(page: u16, low: u128) -> PrefixKey {
        (u128::from(page) << 112) | low
    }

    /// A table over `disk` (pins by page) that counts each page's reads.
    fn paged(disk: Vec<(PrefixKey, Pin)>) -> (PinTable, Arc<Mutex<HashMap<u16, usize>>>) {
        let reads: Arc<Mutex<HashMap<u16, usize>>> = Default::default();
        let mut by_page: HashMap<u16, Vec<(PrefixKey, Pin)>> = HashMap::new();
        for (k, p) in disk {
            by_page.entry(page_of(k)).or_default().push((k, p));
        }
        let counted = reads.clone();
        let read: PageReader = Box::new(move |page| {
            *counted.lock().unwrap().entry(page).or_default() += 1;
            if page == 666 {
                return Err("corrupt".into());
            }
            Ok(by_page.get(&page).cloned().unwrap_or_default())
        });
        (PinTable::paged(read, None), reads)
    }

    #[test]
    fn a_key_reads_its_page_on_first_touch_and_only_its_page() {
        let (t, reads) = paged(vec![(key(7, 1), pin("a", 5)), (key(7, 2), pin("b", 5)), (key(9, 1), pin("c", 5))]);
        assert_eq!(t.len(), 0, "nothing read at the start");
        assert_eq!(t.replica_of(key(7, 1)).as_deref(), Some("a"));
        assert_eq!(t.replica_of(key(7, 2)).as_deref(), Some("b"));
        assert_eq!(t.len(), 2, "page 7 only");
        assert_eq!(*reads.lock().unwrap(), HashMap::from([(7, 1)]), "read once");
        assert_eq!(t.pages_left(), PAGES - 1);
    }

    #[test]
    fn a_write_to_a_page_on_disk_continues_what_the_disk_held() {
        let k = key(3, 1);
        let (t, _) = paged(vec![(k, pin("a", 5))]);
        // The conversation's next turn: its count goes on from the disk's.
        t.record(k, &Arc::from("a"), None, 100, 10, Default::default());
        let p = t.get(k).unwrap();
        assert_eq!((p.turns, p.last_used_ms), (3, 10));
        // A deletion heard from elsewhere is not undone by the page.
        let (t, _) = paged(vec![(k, pin("a", 5))]);
        t.apply([(k, None)]);
        t.load_all();
        assert_eq!(t.get(k), None);
    }

    #[test]
    fn load_all_reads_every_page_once_however_many_threads_ask() {
        let disk: Vec<_> = (0..300u16).map(|p| (key(p * 200, 1), pin("a", 5))).collect();
        let (t, reads) = paged(disk);
        t.get(key(200, 1));
        let table = Arc::new(t);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let t = table.clone();
                std::thread::spawn(move || t.load_all())
            })
            .collect();
        threads.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(table.pages_left(), 0);
        let reads = reads.lock().unwrap();
        assert_eq!(reads.len(), PAGES);
        assert!(reads.values().all(|n| *n == 1), "each page read once");
        assert_eq!(table.len(), 300);
    }

    #[test]
    fn the_size_cap_waits_for_the_whole_table_and_expiry_does_not() {
        let disk: Vec<_> = (0..10u16).map(|p| (key(p, 1), pin("a", 100 + u64::from(p)))).collect();
        let (t, _) = paged(disk);
        t.get(key(0, 1));
        t.get(key(9, 1));
        // Page 0's pin is the oldest read, not the table's oldest: kept.
        assert_eq!(t.prune(200, 1_000, 1), 0);
        // Expired is expired, read or not.
        assert_eq!(t.prune(1_105, 1_000, 1), 1);
        t.load_all();
        // Whole: the cap keeps the most recent (these keys share one shard).
        assert_eq!(t.prune(200, 1_000, 1), 8);
        assert_eq!(t.len(), 1);
        assert!(t.get(key(9, 1)).is_some(), "the most recent stays");
    }

    #[test]
    fn a_replica_leaving_drops_its_pins_still_on_disk_as_they_are_read_without_waiting() {
        let mut response = pin("a", 5);
        response.origin.source = PinSource::Response;
        let disk =
            vec![(key(1, 1), pin("a", 5)), (key(2, 1), pin("b", 5)), (key(3, 1), pin("a", 5)), (key(4, 1), response)];
        let (t, reads) = paged(disk);
        assert_eq!(t.replica_of(key(3, 1)).as_deref(), Some("a"));
        // The one in memory goes; nothing more is read for the removal.
        assert_eq!(t.remove_replica_pins("a", true), 1);
        assert_eq!(reads.lock().unwrap().len(), 1, "no page read by the removal");
        assert_eq!(t.get(key(3, 1)), None);
        // The rest go as their pages are read, and the next flush deletes them.
        assert_eq!(t.get(key(1, 1)), None);
        assert_eq!(t.replica_of(key(2, 1)).as_deref(), Some("b"));
        assert_eq!(t.replica_of(key(4, 1)).as_deref(), Some("a"), "its stored responses' ids stay");
        let deleted: Vec<_> = t.take_dirty().into_iter().filter(|(_, p)| p.is_none()).map(|(k, _)| k).collect();
        assert!(deleted.contains(&key(1, 1)) && deleted.contains(&key(3, 1)), "{deleted:?}");
        // A replica added again under the name keeps what it writes.
        t.record(key(5, 1), &Arc::from("a"), None, 100, 10, Default::default());
        t.load_all();
        assert_eq!(t.replica_of(key(5, 1)).as_deref(), Some("a"));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn a_page_read_during_a_removal_loses_the_replicas_pins_either_way() {
        // Many pages, read by one thread while another removes the replica.
        let disk: Vec<_> =
            (0..2_000u16).map(|p| (key(p * 30, 1), pin(if p % 2 == 0 { "a" } else { "b" }, 5))).collect();
        let table = Arc::new(paged(disk).0);
        let loader = {
            let t = table.clone();
            std::thread::spawn(move || t.load_all())
        };
        table.remove_replica("a");
        loader.join().unwrap();
        assert_eq!(table.len(), 1_000, "only b's pins");
        assert!(table.keys_of("a").is_empty());
    }

    #[test]
    fn an_unreadable_page_loses_its_pins_not_the_table() {
        let (t, _) = paged(vec![(key(666, 1), pin("a", 5)), (key(667, 1), pin("a", 5))]);
        assert_eq!(t.get(key(666, 1)), None);
        assert_eq!(t.replica_of(key(667, 1)).as_deref(), Some("a"));
        t.load_all();
        assert_eq!(t.pages_left(), 0);
    }
}
