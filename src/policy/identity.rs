//! Conversation identity: the hash chain at message (or block) boundaries.
//!
//! Why a chain and not "the first N KiB": a fixed window silently never pins
//! when the shared prefix is shorter than the window (the varying tail falls
//! inside it and every turn hashes differently). With a chain, boundary `i`
//! of turn 2 equals the last boundary of turn 1 whenever turn 2 extends it,
//! however short turn 1 was.
//!
//! The hash is XXH3-128 (xxhash-rust), a published, stable algorithm: keys
//! are persisted, so they must not change between builds or platforms
//! (std's `DefaultHasher` gives no such promise).
//!
//! Chain definition (stable; changing it orphans every persisted pin):
//! - `h0 = xxh3_128("prefixgate/v1\0" ++ field(model))`
//! - `h_i = xxh3_128(h_{i-1} as 16 LE bytes ++ canonical(unit_i))`
//! - chat: a unit is one message; canonical = tagged, length-prefixed role,
//!   name, content (text, or parts as canonical JSON with sorted keys),
//!   tool_calls (canonical JSON) and tool_call_id. JSON formatting, key order
//!   and string escapes do not matter.
//! - completions with a string prompt: a unit is a block of `block_bytes`
//!   bytes of the decoded prompt; the trailing partial block is a unit too.
//! - completions with a token-array prompt: a unit is a block of
//!   `block_tokens` token ids (u32 LE).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

/// A 128-bit key naming one prompt prefix (model included).
pub type PrefixKey = u128;

/// Block sizes for prompts that have no message boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct IdentityBlocks {
    /// Bytes per identity block of a `/v1/completions` string prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    #[schema(minimum = 1, maximum = 1073741824)]
    pub block_bytes: usize,
    /// Token ids per identity block of a `/v1/completions` token-array prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    #[schema(minimum = 1, maximum = 1073741824)]
    pub block_tokens: usize,
}

impl Default for IdentityBlocks {
    fn default() -> Self {
        IdentityBlocks { block_bytes: 1024, block_tokens: 256 }
    }
}

/// One point in the prompt where a prefix ends and could be cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    pub key: PrefixKey,
    /// Prompt content bytes up to and including this unit (for token estimates).
    pub bytes: usize,
}

/// The API a request speaks: it decides the identity rules, how usage and
/// the end of a stream are read, and the shape of error bodies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// OpenAI `/v1/chat/completions`.
    #[default]
    Chat,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI Responses, `/v1/responses` (Codex-style agents).
    Responses,
    /// Anthropic Messages, `/v1/messages` (Claude-Code-style agents).
    Messages,
    /// Anything else under `/v1`.
    Other,
}

impl Dialect {
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Chat => "chat",
            Dialect::Completions => "completions",
            Dialect::Responses => "responses",
            Dialect::Messages => "messages",
            Dialect::Other => "other",
        }
    }
}

/// What the router needs to know about a request, and nothing more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestShape {
    pub dialect: Dialect,
    pub model: Option<String>,
    /// Boundaries in prompt order; empty when the request has no prompt identity.
    pub boundaries: Vec<Boundary>,
    /// True when the request carries history (more than one message, or more
    /// than one block): only such requests may be continuations.
    pub multi_unit: bool,
    /// Where a served request records its pin (None: never pinned).
    pub pin_at: Option<PrefixKey>,
    /// Prompt content bytes (for the token estimate).
    pub prompt_bytes: usize,
    /// The client's own name for the conversation: `prompt_cache_key`.
    pub cache_key: Option<String>,
    /// Responses API: the stored response this request continues.
    pub previous_response: Option<String>,
}

/// Input the router cannot route; becomes a 400 with this message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which extraction a path gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
    /// Any other `/v1/*` path: only the model is read, never required.
    Other,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Endpoint {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/responses" => Endpoint::Responses,
            "/v1/messages" => Endpoint::Messages,
            _ => Endpoint::Other,
        }
    }

    /// The API a path speaks (the shape of its errors, among other things).
    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Chat => Dialect::Chat,
            Endpoint::Completions => Dialect::Completions,
            Endpoint::Responses => Dialect::Responses,
            Endpoint::Messages => Dialect::Messages,
            Endpoint::Other => Dialect::Other,
        }
    }
}

