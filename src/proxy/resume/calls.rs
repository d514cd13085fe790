//! Tool calls in a continued Responses or Messages stream. Before the
//! seam, the first leg's finished calls are kept as chat writes them (the
//! next leg's open answer carries them). After it, the next leg runs on
//! the chat endpoint (the engine's tool parser sees what follows the seam)
//! and its `tool_calls` deltas are written as the dialect's own events:
//!
//! - **Responses**: the text item closed, then a `function_call` output
//!   item: `output_item.added`, `function_call_arguments.delta` per piece,
//!   `function_call_arguments.done`, `output_item.done`.
//! - **Messages**: the text block closed, then a `tool_use` block:
//!   `content_block_start`, `input_json_delta` per piece,
//!   `content_block_stop`; the message stops with `tool_use`.

use serde_json::{json, Value};

use super::frames::{close_text, responses_event, sse};
use super::Said;
use crate::policy::Dialect;

/// A next leg's tool call being written: its id, name and arguments so
/// far, its chat delta's index, and where the client reads it (the item's
/// id and output index, or the block's index).
#[derive(Debug)]
pub(super) struct OpenCall {
    id: Value,
    name: Value,
    arguments: String,
    chat_index: u64,
    item: Value,
    at: u64,
}

/// A finished tool call as chat writes it.
pub(super) fn chat_call(id: Option<Value>, name: Option<Value>, arguments: String) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// One of the next leg's `tool_calls` deltas (`{index, id, function: {name,
/// arguments}}`) as the dialect's events: a new call opens its item or
/// block (what was open before closed), its arguments go on in it.
pub(super) fn tool_call_delta(said: &mut Said, dialect: Dialect, delta: &Value) -> String {
    let index = delta.get("index").and_then(Value::as_u64).unwrap_or(0);
    let mut out = String::new();
    if said.agent.call.as_ref().map(|c| c.chat_index) != Some(index) {
        out.push_str(&close_call(said, dialect));
        out.push_str(&close_text(said, dialect));
        out.push_str(&open_call(said, dialect, index, delta));
    }
    let piece = delta["function"]["arguments"].as_str().unwrap_or("");
    let Some(call) = said.agent.call.as_mut().filter(|_| !piece.is_empty()) else { return out };
    call.arguments.push_str(piece);
    let (item, at) = (call.item.clone(), call.at);
    out.push_str(&match dialect {
        Dialect::Responses => responses_event(
            said,
            "response.function_call_arguments.delta",
            json!({"item_id": item, "output_index": at, "delta": piece}),
        ),
        _ => sse(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": at, "delta": {"type": "input_json_delta", "partial_json": piece}}),
        ),
    });
    out
}

fn open_call(said: &mut Said, dialect: Dialect, chat_index: u64, delta: &Value) -> String {
    let at = said.agent.opened;
    said.agent.opened += 1;
    let (id, name) = (delta.get("id").cloned().unwrap_or(Value::Null), delta["function"]["name"].clone());
    let (out, item) = match dialect {
        Dialect::Responses => {
            let item_id = json!(format!("fc_{}", uuid::Uuid::new_v4().simple()));
            let item = json!({"id": item_id, "type": "function_call", "status": "in_progress", "call_id": id,
                              "name": name, "arguments": ""});
            (responses_event(said, "response.output_item.added", json!({"output_index": at, "item": item})), item_id)
        }
        _ => {
            let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
            let start = json!({"type": "content_block_start", "index": at, "content_block": block});
            (sse("content_block_start", &start), Value::Null)
        }
    };
    said.agent.call = Some(OpenCall { id, name, arguments: String::new(), chat_index, item, at });
    out
}

/// The next leg's open tool call closed, if one is.
pub(super) fn close_call(said: &mut Said, dialect: Dialect) -> String {
    let Some(call) = said.agent.call.take() else { return String::new() };
    match dialect {
        Dialect::Responses => {
            let (item_id, at) = (call.item.clone(), call.at);
            let done = json!({"item_id": item_id, "output_index": at, "arguments": call.arguments});
            let mut out = responses_event(said, "response.function_call_arguments.done", done);
            let item = json!({"id": item_id, "type": "function_call", "status": "completed", "call_id": call.id,
                              "name": call.name, "arguments": call.arguments});
            out.push_str(&responses_event(
                said,
                "response.output_item.done",
                json!({"output_index": at, "item": item}),
            ));
            said.agent.output.push(item);
            out
        }
        _ => sse("content_block_stop", &json!({"type": "content_block_stop", "index": call.at})),
    }
}
