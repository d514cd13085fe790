//! Tenants apart, where the operator asks (`identity.scope`,
//! `identity.cache_salt`).
//!
//! A conversation's shape identity is the same whoever sends it: two
//! tenants who send the same system prompt and first messages share a pin,
//! land on the same replica and hit each other's prefix cache. That is
//! usually what an operator wants (a common system prompt is worth
//! sharing), and the default stays shared. Where tenants must not see each
//! other it is a timing side channel: a cache hit shows in the time to
//! first token, so one tenant can test whether another sent a prompt.
//!
//! - **`scope = "client"`** folds the client (an API key's hash, as
//!   priority names it) into every key the request is routed by: its prefix
//!   boundaries, its session key and a stored response's key. Two clients'
//!   identical conversations never share a pin, and a client cannot reach
//!   another's stored-response pin. Keys of one client keep their prefix
//!   relations (each boundary is mapped on its own), so routing within a
//!   tenant is unchanged.
//! - **`cache_salt = "client"`** also sets vLLM's `cache_salt` on bodies
//!   that carry none, so the engine keeps the tenants' prefix caches apart
//!   too: one of the two edits the gateway makes to a body (README). The salt is in the body
//!   before the shape is read, so it is in the identity as well.
//!
//! Pure: no I/O, no clock.

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use super::{PrefixKey, RequestShape};

/// Whose conversations share pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum IdentityScope {
    /// Everyone's: the same conversation is one, whoever sends it.
    #[default]
    Shared,
    /// Each client's own: the client is part of every key.
    Client,
}

/// What the gateway sets as vLLM's `cache_salt` on bodies that have none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CacheSalt {
    /// Nothing: bodies are forwarded as sent.
    #[default]
    None,
    /// A salt derived from the client (`cache_salt_for`).
    Client,
}

/// What the capacity view says of tenants: whether they share pins and
/// whether the engines keep their caches apart (`identity.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Tenancy {
    pub scope: IdentityScope,
    pub cache_salt: CacheSalt,
}

/// The tenant a request's keys belong to: everyone's (`shared`) or one
/// client's. `Copy`: it travels with the request to where pins are recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scope(Option<u64>);

impl Scope {
    /// A request's scope under `scope` for `client` (priority's client id).
    pub fn of(scope: IdentityScope, client: &str) -> Scope {
        match scope {
            IdentityScope::Shared => Scope(None),
            IdentityScope::Client => Scope(Some(xxhash_rust::xxh3::xxh3_64(client.as_bytes()))),
        }
    }

    /// `key` as this tenant knows it (the key itself when shared).
    pub fn key(self, key: PrefixKey) -> PrefixKey {
        let Some(tenant) = self.0 else { return key };
        let mut h = Xxh3::new();
        h.update(b"prefixgate/tenant\0");
        h.update(&tenant.to_le_bytes());
        h.update(&key.to_le_bytes());
        h.digest128()
    }

    /// Maps every key of `shape` into this tenant's.
    pub fn shape(self, shape: &mut RequestShape) {
        if self.0.is_none() {
            return;
        }
        for b in shape.boundaries.iter_mut().chain(shape.leads.iter_mut().flatten()) {
            b.key = self.key(b.key);
        }
        shape.pin_at = shape.pin_at.map(|k| self.key(k));
    }
}

