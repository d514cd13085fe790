//! The OpenAI Responses API (`/v1/responses`, Codex-style agents), on the
//! same hash chain as chat (`chain.rs`).
//!
//! - The first link holds the model, `cache_salt`, `instructions` and
//!   `tools`: what the engine caches ahead of the first turn.
//! - A unit is one input item: a message-like item hashes its role and
//!   content; any other item (a function call, its output, a reasoning item,
//!   an item type invented next month) hashes as canonical JSON.
//! - The `id`/`status` the API puts on items it returns are left out (some
//!   clients strip them when they send the items back).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::chain::*;
use super::stream::Asked;

const RESPONSES_SKIP: &[&str] = &["id", "status"];

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    instructions: Option<Json<'a>>,
    #[serde(borrow, default)]
    tools: Option<Json<'a>>,
    #[serde(borrow, default)]
    input: Option<Json<'a>>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    // What continuation reads (`stream.rs`), borrowed raw.
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    top_logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_choice: Option<&'a RawValue>,
}

pub(super) fn extract_responses(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let b: ResponsesBody = parse_body(body)?;
    let stream = Asked {
        text: b.text,
        top_logprobs: b.top_logprobs,
        tools: matches!(&b.tools, Some(Json::Array(tools)) if !tools.is_empty()),
        tool_choice: b.tool_choice,
        store: b.store,
        previous_response: b.previous_response_id.is_some(),
        ..Default::default()
    }
    .read(Dialect::Responses);
    let extra = present(&[(b'i', &b.instructions), (b't', &b.tools)], RESPONSES_SKIP);
    let mut chain = Chain::first_link(b.model.as_deref(), b.cache_salt.as_deref(), &extra);
    let mut bytes = b.instructions.as_ref().and_then(Json::as_str).map_or(0, str::len);
    let mut boundaries: Vec<Boundary> = chain.first_boundary(&extra, bytes).into_iter().collect();
    let mut leads = vec![None; boundaries.len()];
    // A unit hashed (`n` content bytes): its boundary and its lead.
    let mut push = |chain: &mut Chain, bytes: &mut usize, n: usize, lead: Option<Boundary>| {
        *bytes += n;
        boundaries.push(Boundary { key: chain.close(), bytes: *bytes });
        leads.push(lead);
    };
    match &b.input {
        // A plain string is one user message.
        Some(text @ Json::String(_)) => {
            let (unit, lead) = message_unit(&mut chain, "user", Some(text), RESPONSES_SKIP, bytes);
            push(&mut chain, &mut bytes, unit, lead);
        }
        Some(Json::Array(items)) => {
            for item in items {
                let message = Some(item)
                    .filter(|o| o.is_object() && o.get("type").is_none_or(|t| t.as_str() == Some("message")))
                    .and_then(|o| Some((o.get("role")?.as_str()?, o.get("content"))));
                let (unit, lead) = match message {
                    Some((role, content)) => message_unit(&mut chain, role, content, RESPONSES_SKIP, bytes),
                    None => {
                        let h = chain.unit();
                        h.update(b"j");
                        (canonical(h, item, RESPONSES_SKIP), None)
                    }
                };
                push(&mut chain, &mut bytes, unit, lead);
            }
        }
        None | Some(Json::Null) => {}
        Some(_) => return Err(ShapeError("'input' must be a string or an array of input items".into())),
    }
    if b.previous_response_id.is_some() {
        // The body carries only the new items; the prefix lives in the stored
        // response. Hashing the new items alone would name a prefix that does
        // not exist (and two conversations that both say "continue" would
        // share it), so such a request has no prompt identity: its stored
        // response routes it.
        boundaries.clear();
        leads.clear();
    }
    let instructions_bytes = b.instructions.as_ref().and_then(Json::as_str).map_or(0, str::len);
    let stores_response = b.store.unwrap_or(true);
    let shape = shape(
        Dialect::Responses,
        b.model,
        boundaries,
        bytes + instructions_bytes,
        b.prompt_cache_key,
        b.previous_response_id,
    );
    Ok(RequestShape { stores_response, streamed: b.stream == Some(true), stream, leads, ..shape })
}
