//! A client's id and its cache salt, computed once per API key and kept:
//! each is a SHA-256 and a handful of small allocations, which every
//! request with a key paid twice (once for its priority, once for its
//! salt). Kept in two bounded caches (`CAPACITY` entries each, the least
//! recently used evicted): a gateway with more live keys than that pays the
//! hashes again for the ones evicted, no more. A key is kept only as its
//! 128-bit xxh3, never as itself.

use std::sync::Arc;

use moka::sync::Cache;
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

/// Most keys (and client ids) whose digests are kept.
pub const CAPACITY: u64 = 10_000;

pub struct ClientIds {
    by_key: Cache<u128, Arc<str>>,
    salts: Cache<Arc<str>, Arc<str>>,
}

impl Default for ClientIds {
    fn default() -> Self {
        ClientIds { by_key: Cache::new(CAPACITY), salts: Cache::new(CAPACITY) }
    }
}

/// A key's client id: `key-` and the first 12 hex digits of its SHA-256
/// (`printf %s "$KEY" | sha256sum | cut -c1-12`).
pub fn key_id(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("key-{hex}")
}

impl ClientIds {
    /// The client id of the API key `key` (`key_id`).
    pub fn of_key(&self, key: &str) -> Arc<str> {
        self.by_key.get_with(xxh3_128(key.as_bytes()), || Arc::from(key_id(key)))
    }

    /// The cache salt of `client`'s requests (`tenancy::cache_salt_for`).
    pub fn salt_of(&self, client: &Arc<str>) -> Arc<str> {
        self.salts.get_with_by_ref(client, || Arc::from(crate::policy::tenancy::cache_salt_for(client)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_id_and_salt_are_the_digests_and_kept_within_the_bound() {
        let ids = ClientIds::default();
        let id = ids.of_key("sk-one");
        assert_eq!(&*id, key_id("sk-one"));
        assert!(Arc::ptr_eq(&id, &ids.of_key("sk-one")), "computed once, then kept");
        assert_eq!(&*ids.salt_of(&id), crate::policy::tenancy::cache_salt_for(&id));
        for i in 0..3 * CAPACITY {
            ids.of_key(&format!("sk-{i}"));
        }
        ids.by_key.run_pending_tasks();
        assert!(ids.by_key.entry_count() <= CAPACITY, "{} kept", ids.by_key.entry_count());
    }
}
