//! Chat completions (`/v1/chat/completions`): a unit is one message.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::chain::*;
use super::stream::{some_tools, Asked};

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
    #[serde(default)]
    stream: bool,
    // What continuation reads (`stream.rs`), borrowed raw. The same fields
    // are written out in `completions.rs`, not shared through `#[serde(flatten)]`:
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
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_choice: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    /// Plain text (borrowed when it has no escapes) or parts.
    #[serde(borrow, default)]
    content: Option<Json<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Json<'a>>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
}

/// Left out of a message's content parts: `cache_control` markers, which
/// clients writing for Anthropic models through OpenAI-compatible proxies
/// put on parts and move to the newest message each turn; the engine's
/// prompt is the same without them.
const CHAT_SKIP: &[&str] = &["cache_control"];

pub(super) fn extract_chat(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let parsed: ChatBody = parse_body(body)?;
    if parsed.messages.is_empty() {
        return Err(ShapeError("'messages' must contain at least one message".into()));
    }
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
        tools: some_tools(parsed.tools),
        tool_choice: parsed.tool_choice,
        ..Default::default()
    })
    .read(Dialect::Chat);
    let mut chain = Chain::first_link(parsed.model.as_deref(), parsed.cache_salt.as_deref(), &[]);
    let mut boundaries = Vec::with_capacity(parsed.messages.len());
    let mut leads = Vec::with_capacity(parsed.messages.len());
    let mut bytes = 0usize;
    for m in &parsed.messages {
        leads.push(chain.lead(&m.role, m.content.as_ref(), CHAT_SKIP, bytes));
        let h = chain.unit();
        field(h, b'r', m.role.as_bytes());
        if let Some(name) = &m.name {
            field(h, b'n', name.as_bytes());
        }
        match &m.content {
            Some(Json::String(t)) => {
                field(h, b'c', t.as_bytes());
                bytes += t.len();
            }
            Some(parts @ (Json::Array(_) | Json::Object(_))) => {
                h.update(b"p");
                bytes += canonical(h, parts, CHAT_SKIP);
            }
            Some(_) => return Err(ShapeError("'content' must be a string or an array of content parts".into())),
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
        leads,
        prompt_bytes: bytes,
        cache_key: parsed.prompt_cache_key.map(Cow::into_owned),
        previous_response: None,
        stores_response: false,
        streamed: parsed.stream,
        stream,
    })
}
