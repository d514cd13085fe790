//! The embedded default store: sled, one tree per kind of state.

use crate::events::Pending;
use std::path::Path;

use super::{
    corrupt, decode_page, decode_pin_named, merge_page, migrations, page_of, Store, StoreError, StoredReplica,
};
use crate::events::Event;
use crate::pins::{Pin, PinChange};
use crate::policy::PrefixKey;

pub struct SledStore {
    trees: Trees,
    new: bool,
}

/// The database and its trees (each a cheap handle to shared state): what
/// a call takes to the blocking pool.
#[derive(Clone)]
struct Trees {
    db: sled::Db,
    replicas: sled::Tree,
    pins: sled::Tree,
    events: sled::Tree,
    settings: sled::Tree,
}

/// Opens the database, waiting up to `LOCK_WAIT` for its file lock: sled's
/// own threads let go of it a moment after the last handle of a previous
/// open is dropped (a restart in-process, a test reopening). Another process
/// holding it still fails, after that wait, with sled's error.
fn open_db(path: &Path) -> Result<sled::Db, StoreError> {
    const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match sled::Config::new().path(path).open() {
            // sled says so only in the message (an io::Error of kind Other).
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock") && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return Ok(other?),
        }
    }
}

impl SledStore {
    pub fn open(dir: &Path) -> Result<SledStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Backend(format!("cannot create {}: {e}", dir.display())))?;
        let db = open_db(&dir.join("db"))?;
        let new = migrations::read_version(&db)? == 0 && db.tree_names().len() <= 1;
        migrations::run(&db)?;
        let trees = Trees {
            replicas: db.open_tree("replicas")?,
            pins: db.open_tree("pin_pages")?,
            events: db.open_tree("events")?,
            settings: db.open_tree("settings")?,
            db,
        };
        Ok(SledStore { trees, new })
    }

    /// Bytes on disk (for the size measurements in the docs).
    pub fn size_on_disk(&self) -> u64 {
        self.trees.db.size_on_disk().unwrap_or(0)
    }

    /// Runs `call` on the blocking pool: sled's reads may wait on the disk
    /// and a flush on fsync, and no runtime worker waits on either.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Trees) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let trees = self.trees.clone();
        tokio::task::spawn_blocking(move || call(&trees))
            .await
            .map_err(|e| StoreError::Backend(format!("the store call did not finish: {e}")))?
    }
}

#[async_trait::async_trait]
impl Store for SledStore {
    fn is_new(&self) -> bool {
        self.new
    }

    async fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        self.blocking(|t| t.replicas()).await
    }

    async fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        let r = r.clone();
        self.blocking(move |t| t.put_replica(&r)).await
    }

    async fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_string();
        self.blocking(move |t| t.delete_replica(&id)).await
    }

    /// Pages are read on the caller's thread: the first touch of a key in
    /// a page still on disk (a few tens of microseconds, once per page), or
    /// the background loader.
    fn pin_pages(&self) -> Option<crate::pins::PageReader> {
        let pins = self.trees.pins.clone();
        Some(Box::new(move |page| {
            let Some(bytes) = pins.get(page.to_be_bytes()).map_err(|e| e.to_string())? else { return Ok(Vec::new()) };
            let mut names = super::ReplicaNames::default();
            decode_page(&bytes)?
                .into_iter()
                .map(|(key, record)| Ok((key, decode_pin_named(record, &mut names)?)))
                .collect()
        }))
    }

    async fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        self.blocking(|t| t.pins()).await
    }

    async fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        let changes = changes.to_vec();
        self.blocking(move |t| t.write_pins(&changes)).await
    }

    async fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        let e = e.clone();
        self.blocking(move |t| t.append_event(&e, dropped_up_to)).await
    }

    async fn append_events(&self, batch: &[crate::events::Pending]) -> Result<(), StoreError> {
        let batch = batch.to_vec();
        self.blocking(move |t| t.append_events(&batch)).await
    }

    async fn events(&self) -> Result<Vec<Event>, StoreError> {
        self.blocking(|t| t.events()).await
    }

    async fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, StoreError> {
        let key = key.to_string();
        self.blocking(move |t| t.setting(&key)).await
    }

    async fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), StoreError> {
        let (key, value) = (key.to_string(), value.clone());
        self.blocking(move |t| t.put_setting(&key, &value)).await
    }

    async fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let prefix = prefix.to_string();
        self.blocking(move |t| t.settings(&prefix)).await
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.blocking(|t| t.flush()).await
    }
}