pub fn extract(endpoint: Endpoint, body: &[u8], blocks: IdentityBlocks) -> Result<RequestShape, ShapeError> {
    match endpoint {
        Endpoint::Chat => extract_chat(body),
        Endpoint::Completions => extract_completion(body, blocks),
        Endpoint::Responses => super::agents::extract_responses(body),
        Endpoint::Messages => super::agents::extract_messages(body),
        Endpoint::Other => Ok(extract_other(body)),
    }
}

/// Parses a request body. JSON text is UTF-8 (RFC 8259), so the body is
/// checked once as a whole and parsed as text: parsing bytes would check
/// every string again on its own, a dozen calls on a short chat request.
pub(super) fn parse_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ShapeError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ShapeError(format!("invalid JSON body: not UTF-8 at byte {}", e.valid_up_to())))?;
    serde_json::from_str(text).map_err(|e| ShapeError(format!("invalid JSON body: {e}")))
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(default)]
    tool_calls: Option<Value>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
}

/// Message content: plain text (borrowed when it has no escapes) or anything
/// else (parts), kept as a JSON value. One pass over the body either way.
enum Content<'a> {
    Text(Cow<'a, str>),
    Structured(Value),
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                Value::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(Content::Structured)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Value::deserialize(de::value::MapAccessDeserializer::new(map)).map(Content::Structured)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

fn extract_chat(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let parsed: ChatBody = parse_body(body)?;
    if parsed.messages.is_empty() {
        return Err(ShapeError("'messages' must contain at least one message".into()));
    }
    let mut chain = Chain::first_link(parsed.model.as_deref(), parsed.cache_salt.as_deref(), &[]);
    let mut boundaries = Vec::with_capacity(parsed.messages.len());
    let mut bytes = 0usize;
    for m in &parsed.messages {
        let h = chain.unit();
        field(h, b'r', m.role.as_bytes());
        if let Some(name) = &m.name {
            field(h, b'n', name.as_bytes());
        }
        match &m.content {
            Some(Content::Text(t)) => {
                field(h, b'c', t.as_bytes());
                bytes += t.len();
            }
            Some(Content::Structured(v)) => {
                h.update(b"p");
                bytes += canonical_value(h, v);
            }
            None => {}
        }
        if let Some(calls) = &m.tool_calls {
            h.update(b"t");
            bytes += canonical_value(h, calls);
        }
        if let Some(id) = &m.tool_call_id {
            field(h, b'i', id.as_bytes());
        }
        bytes += m.role.len();
        boundaries.push(Boundary { key: chain.close(), bytes });
    }
    Ok(RequestShape {
        dialect: Dialect::Chat,
        model: parsed.model.map(Cow::into_owned),
        pin_at: boundaries.last().map(|b| b.key),
        multi_unit: boundaries.len() > 1,
        boundaries,
        prompt_bytes: bytes,
        cache_key: parsed.prompt_cache_key.map(Cow::into_owned),
        previous_response: None,
    })
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    prompt: Prompt<'a>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

/// A completions prompt: one string, one token array, or a batch (several
/// prompts in one request: spread, never pinned).
enum Prompt<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
    Batch,
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Prompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of token ids, or an array of prompts")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut tokens = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                let mut batch = false;
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    match item {
                        PromptItem::Token(t) if !batch => tokens.push(t),
                        _ => batch = true,
                    }
                }
                Ok(if batch { Prompt::Batch } else { Prompt::Tokens(tokens) })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// One element of a prompt array: a token id, or something else (a batch member).
enum PromptItem {
    Token(u32),
    Other,
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id, a string or an array of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v).map(PromptItem::Token).map_err(|_| E::custom("token id out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v).map(PromptItem::Token).map_err(|_| E::custom("token id out of range"))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(PromptItem::Other)
            }
        }
        d.deserialize_any(V)
    }
}

