//! A JSON value that borrows from the request body, and its canonical hash.
//!
//! Why not `serde_json::Value`: a `Value` of a 400 KB agent history copies
//! every string and builds a map per object (~0.4 ms for a Messages body).
//! Here a string without escapes is a slice of the body and an object is a
//! list of pairs; the identity hash needs nothing more.
//!
//! The canonical hash is the chain's definition (`chain.rs`) and must not
//! change: it equals what hashing the same document as a `serde_json::Value`
//! gave (numbers as `serde_json::Number` prints them, object keys sorted,
//! the last of duplicate keys winning), which a test checks on arbitrary
//! documents.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Number;
use smallvec::SmallVec;
use xxhash_rust::xxh3::Xxh3;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    /// Pairs in document order (duplicates kept; the last one counts).
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    pub(super) fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value of `key` in an object (the last one, as a map would keep).
    pub(super) fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(pairs) => pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub(super) fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }
}

/// A tagged, length-prefixed field: no two different field sequences hash
/// the same byte stream.
pub(super) fn field(h: &mut Xxh3, tag: u8, bytes: &[u8]) {
    h.update(&[tag]);
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Hashes a JSON value independently of formatting and key order, ignoring
/// object keys in `skip` at every depth; returns the content bytes it saw
/// (for the token estimate).
pub(super) fn canonical(h: &mut Xxh3, v: &Json, skip: &[&str]) -> usize {
    match v {
        Json::Null => {
            h.update(b"N");
            0
        }
        Json::Bool(b) => {
            h.update(if *b { b"T" } else { b"F" });
            1
        }
        Json::Number(n) => {
            let s = n.to_string();
            field(h, b'#', s.as_bytes());
            s.len()
        }
        Json::String(s) => {
            field(h, b's', s.as_bytes());
            s.len()
        }
        Json::Array(items) => {
            h.update(b"[");
            h.update(&(items.len() as u64).to_le_bytes());
            items.iter().map(|i| canonical(h, i, skip)).sum()
        }
        Json::Object(pairs) => {
            // Sorted by key; stable, so among duplicates the last stays last,
            // and `dedup_by` keeps it (it hands the later one first). On the
            // stack for objects of up to 8 keys (content blocks, tool calls).
            let mut unique: SmallVec<[&(Cow<str>, Json); 8]> =
                pairs.iter().filter(|(k, _)| !skip.contains(&&**k)).collect();
            unique.sort_by(|a, b| a.0.cmp(&b.0));
            unique.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    *kept = *later;
                }
                same
            });
            h.update(b"{");
            h.update(&(unique.len() as u64).to_le_bytes());
            let mut n = 0;
            for (k, v) in unique {
                field(h, b'k', k.as_bytes());
                n += canonical(h, v, skip);
            }
            n
        }
    }
}

/// A string that borrows from the input when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Key<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(JsonVisitor(std::marker::PhantomData)).and_then(|v| match v {
            Json::String(s) => Ok(Key(s)),
            _ => Err(de::Error::custom("a key must be a string")),
        })
    }
}

struct JsonVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for JsonVisitor<'a> {
    type Value = Json<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Json::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Number::from_f64(v).map(Json::Number).ok_or_else(|| E::custom("not a JSON number"))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Owned(v.to_string())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Owned(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element::<Json<'a>>()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::new();
        while let Some(Key(k)) = map.next_key::<Key<'a>>()? {
            pairs.push((k, map.next_value::<Json<'a>>()?));
        }
        Ok(Json::Object(pairs))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Json<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The definition this module must keep: the hash of a `serde_json::Value`.
    fn value_hash(h: &mut Xxh3, v: &Value, skip: &[&str]) -> usize {
        match v {
            Value::Null => {
                h.update(b"N");
                0
            }
            Value::Bool(b) => {
                h.update(if *b { b"T" } else { b"F" });
                1
            }
            Value::Number(n) => {
                let s = n.to_string();
                field(h, b'#', s.as_bytes());
                s.len()
            }
            Value::String(s) => {
                field(h, b's', s.as_bytes());
                s.len()
            }
            Value::Array(items) => {
                h.update(b"[");
                h.update(&(items.len() as u64).to_le_bytes());
                items.iter().map(|i| value_hash(h, i, skip)).sum()
            }
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().filter(|k| !skip.contains(&k.as_str())).collect();
                keys.sort_unstable();
                h.update(b"{");
                h.update(&(keys.len() as u64).to_le_bytes());
                let mut n = 0;
                for k in keys {
                    field(h, b'k', k.as_bytes());
                    n += value_hash(h, &map[k], skip);
                }
                n
            }
        }
    }

    fn both(text: &str, skip: &[&str]) -> ((u128, usize), (u128, usize)) {
        let (mut a, mut b) = (Xxh3::new(), Xxh3::new());
        let json: Json = serde_json::from_str(text).unwrap();
        let value: Value = serde_json::from_str(text).unwrap();
        let na = canonical(&mut a, &json, skip);
        let nb = value_hash(&mut b, &value, skip);
        ((a.digest128(), na), (b.digest128(), nb))
    }

    #[test]
    fn hashes_as_a_value_would_with_escapes_numbers_and_duplicate_keys() {
        for text in [
            r#"{"b":1,"a":[true,null,1.5e3,-7,18446744073709551615],"s":"esc\"aped \u00e9","cache_control":{"x":1}}"#,
            r#"{"k":1,"k":2,"j":{"k":"first","k":"last"}}"#,
            r#"[1.0, 0.1, 1e-7, 123456789012345678901234567890]"#,
            r#""plain""#,
        ] {
            let (a, b) = both(text, &["cache_control"]);
            assert_eq!(a, b, "{text}");
        }
    }

    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("null".to_string()),
            any::<bool>().prop_map(|b| b.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
            "[a-z\\\\\"\u{e9}\u{1F600} ]{0,8}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(|v| format!("[{}]", v.join(","))),
                proptest::collection::vec(("[a-c]{1,2}", inner), 0..5).prop_map(|v| {
                    let pairs: Vec<String> = v.iter().map(|(k, x)| format!("\"{k}\":{x}")).collect();
                    format!("{{{}}}", pairs.join(","))
                }),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn any_document_hashes_as_a_value_would(text in json_text()) {
            let (a, b) = both(&text, &["b"]);
            proptest::prop_assert_eq!(a, b, "{}", text);
        }
    }
}