impl Trees {
    fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        self.replicas
            .iter()
            .map(|item| {
                let (_, v) = item?;
                serde_json::from_slice(&v).map_err(|e| corrupt("replicas")(e.to_string()))
            })
            .collect()
    }

    fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        let v = serde_json::to_vec(r).map_err(|e| StoreError::Backend(e.to_string()))?;
        self.replicas.insert(r.spec.id.as_bytes(), v)?;
        Ok(())
    }

    fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        self.replicas.remove(id.as_bytes())?;
        Ok(())
    }

    fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        let mut out = Vec::new();
        let mut names = super::ReplicaNames::default();
        for item in self.pins.iter() {
            let (_, page) = item?;
            for (key, record) in decode_page(&page).map_err(corrupt("pin_pages"))? {
                out.push((key, decode_pin_named(record, &mut names).map_err(corrupt("pin_pages"))?));
            }
        }
        Ok(out)
    }

    /// One read-modify-write per touched page, all in one atomic batch.
    /// Only the flusher writes pins, so no two merges of a page race.
    fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        let mut by_page: std::collections::BTreeMap<[u8; 2], Vec<&PinChange>> = Default::default();
        for change in changes {
            by_page.entry(page_of(change.0)).or_default().push(change);
        }
        let mut batch = sled::Batch::default();
        for (page, changes) in by_page {
            let current = self.pins.get(page)?;
            let merged = merge_page(current.as_deref().unwrap_or(&[]), &changes).map_err(corrupt("pin_pages"))?;
            if merged.is_empty() {
                batch.remove(&page[..]);
            } else {
                batch.insert(&page[..], merged);
            }
        }
        self.pins.apply_batch(batch)?;
        Ok(())
    }

    fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        let v = serde_json::to_vec(e).map_err(|e| StoreError::Backend(e.to_string()))?;
        self.events.insert(e.id.to_be_bytes(), v)?;
        if let Some(upto) = dropped_up_to {
            let mut batch = sled::Batch::default();
            for item in self.events.range(..=upto.to_be_bytes()) {
                batch.remove(item?.0);
            }
            self.events.apply_batch(batch)?;
        }
        Ok(())
    }

    /// One sled batch for the events, then the trim.
    fn append_events(&self, batch: &[Pending]) -> Result<(), StoreError> {
        let mut writes = sled::Batch::default();
        for Pending { event: e, .. } in batch {
            writes.insert(&e.id.to_be_bytes(), serde_json::to_vec(e).map_err(|e| StoreError::Backend(e.to_string()))?);
        }
        if let Some(upto) = batch.iter().filter_map(|p| p.dropped_upto).max() {
            for item in self.events.range(..=upto.to_be_bytes()) {
                writes.remove(item?.0);
            }
        }
        self.events.apply_batch(writes)?;
        Ok(())
    }

    fn events(&self) -> Result<Vec<Event>, StoreError> {
        self.events
            .iter()
            .map(|item| {
                let (_, v) = item?;
                serde_json::from_slice(&v).map_err(|e| corrupt("events")(e.to_string()))
            })
            .collect()
    }

    fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, StoreError> {
        match self.settings.get(key)? {
            Some(v) => serde_json::from_slice(&v).map(Some).map_err(|e| corrupt("settings")(e.to_string())),
            None => Ok(None),
        }
    }

    fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), StoreError> {
        self.settings.insert(key, serde_json::to_vec(value).map_err(|e| StoreError::Backend(e.to_string()))?)?;
        Ok(())
    }

    fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        self.settings
            .scan_prefix(prefix)
            .map(|item| {
                let (k, v) = item?;
                let name = String::from_utf8(k.to_vec()).map_err(|e| corrupt("settings")(e.to_string()))?;
                Ok((name, serde_json::from_slice(&v).map_err(|e| corrupt("settings")(e.to_string()))?))
            })
            .collect()
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_schema_1_database_is_migrated_and_its_pins_load() {
        let dir = tempfile::tempdir().unwrap();
        let pin = Pin {
            replica: "a".into(),
            created_ms: 5,
            last_used_ms: 6,
            turns: 2,
            est_tokens: 100,
            family: 7,
            origin: Default::default(),
            went_on: 0,
        };
        {
            // What the first schema wrote: version 1 and JSON pins.
            let db = sled::Config::new().path(dir.path().join("db")).open().unwrap();
            for t in migrations::TREES {
                db.open_tree(t).unwrap();
            }
            let v1 = br#"{"replica":"a","created_ms":5,"last_used_ms":6,"turns":2,"est_tokens":100}"#;
            db.open_tree("pins").unwrap().insert(7u128.to_be_bytes(), &v1[..]).unwrap();
            db.insert("schema_version", &1u64.to_be_bytes()).unwrap();
            db.flush().unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        assert!(!store.is_new());
        assert_eq!(store.pins().await.unwrap(), vec![(7, pin.clone())]);
        assert!(store.trees.db.open_tree("pins").unwrap().is_empty(), "moved into pages");
        // Changes after the migration land in the pages.
        store.write_pins(&[(7, None), (8, Some(pin.clone()))]).await.unwrap();
        assert_eq!(store.pins().await.unwrap(), vec![(8, pin)]);
        assert_eq!(migrations::read_version(&store.trees.db).unwrap(), migrations::SCHEMA_VERSION);
    }

    #[test]
    fn a_database_from_a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::Config::new().path(dir.path().join("db")).open().unwrap();
            db.insert("schema_version", &99u64.to_be_bytes()).unwrap();
            db.flush().unwrap();
        }
        // sled's own threads let go of the file lock a moment after the
        // handle is dropped: until then, an open fails on the lock instead.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let err = loop {
            let err = SledStore::open(dir.path()).err().expect("must refuse");
            if !err.to_string().contains("could not acquire lock") || std::time::Instant::now() > deadline {
                break err;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert!(err.to_string().contains("newer prefixgate"), "{err}");
    }

    #[test]
    fn a_new_database_reports_new_then_not() {
        let dir = tempfile::tempdir().unwrap();
        assert!(SledStore::open(dir.path()).unwrap().is_new());
        assert!(!SledStore::open(dir.path()).unwrap().is_new());
    }
}
