//! Chat completions (`/v1/chat/completions`): a unit is one message.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::chain::*;

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
    #[serde(borrow, default)]
    tool_calls: Option<Json<'a>>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
}

/// Message content: plain text (borrowed when it has no escapes) or anything
/// else (parts), kept as a borrowed JSON value. One pass over the body either way.
enum Content<'a> {
    Text(Cow<'a, str>),
    Structured(Json<'a>),
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
                Json::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(Content::Structured)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Json::deserialize(de::value::MapAccessDeserializer::new(map)).map(Content::Structured)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

pub(super) fn extract_chat(body: &[u8]) -> Result<RequestShape, ShapeError> {
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
                bytes += canonical(h, v, &[]);
            }
            None => {}
        }
        if let Some(calls) = &m.tool_calls {
            h.update(b"t");
            bytes += canonical(h, calls, &[]);
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
        stores_response: false,
    })
}
