//! Persistence behind a small trait, so the gateway does not care where its
//! state lives: sled on disk by default, memory for unit tests, and room for
//! a shared networked store when several gateways run side by side.

mod memory;
mod migrations;
mod sled_store;

pub use memory::MemoryStore;
pub use migrations::{Migration, MIGRATIONS, SCHEMA_VERSION};
pub use sled_store::SledStore;

use serde::{Deserialize, Serialize};

use crate::events::Event;
use crate::fleet::{AdminState, ReplicaSpec};
use crate::pins::{Pin, PinChange};
use crate::policy::PrefixKey;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage error: {0}")]
    Backend(String),
    #[error("corrupt record in {tree}: {detail}")]
    Corrupt { tree: &'static str, detail: String },
    #[error(
        "the database was written by a newer prefixgate (schema {found}, this build knows up to {supported}); \
         upgrade prefixgate or point --data-dir elsewhere"
    )]
    TooNew { found: u64, supported: u64 },
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Backend(e.to_string())
    }
}

/// A replica as persisted: its spec and the operator's decision about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReplica {
    pub spec: ReplicaSpec,
    pub admin: AdminState,
}

pub trait Store: Send + Sync {
    /// True when the database was created by this process (config seeds it).
    fn is_new(&self) -> bool;
    fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError>;
    fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError>;
    fn delete_replica(&self, id: &str) -> Result<(), StoreError>;
    fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError>;
    /// Applies a batch of pin changes atomically.
    fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError>;
    /// Appends an event; drops persisted events with ids up to `dropped_up_to`.
    fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError>;
    fn events(&self) -> Result<Vec<Event>, StoreError>;
    fn setting(&self, key: &str) -> Result<Option<serde_json::Value>, StoreError>;
    fn put_setting(&self, key: &str, value: &serde_json::Value) -> Result<(), StoreError>;
    /// Makes everything written so far durable.
    fn flush(&self) -> Result<(), StoreError>;
}

/// Pin wire layout (schema 2), little endian:
/// `[1u8 version][created_ms u64][last_used_ms u64][turns u32][est_tokens u64][family u128][replica id utf-8...]`
pub fn encode_pin(p: &Pin) -> Vec<u8> {
    let mut v = Vec::with_capacity(45 + p.replica.len());
    v.push(1u8);
    v.extend_from_slice(&p.created_ms.to_le_bytes());
    v.extend_from_slice(&p.last_used_ms.to_le_bytes());
    v.extend_from_slice(&p.turns.to_le_bytes());
    v.extend_from_slice(&p.est_tokens.to_le_bytes());
    v.extend_from_slice(&p.family.to_le_bytes());
    v.extend_from_slice(p.replica.as_bytes());
    v
}

pub fn decode_pin(b: &[u8]) -> Result<Pin, String> {
    if b.len() < 45 || b[0] != 1 {
        return Err(format!("bad pin record ({} bytes)", b.len()));
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let replica = std::str::from_utf8(&b[45..]).map_err(|e| format!("pin replica id: {e}"))?;
    Ok(Pin {
        created_ms: u64_at(1),
        last_used_ms: u64_at(9),
        turns: u32::from_le_bytes(b[17..21].try_into().expect("4 bytes")),
        est_tokens: u64_at(21),
        family: u128::from_le_bytes(b[29..45].try_into().expect("16 bytes")),
        replica: replica.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_round_trip_through_the_binary_layout() {
        let p = Pin {
            replica: "gpu-1".into(),
            created_ms: 1,
            last_used_ms: u64::MAX,
            turns: 7,
            est_tokens: 90_000,
            family: 3 << 100,
        };
        assert_eq!(decode_pin(&encode_pin(&p)).unwrap(), p);
        assert!(decode_pin(b"{\"json\":1}").is_err());
        assert!(decode_pin(&[]).is_err());
    }
}
