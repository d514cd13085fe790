//! Completions (`/v1/completions`): a string prompt in blocks of
//! `block_bytes` bytes, a token-array prompt in blocks of `block_tokens` ids.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::chain::*;
use super::stream::Asked;

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
    #[serde(default)]
    stream: bool,
    // What continuation reads (`stream.rs`), borrowed raw. The same fields
    // are written out in `chat.rs`, not shared through `#[serde(flatten)]`:
    // a flattened struct cannot borrow a `RawValue` (serde-rs/json#599),
    // and flatten buffers every field it does not take (the whole prompt).
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    top_logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response_format: Option<&'a RawValue>,
    #[serde(borrow, default)]
    structured_outputs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    guided_json: Option<&'a RawValue>,
    #[serde(borrow, default)]
    guided_regex: Option<&'a RawValue>,
    #[serde(borrow, default)]
    guided_choice: Option<&'a RawValue>,
    #[serde(borrow, default)]
    guided_grammar: Option<&'a RawValue>,
    #[serde(borrow, default)]
    return_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
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

pub(super) fn extract_completion(body: &[u8], blocks: IdentityBlocks) -> Result<RequestShape, ShapeError> {
    let parsed: CompletionBody = parse_body(body)?;
    let stream = (Asked {
        n: parsed.n,
        logprobs: parsed.logprobs,
        top_logprobs: parsed.top_logprobs,
        response_format: parsed.response_format,
        guided: [
            parsed.structured_outputs,
            parsed.guided_json,
            parsed.guided_regex,
            parsed.guided_choice,
            parsed.guided_grammar,
        ],
        return_token_ids: parsed.return_token_ids,
        stream_options: parsed.stream_options,
        ..Default::default()
    })
    .read(Dialect::Completions);
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
        // Blocks are not messages: no leads.
        leads: Vec::new(),
        prompt_bytes,
        cache_key: parsed.prompt_cache_key.map(Cow::into_owned),
        previous_response: None,
        stores_response: false,
        streamed: parsed.stream,
        stream,
    })
}
