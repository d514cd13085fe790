//! The Anthropic Messages API (`/v1/messages`, Claude-Code-style agents), on
//! the same hash chain as chat (`chain.rs`).
//!
//! - The first link holds the model, `cache_salt`, `system` and `tools`.
//! - A unit is one message: its role and content.
//! - `cache_control` markers are left out: Claude Code moves them to the
//!   newest message every turn, which would otherwise break every match.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::chain::*;
use super::stream::Asked;

const MESSAGES_SKIP: &[&str] = &["cache_control"];

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<Json<'a>>,
    #[serde(borrow, default)]
    tools: Option<Json<'a>>,
    #[serde(borrow)]
    messages: Vec<Json<'a>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    /// What continuation reads (`stream.rs`), borrowed raw.
    #[serde(borrow, default)]
    tool_choice: Option<&'a RawValue>,
}

pub(super) fn extract_messages(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let b: MessagesBody = parse_body(body)?;
    if b.messages.is_empty() {
        return Err(ShapeError("'messages' must contain at least one message".into()));
    }
    let extra = present(&[(b's', &b.system), (b't', &b.tools)], MESSAGES_SKIP);
    let mut chain = Chain::first_link(b.model.as_deref(), b.cache_salt.as_deref(), &extra);
    let mut boundaries = Vec::with_capacity(b.messages.len() + 1);
    let mut bytes = b.system.as_ref().and_then(Json::as_str).map_or(0, str::len);
    boundaries.extend(chain.first_boundary(&extra, bytes));
    let mut leads = vec![None; boundaries.len()];
    for m in &b.messages {
        let role = m
            .get("role")
            .and_then(Json::as_str)
            .ok_or_else(|| ShapeError("every message needs a string 'role'".into()))?;
        let (unit, lead) = message_unit(&mut chain, role, m.get("content"), MESSAGES_SKIP, bytes);
        bytes += unit;
        leads.push(lead);
        boundaries.push(Boundary { key: chain.close(), bytes });
    }
    let tools = matches!(&b.tools, Some(Json::Array(tools)) if !tools.is_empty());
    let stream = Asked { tools, tool_choice: b.tool_choice, ..Default::default() }.read(Dialect::Messages);
    Ok(RequestShape {
        streamed: b.stream == Some(true),
        stream,
        leads,
        ..shape(Dialect::Messages, b.model, boundaries, bytes, None, None)
    })
}