/// The salt a client's requests carry: 32 hex digits of a SHA-256 over the
/// client id (itself a hash of the API key: the key never reaches the engine
/// through it).
pub fn cache_salt_for(client: &str) -> String {
    let digest = Sha256::digest([b"prefixgate/cache_salt\0".as_slice(), client.as_bytes()].concat());
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

#[derive(Deserialize)]
struct SaltField {
    #[serde(default)]
    cache_salt: Option<IgnoredAny>,
}

/// `body` with `"cache_salt": salt` added as its first member, when it is a
/// JSON object that has no `cache_salt` (None: forwarded as it is: not an
/// object, not JSON, or salted by the client already). `salt` is hex: it
/// needs no escaping.
pub fn with_cache_salt(body: &[u8], salt: &str) -> Option<Vec<u8>> {
    let parsed: SaltField = serde_json::from_slice(body).ok()?;
    if parsed.cache_salt.is_some() {
        return None;
    }
    let open = body.iter().position(|b| !b.is_ascii_whitespace()).filter(|&i| body[i] == b'{')?;
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let member = format!("\"cache_salt\":\"{salt}\"{}", if empty { "" } else { "," });
    let mut out = Vec::with_capacity(body.len() + member.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::{extract, Endpoint};
    use crate::policy::IdentityBlocks;

    fn chat(body: &str) -> RequestShape {
        extract(Endpoint::Chat, body.as_bytes(), IdentityBlocks::default()).unwrap()
    }

    const CONVO: &str = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}"#;

    #[test]
    fn shared_scope_changes_nothing() {
        let mut shape = chat(CONVO);
        let before = shape.clone();
        Scope::of(IdentityScope::Shared, "key-aaaaaaaaaaaa").shape(&mut shape);
        assert_eq!(shape, before);
        assert_eq!(Scope::default().key(7), 7);
    }

    #[test]
    fn client_scope_keeps_a_clients_prefixes_and_parts_two_clients() {
        let (a, b) = (Scope::of(IdentityScope::Client, "key-a"), Scope::of(IdentityScope::Client, "key-b"));
        let (mut for_a, mut for_b, mut shorter_a) = (chat(CONVO), chat(CONVO), chat(CONVO));
        shorter_a.boundaries.truncate(2);
        shorter_a.pin_at = Some(shorter_a.boundaries[1].key);
        a.shape(&mut for_a);
        b.shape(&mut for_b);
        a.shape(&mut shorter_a);
        for (x, y) in for_a.boundaries.iter().zip(&for_b.boundaries) {
            assert_ne!(x.key, y.key, "two clients never share a key");
            assert_eq!(x.bytes, y.bytes);
        }
        assert_eq!(shorter_a.pin_at, Some(for_a.boundaries[1].key), "a client's later turn extends its earlier one");
        assert_eq!(for_a.pin_at, Some(for_a.boundaries[3].key));
        assert_eq!(a.key(42), Scope::of(IdentityScope::Client, "key-a").key(42), "stable");
        assert_ne!(a.key(42), 42);
    }

    #[test]
    fn a_salt_is_added_to_objects_that_have_none_and_nothing_else_changes() {
        let salt = cache_salt_for("key-0123456789ab");
        assert_eq!(salt.len(), 32);
        assert_ne!(salt, cache_salt_for("key-ba9876543210"));
        let salted = with_cache_salt(br#" {"model":"m","messages":[]}"#, &salt).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&salted).unwrap();
        assert_eq!(v["cache_salt"], salt.as_str());
        assert_eq!(v["model"], "m");
        assert_eq!(
            std::str::from_utf8(&salted).unwrap(),
            format!(r#" {{"cache_salt":"{salt}","model":"m","messages":[]}}"#)
        );
        let empty = with_cache_salt(b"{ }", "ab").unwrap();
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&empty).unwrap(),
            serde_json::json!({"cache_salt": "ab"})
        );
        // The client's own salt stands; what is not an object is not touched.
        assert!(with_cache_salt(br#"{"cache_salt":"mine","model":"m"}"#, "ab").is_none());
        for other in [&b"[1]"[..], b"not json", b"", b"\"s\""] {
            assert!(with_cache_salt(other, "ab").is_none(), "{other:?}");
        }
    }

    #[test]
    fn a_salted_body_has_another_identity() {
        let salted = with_cache_salt(CONVO.as_bytes(), &cache_salt_for("key-a")).unwrap();
        let shape = extract(Endpoint::Chat, &salted, IdentityBlocks::default()).unwrap();
        assert_ne!(shape.pin_at, chat(CONVO).pin_at);
    }
}