fn extract_completion(body: &[u8], blocks: IdentityBlocks) -> Result<RequestShape, ShapeError> {
    let parsed: CompletionBody = parse_body(body)?;
    let mut chain = Chain::first_link(parsed.model.as_deref(), parsed.cache_salt.as_deref(), &[]);
    let mut boundaries = Vec::new();
    let (prompt_bytes, full_blocks) = match &parsed.prompt {
        Prompt::Text(text) => {
            let bytes = text.as_bytes();
            let size = blocks.block_bytes.max(1);
            for (i, block) in bytes.chunks(size).enumerate() {
                chain.unit().update(block);
                boundaries.push(Boundary { key: chain.close(), bytes: (i * size + block.len()) });
            }
            (bytes.len(), bytes.len() / size)
        }
        Prompt::Tokens(tokens) => {
            let size = blocks.block_tokens.max(1);
            for (i, block) in tokens.chunks(size).enumerate() {
                let h = chain.unit();
                for t in block {
                    h.update(&t.to_le_bytes());
                }
                // Token counts are converted to the bytes-per-token estimate's unit.
                boundaries.push(Boundary {
                    key: chain.close(),
                    bytes: (i * size + block.len()) * crate::tokens::BYTES_PER_TOKEN,
                });
            }
            (tokens.len() * crate::tokens::BYTES_PER_TOKEN, tokens.len() / size)
        }
        Prompt::Batch => (0, 0),
    };
    // The pin sits at the last *full* block: a later turn that extends this
    // prompt shares every full block, but not the partial tail.
    let pin_at = match full_blocks {
        0 => boundaries.last().map(|b| b.key),
        n => Some(boundaries[n - 1].key),
    };
    Ok(RequestShape {
        dialect: Dialect::Completions,
        model: parsed.model.map(Cow::into_owned),
        multi_unit: boundaries.len() > 1,
        pin_at,
        boundaries,
        prompt_bytes,
        cache_key: parsed.prompt_cache_key.map(Cow::into_owned),
        previous_response: None,
    })
}

#[derive(Deserialize)]
struct OtherBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

/// Other endpoints (embeddings, audio, ...): the model if the body is a JSON
/// object that names one; the body is forwarded whatever it is.
fn extract_other(body: &[u8]) -> RequestShape {
    let model = parse_body::<OtherBody>(body).ok().and_then(|b| b.model.map(Cow::into_owned));
    RequestShape { dialect: Dialect::Other, model, ..RequestShape::default() }
}

/// The running hash chain. One hasher serves every unit of a request (reset
/// between units): a fresh XXH3 state is ~600 bytes to set up and move.
pub(super) struct Chain {
    prev: PrefixKey,
    h: Xxh3,
}

impl Chain {
    /// The chain's first link: the model, then what the engine caches ahead
    /// of the first message: vLLM's `cache_salt` (requests with different
    /// salts never share cache), and a dialect's instructions, system prompt
    /// and tools (tagged values). With none of these it is exactly the
    /// original `h0 = xxh3(tag ++ field(model))`, so persisted keys hold.
    pub(super) fn first_link(model: Option<&str>, salt: Option<&str>, extra: &[(u8, &Value, &[&str])]) -> Chain {
        let mut h = Xxh3::new();
        h.update(b"prefixgate/v1\0");
        field(&mut h, b'm', model.unwrap_or("").as_bytes());
        if let Some(salt) = salt {
            field(&mut h, b'z', salt.as_bytes());
        }
        for (tag, v, skip) in extra {
            h.update(&[*tag]);
            canonical_value_skipping(&mut h, v, skip);
        }
        Chain { prev: h.digest128(), h }
    }

    /// Starts the next unit: the hasher, seeded with the chain so far.
    pub(super) fn unit(&mut self) -> &mut Xxh3 {
        self.h.reset();
        self.h.update(&self.prev.to_le_bytes());
        &mut self.h
    }

    /// Ends the unit `unit` started: its key, which the next unit extends.
    pub(super) fn close(&mut self) -> PrefixKey {
        self.prev = self.h.digest128();
        self.prev
    }
}

