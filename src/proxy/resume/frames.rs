//! Responses and Messages events written for a next leg, as the first
//! leg's engine wrote its own: its text in the open item or block (opened
//! if the first leg broke before it did), the item or block closed, and
//! the stream's end.
//!
//! - **Responses**: `response.output_text.delta` in the same output item,
//!   sequence numbers that go on, then the item closed
//!   (`output_text.done`, `content_part.done`, `output_item.done`) and one
//!   `response.completed` (status `incomplete` when it ran out of
//!   `max_output_tokens`, as vLLM writes it).
//! - **Messages**: `content_block_delta` in the same content block, then
//!   one `content_block_stop`, one `message_delta`, one `message_stop`.

use serde_json::{json, Value};

use super::Said;
use crate::policy::Dialect;

/// One SSE event, named as these dialects name theirs.
pub(super) fn sse(kind: &str, data: &Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

/// Responses: the next event's sequence number.
fn next_sequence(said: &mut Said) -> u64 {
    let n = said.agent.sequence.map_or(0, |n| n + 1);
    said.agent.sequence = Some(n);
    n
}

/// A Responses event of `kind` (`data` without its type and sequence
/// number), numbered as the stream goes on.
pub(super) fn responses_event(said: &mut Said, kind: &str, mut data: Value) -> String {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(next_sequence(said));
    sse(kind, &data)
}

/// The events that open a text item (Responses) or block (Messages) where
/// the first leg broke before opening one (during its prefill), after the
/// items or blocks it had opened.
fn open(said: &mut Said, dialect: Dialect) -> String {
    let index = said.agent.opened;
    said.agent.opened += 1;
    match dialect {
        Dialect::Responses => {
            let id = json!(format!("msg_{}", uuid::Uuid::new_v4().simple()));
            (said.agent.item, said.agent.output_index, said.agent.content_index) = (Some(id.clone()), index, 0);
            let item =
                json!({"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []});
            let mut out =
                responses_event(said, "response.output_item.added", json!({"output_index": index, "item": item}));
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            let added = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            out.push_str(&responses_event(said, "response.content_part.added", added));
            out
        }
        _ => {
            said.agent.block = Some(index);
            let start =
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}});
            sse("content_block_start", &start)
        }
    }
}

/// A next leg's text as the first leg's next delta event.
pub(super) fn delta(said: &mut Said, dialect: Dialect, text: &str) -> String {
    let open = match dialect {
        Dialect::Responses if said.agent.item.is_none() => open(said, dialect),
        Dialect::Messages if said.agent.block.is_none() => open(said, dialect),
        _ => String::new(),
    };
    let agent = &said.agent;
    let mut event = match dialect {
        Dialect::Responses => agent.delta.clone().unwrap_or_else(|| {
            json!({"type": "response.output_text.delta", "item_id": agent.item,
                   "output_index": agent.output_index, "content_index": agent.content_index})
        }),
        _ => agent.delta.clone().unwrap_or_else(
            || json!({"type": "content_block_delta", "index": agent.block, "delta": {"type": "text_delta"}}),
        ),
    };
    match dialect {
        Dialect::Responses => {
            event["delta"] = json!(text);
            event["sequence_number"] = json!(next_sequence(said));
            open + &sse("response.output_text.delta", &event)
        }
        _ => {
            event["delta"]["text"] = json!(text);
            open + &sse("content_block_delta", &event)
        }
    }
}

/// The open text item (Responses) or block (Messages) closed, if one is.
pub(super) fn close_text(said: &mut Said, dialect: Dialect) -> String {
    if dialect == Dialect::Messages {
        let Some(index) = said.agent.block.take() else { return String::new() };
        return sse("content_block_stop", &json!({"type": "content_block_stop", "index": index}));
    }
    let Some(id) = said.agent.item.take() else { return String::new() };
    let (oi, ci, text) = (said.agent.output_index, said.agent.content_index, said.text.clone());
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    let item = json!({"id": id, "type": "message", "status": "completed", "role": "assistant", "content": [part]});
    let at = json!({"item_id": id, "output_index": oi, "content_index": ci});
    let mut done = at.clone();
    done["text"] = json!(text);
    let mut out = responses_event(said, "response.output_text.done", done);
    let mut part_done = at;
    part_done["part"] = part;
    out.push_str(&responses_event(said, "response.content_part.done", part_done));
    out.push_str(&responses_event(said, "response.output_item.done", json!({"output_index": oi, "item": item})));
    said.agent.output.push(item);
    out
}

/// The end of the client's stream once the next leg ended (its open tool
/// call closed first, `calls::close_call`): its text closed, the finish (`finish`: the
/// completion's `finish_reason` and `stop_reason`), usage merged
/// (`prompt`, `completion`).
pub(super) fn ending(
    said: &mut Said,
    dialect: Dialect,
    finish: Option<&Value>,
    prompt: u64,
    completion: u64,
) -> String {
    let reason = finish.and_then(|f| f["finish_reason"].as_str()).unwrap_or("stop");
    let mut out = close_text(said, dialect);
    match dialect {
        Dialect::Responses => out.push_str(&responses_completed(said, reason, prompt, completion)),
        _ => {
            let stop = finish.map(|f| &f["stop_reason"]).filter(|s| s.is_string());
            let (stop_reason, sequence) = match (reason, stop) {
                ("length", _) => ("max_tokens", Value::Null),
                ("tool_calls", _) => ("tool_use", Value::Null),
                (_, Some(stop)) => ("stop_sequence", stop.clone()),
                _ => ("end_turn", Value::Null),
            };
            let delta = json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": sequence},
                               "usage": {"output_tokens": completion}});
            out.push_str(&sse("message_delta", &delta));
            out.push_str(&sse("message_stop", &json!({"type": "message_stop"})));
        }
    }
    out
}

/// Responses: the one `response.completed`, its output every item closed.
fn responses_completed(said: &mut Said, reason: &str, prompt: u64, completion: u64) -> String {
    let created = said.agent.created.as_deref().and_then(|e| serde_json::from_str::<Value>(e).ok());
    let mut response = match created {
        Some(mut event) => event["response"].take(),
        None => json!({"id": said.id, "object": "response"}),
    };
    let incomplete = reason == "length";
    response["status"] = json!(if incomplete { "incomplete" } else { "completed" });
    response["incomplete_details"] = if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null };
    response["output"] = json!(std::mem::take(&mut said.agent.output));
    response["usage"] = json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion});
    responses_event(said, "response.completed", json!({"response": response}))
}
