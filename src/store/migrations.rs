//! Numbered schema migrations, embedded from `migrations/`. Each file names
//! the operations it runs; the operations live here. The runner applies every
//! migration above the database's version in order and records the version
//! after each, so an interrupted upgrade resumes where it stopped (every
//! operation is idempotent).

use serde::Deserialize;

use super::{encode_pin, merge_page, page_of, StoreError};
use crate::pins::Pin;

pub struct Migration {
    pub version: u64,
    pub file: &'static str,
    pub text: &'static str,
}

pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, file: "0001_initial.toml", text: include_str!("../../migrations/0001_initial.toml") },
    Migration {
        version: 2,
        file: "0002_compact_pins.toml",
        text: include_str!("../../migrations/0002_compact_pins.toml"),
    },
    Migration { version: 3, file: "0003_pin_pages.toml", text: include_str!("../../migrations/0003_pin_pages.toml") },
];

/// The schema this build writes.
pub const SCHEMA_VERSION: u64 = 3;

pub const TREES: &[&str] = &["replicas", "pins", "events", "settings"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrationFile {
    #[allow(dead_code)]
    description: String,
    ops: Vec<String>,
}

/// A pin as schema 1 wrote it (JSON).
#[derive(Deserialize)]
struct PinV1 {
    replica: String,
    created_ms: u64,
    last_used_ms: u64,
    turns: u32,
    est_tokens: u64,
}

/// Brings `db` from its recorded version up to `SCHEMA_VERSION`.
pub fn run(db: &sled::Db) -> Result<(), StoreError> {
    let found = read_version(db)?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::TooNew { found, supported: SCHEMA_VERSION });
    }
    for m in MIGRATIONS.iter().filter(|m| m.version > found) {
        let file: MigrationFile = toml::from_str(m.text)
            .map_err(|e| StoreError::Backend(format!("embedded migration {} is invalid: {e}", m.file)))?;
        for op in &file.ops {
            apply(db, op).map_err(|e| StoreError::Backend(format!("migration {} ({op}): {e}", m.file)))?;
        }
        db.insert("schema_version", &m.version.to_be_bytes())?;
        db.flush()?;
        tracing::info!("applied migration {}", m.file);
    }
    Ok(())
}

pub fn read_version(db: &sled::Db) -> Result<u64, StoreError> {
    Ok(match db.get("schema_version")? {
        Some(v) => u64::from_be_bytes(
            v.as_ref()
                .try_into()
                .map_err(|_| StoreError::Corrupt { tree: "default", detail: "schema_version is not 8 bytes".into() })?,
        ),
        None => 0,
    })
}

fn apply(db: &sled::Db, op: &str) -> Result<(), StoreError> {
    match op {
        "create_trees" => {
            for t in TREES {
                db.open_tree(t)?;
            }
            Ok(())
        }
        "reencode_pins_binary" => {
            let pins = db.open_tree("pins")?;
            let mut batch = sled::Batch::default();
            for item in pins.iter() {
                let (k, v) = item?;
                if v.first() == Some(&b'{') {
                    let old: PinV1 = serde_json::from_slice(&v)
                        .map_err(|e| StoreError::Corrupt { tree: "pins", detail: e.to_string() })?;
                    let key = u128::from_be_bytes(
                        k.as_ref()
                            .try_into()
                            .map_err(|_| StoreError::Corrupt { tree: "pins", detail: "key is not 16 bytes".into() })?,
                    );
                    let pin = Pin {
                        replica: old.replica.into(),
                        created_ms: old.created_ms,
                        last_used_ms: old.last_used_ms,
                        turns: old.turns,
                        est_tokens: old.est_tokens,
                        // Schema 1 had no families: each pin starts its own.
                        family: key,
                        origin: Default::default(),
                        went_on: 0,
                    };
                    batch.insert(k, encode_pin(&pin));
                }
            }
            pins.apply_batch(batch)?;
            Ok(())
        }
        "pins_into_pages" => {
            let pins = db.open_tree("pins")?;
            let pages = db.open_tree("pin_pages")?;
            let mut by_page: std::collections::BTreeMap<[u8; 2], Vec<crate::pins::PinChange>> = Default::default();
            for item in pins.iter() {
                let (k, v) = item?;
                let key = u128::from_be_bytes(
                    k.as_ref()
                        .try_into()
                        .map_err(|_| StoreError::Corrupt { tree: "pins", detail: "key is not 16 bytes".into() })?,
                );
                let pin = super::decode_pin(&v).map_err(|detail| StoreError::Corrupt { tree: "pins", detail })?;
                by_page.entry(page_of(key)).or_default().push((key, Some(pin)));
            }
            let mut batch = sled::Batch::default();
            for (page, changes) in &by_page {
                let current = pages.get(page)?.map(|v| v.to_vec()).unwrap_or_default();
                let merged = merge_page(&current, &changes.iter().collect::<Vec<_>>())
                    .map_err(|detail| StoreError::Corrupt { tree: "pin_pages", detail })?;
                batch.insert(&page[..], merged);
            }
            pages.apply_batch(batch)?;
            pages.flush()?;
            pins.clear()?;
            Ok(())
        }
        other => Err(StoreError::Backend(format!("unknown migration operation '{other}'"))),
    }
}