/// A tagged, length-prefixed field: no two different field sequences hash
/// the same byte stream.
pub(super) fn field(h: &mut Xxh3, tag: u8, bytes: &[u8]) {
    h.update(&[tag]);
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Hashes a JSON value independently of formatting and key order; returns the
/// content bytes it saw (for the token estimate).
fn canonical_value(h: &mut Xxh3, v: &Value) -> usize {
    canonical_value_skipping(h, v, &[])
}

/// `canonical_value`, ignoring object keys in `skip` at every depth: fields a
/// client changes between turns without changing the prompt (Anthropic's
/// `cache_control` markers move to the newest message each turn; Responses
/// items carry server ids some clients strip when they send them back).
pub(super) fn canonical_value_skipping(h: &mut Xxh3, v: &Value, skip: &[&str]) -> usize {
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
            items.iter().map(|i| canonical_value_skipping(h, i, skip)).sum()
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().filter(|k| !skip.contains(&k.as_str())).collect();
            keys.sort_unstable();
            h.update(b"{");
            h.update(&(keys.len() as u64).to_le_bytes());
            let mut n = 0;
            for k in keys {
                field(h, b'k', k.as_bytes());
                n += canonical_value_skipping(h, &map[k], skip);
            }
            n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> RequestShape {
        extract(Endpoint::Chat, body.as_bytes(), IdentityBlocks::default()).unwrap()
    }

    #[test]
    fn formatting_key_order_and_escapes_do_not_change_keys() {
        let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi /x"}]}"#);
        let b = chat("{ \"messages\" : [ { \"content\" : \"hi \\/x\" , \"role\" : \"user\" } ], \"model\": \"m\", \"temperature\": 0 }");
        assert_eq!(a.boundaries[0].key, b.boundaries[0].key);
    }

    #[test]
    fn model_role_name_tools_and_parts_change_keys() {
        let base = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).pin_at;
        for other in [
            r#"{"model":"n","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","name":"a","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"tool","tool_call_id":"x","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi","tool_calls":[{"id":"1"}]}]}"#,
        ] {
            assert_ne!(chat(other).pin_at, base, "{other}");
        }
    }

    #[test]
    fn a_longer_conversation_shares_every_earlier_boundary() {
        let t1 = chat(r#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#);
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}"#,
        );
        assert!(!t1.multi_unit);
        assert!(t2.multi_unit);
        assert_eq!(t2.boundaries[0].key, t1.pin_at.unwrap());
        assert_eq!(t2.pin_at, Some(t2.boundaries[2].key));
    }

    #[test]
    fn string_prompts_use_byte_blocks_and_pin_at_the_last_full_block() {
        let blocks = IdentityBlocks { block_bytes: 4, block_tokens: 2 };
        let s = extract(Endpoint::Completions, br#"{"model":"m","prompt":"abcdefghij"}"#, blocks).unwrap();
        assert_eq!(s.boundaries.len(), 3);
        assert_eq!(s.pin_at, Some(s.boundaries[1].key));
        let longer = extract(Endpoint::Completions, br#"{"model":"m","prompt":"abcdefghijklmnop"}"#, blocks).unwrap();
        assert_eq!(longer.boundaries[1].key, s.pin_at.unwrap());
        let tokens = extract(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3,4,5]}"#, blocks).unwrap();
        assert_eq!(tokens.boundaries.len(), 3);
        let batch = extract(Endpoint::Completions, br#"{"model":"m","prompt":["a","b"]}"#, blocks).unwrap();
        assert!(batch.boundaries.is_empty() && batch.pin_at.is_none());
    }

    #[test]
    fn unroutable_bodies_are_errors_not_panics() {
        for bad in [
            "",
            "not json",
            "[]",
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":"hi"}"#,
            r#"{"model":"m","messages":[{"content":"no role"}]}"#,
            r#"{"model":1,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        ] {
            assert!(extract(Endpoint::Chat, bad.as_bytes(), IdentityBlocks::default()).is_err(), "{bad}");
        }
        assert!(extract(Endpoint::Completions, br#"{"prompt":[-1]}"#, IdentityBlocks::default()).is_err());
        assert_eq!(extract(Endpoint::Other, b"\xff\xfe", IdentityBlocks::default()).unwrap().model, None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Arbitrary bytes never panic; they route or they are a clear error.
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            for e in [Endpoint::Chat, Endpoint::Completions, Endpoint::Other] {
                if let Err(err) = extract(e, &body, IdentityBlocks::default()) {
                    proptest::prop_assert!(!err.0.is_empty());
                }
            }
        }

        /// Structurally plausible JSON with wrong types in every field.
        #[test]
        fn wrong_types_are_errors_not_panics(
            model in r#"(null|1|"m"|\[\]|\{\})"#,
            messages in r#"(null|1|"x"|\[\]|\[1\]|\[\{\}\]|\[\{"role":1\}\]|\[\{"role":"user","content":\{"a":\[1,null\]\}\}\])"#,
            prompt in r#"(null|1|"x"|\[\]|\[-1\]|\[1.5\]|\[\[1\],"a"\]|\[4294967296\])"#,
        ) {
            let chat = format!(r#"{{"model":{model},"messages":{messages}}}"#);
            let _ = extract(Endpoint::Chat, chat.as_bytes(), IdentityBlocks::default());
            let completion = format!(r#"{{"model":{model},"prompt":{prompt}}}"#);
            let _ = extract(Endpoint::Completions, completion.as_bytes(), IdentityBlocks::default());
        }
    }

    #[test]
    fn deep_nesting_huge_strings_and_invalid_utf8_are_handled() {
        // serde_json's recursion limit turns deep nesting into an error, not a stack overflow.
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":{}{}}}]}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(extract(Endpoint::Chat, deep.as_bytes(), IdentityBlocks::default()).is_err());
        let huge = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(8 << 20));
        assert_eq!(
            extract(Endpoint::Chat, huge.as_bytes(), IdentityBlocks::default()).unwrap().prompt_bytes,
            (8 << 20) + 4
        );
        let mut bad = br#"{"model":"m","messages":[{"role":"user","content":"#.to_vec();
        bad.extend_from_slice(b"\"\xff\xfe\"}]}");
        assert!(extract(Endpoint::Chat, &bad, IdentityBlocks::default()).is_err());
        // Also where the router would not read the string: JSON is UTF-8 text.
        let ignored = b"{\"user\":\"\xff\",\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
        let e = extract(Endpoint::Chat, ignored, IdentityBlocks::default()).unwrap_err();
        assert_eq!(e.0, "invalid JSON body: not UTF-8 at byte 9");
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // Persisted pins depend on this exact value: if it changes, every
        // stored pin is orphaned. Change it only with a migration.
        let s = chat(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#);
        assert_eq!(format!("{:032x}", s.pin_at.unwrap()), STABLE_KEY);
    }
    const STABLE_KEY: &str = "ab6ee19cb77686fdb420cb8f5ace4e0e";

    #[test]
    fn every_units_key_is_stable_across_builds_in_every_dialect() {
        // Values computed by 73d4aa3 (a fresh hash state per unit); the
        // chain now reuses one state and must give the same keys.
        let cases: [(Endpoint, &str, [&str; 4]); 3] = [
            (
                Endpoint::Chat,
                r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}]}"#,
                [
                    "2272f0a05efceafce5443bab64986d2c",
                    "cd3617a70e34243e6a092c3851924607",
                    "c7bfb119ffeb2358cca0afcff54d95d8",
                    "40e6c73da13e7cd94efe36cc9d8083c6",
                ],
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","system":"sys","max_tokens":5,"messages":[{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"text","text":"b"}]},{"role":"user","content":"c"}]}"#,
                [
                    "a769634069eaf8863b299dfd0f1e4f9a",
                    "1380f76c17cf2ec57d5fce46828c9350",
                    "159c2f3a928a7b4d6396eb15dbf0710c",
                    "",
                ],
            ),
            (
                Endpoint::Responses,
                r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"a"},{"type":"function_call","call_id":"x","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"x","output":"o"}]}"#,
                [
                    "14332bbecda0fdfee63c70b213143d47",
                    "7fbc609db2e15f3fcc7664a26d4a967f",
                    "9c4cd921e2b74ea6199217d8323fdc0e",
                    "",
                ],
            ),
        ];
        for (endpoint, body, want) in cases {
            let s = extract(endpoint, body.as_bytes(), IdentityBlocks::default()).unwrap();
            let got: Vec<String> = s.boundaries.iter().map(|b| format!("{:032x}", b.key)).collect();
            let want: Vec<&str> = want.into_iter().filter(|k| !k.is_empty()).collect();
            assert_eq!(got, want, "{endpoint:?}");
        }
    }
}
