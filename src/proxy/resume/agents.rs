//! Responses and Messages streams, their first leg read: what it said that
//! the next leg's events carry on (the response, the open text item or
//! block, the sequence numbers, the tool calls it finished). The next
//! leg's events are written in `frames.rs` (text) and `calls.rs` (tool
//! calls). vLLM gives no token ids on these endpoints: they go on the text
//! way (`Way::Text`).
//!
//! - **Responses**: `response.output_text.delta` in the same output item,
//!   sequence numbers that go on, then the item closed
//!   (`output_text.done`, `content_part.done`, `output_item.done`) and one
//!   `response.completed` (status `incomplete` when it ran out of
//!   `max_output_tokens`, as vLLM writes it).
//! - **Messages**: `content_block_delta` in the same content block, then
//!   one `content_block_stop`, one `message_delta`, one `message_stop`.

use std::borrow::Cow;

use serde_json::value::RawValue;
use serde_json::Value;

use super::{Refusal, Said};
use crate::policy::Dialect;

/// What a Responses or Messages stream's resumed events carry on.
#[derive(Debug, Default)]
pub(super) struct AgentSaid {
    /// Responses: the `response.created` event's JSON, as it came (its
    /// response, which echoes the whole request, is parsed only when the
    /// stream's end gives it back completed).
    pub(super) created: Option<String>,
    /// Responses: the last sequence number sent.
    pub(super) sequence: Option<u64>,
    /// The first text delta event: the next leg's are written as it was
    /// (its fields as its engine wrote them), with their own text.
    pub(super) delta: Option<Value>,
    /// Responses: the open message item's id, output and content index;
    /// Messages: the open text block's index (`block`).
    pub(super) item: Option<Value>,
    pub(super) output_index: u64,
    pub(super) content_index: u64,
    pub(super) block: Option<u64>,
    /// Output items (Responses) or content blocks (Messages) the stream
    /// opened so far: the next one's index.
    pub(super) opened: u64,
    /// Tool calls the first leg finished before the seam, as chat writes
    /// them: the next leg's open answer carries them.
    pub(super) calls: Vec<Value>,
    /// Messages: the tool_use block the first leg is writing.
    tool_use: Option<ToolUse>,
    /// The tool call the next leg is writing (`calls.rs`).
    pub(super) call: Option<super::calls::OpenCall>,
    /// Responses: the output items closed so far (the message, the calls
    /// of the next leg), for the completed response.
    pub(super) output: Vec<Value>,
}

/// A Messages tool_use block as the first leg writes it: its id, name and
/// input so far (JSON text in pieces).
#[derive(Debug)]
struct ToolUse {
    id: Option<Value>,
    name: Option<Value>,
    input: String,
}

/// A first leg's Responses or Messages event, as far as continuation
/// reads it: borrowed, the rest skipped. A `Value` per event cost every
/// stream an allocation per member; only the events kept whole (the
/// response as created, the first text delta) are parsed into one.
#[derive(serde::Deserialize)]
struct Event<'a> {
    #[serde(borrow, rename = "type")]
    kind: Cow<'a, str>,
    sequence_number: Option<u64>,
    /// Responses: the output item added; Messages: the block started.
    #[serde(borrow)]
    item: Option<Typed<'a>>,
    #[serde(borrow)]
    content_block: Option<Typed<'a>>,
    output_index: Option<u64>,
    content_index: Option<u64>,
    /// Messages: the block's index.
    index: Option<u64>,
    /// Responses: the text; Messages: `{type, text}`.
    #[serde(borrow)]
    delta: Option<&'a RawValue>,
    /// Messages' `message_start`: its id and model; Responses'
    /// `response.created`: its response's id, model and creation time.
    #[serde(borrow)]
    message: Option<Named<'a>>,
    #[serde(borrow)]
    response: Option<Named<'a>>,
}

#[derive(serde::Deserialize)]
struct Typed<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    /// A function call item's or a tool_use block's.
    #[serde(borrow)]
    call_id: Option<&'a RawValue>,
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct Named<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    created_at: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct TextDelta<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    partial_json: Option<Cow<'a, str>>,
}

fn owned(raw: Option<&RawValue>) -> Option<Value> {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

/// One event of the first leg (`data`, its JSON), read.
/// `name`: its `event:` line. The events that echo the whole request (a
/// Responses response as created, in progress and completed: a long
/// prompt's size each) are known by it and not parsed as they pass; the
/// created one is kept as it came (`settle` reads it at a break).
pub(super) fn read(said: &mut Said, dialect: Dialect, name: Option<&str>, data: &str) {
    let numbered = |said: &mut Said| said.agent.sequence = Some(said.agent.sequence.map_or(0, |n| n + 1));
    match name.filter(|_| dialect == Dialect::Responses) {
        Some("response.created") => {
            numbered(said);
            said.agent.created = Some(data.to_string());
            return;
        }
        Some("response.in_progress") => return numbered(said),
        Some("response.completed" | "response.incomplete" | "response.failed") => {
            numbered(said);
            said.finished = true;
            return;
        }
        _ => {}
    }
    let Ok(event) = serde_json::from_str::<Event>(data) else { return };
    match dialect {
        Dialect::Responses => read_responses(said, &event, data),
        _ => read_messages(said, &event, data),
    }
}

/// A Responses stream's created response read, if it was kept unread:
/// its id, model and creation time (at a break, before they are needed).
pub(super) fn settle(said: &mut Said) {
    if said.id.is_some() {
        return;
    }
    let Some(created) = said.agent.created.take() else { return };
    let sequence = said.agent.sequence;
    read(said, Dialect::Responses, None, &created);
    said.agent.sequence = sequence;
}

/// The first text delta, kept whole: the next leg's are written as it was.
fn keep_delta(said: &mut Said, data: &str) {
    if said.agent.delta.is_none() {
        said.agent.delta = serde_json::from_str(data).ok();
    }
}

fn read_responses(said: &mut Said, event: &Event<'_>, data: &str) {
    if let Some(n) = event.sequence_number {
        said.agent.sequence = Some(n);
    }
    match &*event.kind {
        "response.created" => {
            let response = event.response.as_ref();
            said.id = owned(response.and_then(|r| r.id));
            said.model = owned(response.and_then(|r| r.model));
            said.created = owned(response.and_then(|r| r.created_at));
            said.agent.created = Some(data.to_string());
        }
        "response.output_item.added" => {
            said.agent.opened = said.agent.opened.max(event.output_index.unwrap_or(0) + 1);
            match event.item.as_ref().and_then(|i| i.kind.as_deref()) {
                // A second message would be rendered as one: not continued.
                Some("message") if said.agent.item.is_some() => {
                    said.refused.get_or_insert(Refusal::NoTranscript);
                }
                Some("message") => {
                    said.agent.item = owned(event.item.as_ref().and_then(|i| i.id));
                    said.agent.output_index = event.output_index.unwrap_or(0);
                }
                // A seam inside either is refused; after it, the answer
                // goes on at the boundary (`Said::open`).
                Some("reasoning") => said.open = Some(Refusal::Reasoning),
                Some("function_call") => said.open = Some(Refusal::ToolCall),
                // A built-in tool no chat template renders.
                _ => {
                    said.refused.get_or_insert(Refusal::ToolCall);
                }
            }
        }
        "response.output_item.done" => {
            // Closed before the seam: the completed response lists it.
            if let Ok(mut done) = serde_json::from_str::<Value>(data) {
                said.agent.output.push(done["item"].take());
            }
            let item = event.item.as_ref();
            if item.and_then(|i| i.kind.as_deref()) == Some("function_call") {
                let item = item.expect("matched");
                let arguments = item.arguments.as_deref().unwrap_or("{}").to_string();
                said.agent.calls.push(super::calls::chat_call(owned(item.call_id), owned(item.name), arguments));
            }
            said.open = None;
        }
        "response.content_part.added" => said.agent.content_index = event.content_index.unwrap_or(0),
        "response.output_text.delta" => {
            let text: Option<Cow<str>> = event.delta.and_then(|d| serde_json::from_str(d.get()).ok());
            said.keep_text(text.as_deref().unwrap_or(""));
            keep_delta(said, data);
        }
        "response.completed" | "response.incomplete" | "response.failed" => said.finished = true,
        _ => {}
    }
}

fn read_messages(said: &mut Said, event: &Event<'_>, data: &str) {
    match &*event.kind {
        "message_start" => {
            said.id = owned(event.message.as_ref().and_then(|m| m.id));
            said.model = owned(event.message.as_ref().and_then(|m| m.model));
        }
        "content_block_start" => {
            said.agent.opened = said.agent.opened.max(event.index.unwrap_or(0) + 1);
            let block = event.content_block.as_ref();
            match block.and_then(|b| b.kind.as_deref()) {
                Some("text") => said.agent.block = event.index,
                Some("thinking" | "redacted_thinking") => said.open = Some(Refusal::Reasoning),
                Some("tool_use") => {
                    let block = block.expect("matched");
                    said.open = Some(Refusal::ToolCall);
                    let (id, name) = (owned(block.id), owned(block.name));
                    said.agent.tool_use = Some(ToolUse { id, name, input: String::new() });
                }
                // A server tool no chat template renders.
                _ => {
                    said.refused.get_or_insert(Refusal::ToolCall);
                }
            }
        }
        "content_block_delta" => {
            let delta: Option<TextDelta> = event.delta.and_then(|d| serde_json::from_str(d.get()).ok());
            match delta.as_ref().and_then(|d| d.kind.as_deref()) {
                Some("text_delta") => {
                    said.keep_text(delta.as_ref().and_then(|d| d.text.as_deref()).unwrap_or(""));
                    keep_delta(said, data);
                }
                Some("input_json_delta") => {
                    let json = delta.as_ref().and_then(|d| d.partial_json.as_deref()).unwrap_or("");
                    if let Some(tool_use) = said.agent.tool_use.as_mut() {
                        tool_use.input.push_str(json);
                    }
                }
                _ => {}
            }
        }
        "content_block_stop" => {
            if let Some(ToolUse { id, name, input }) = said.agent.tool_use.take() {
                let input = if input.is_empty() { "{}".to_string() } else { input };
                said.agent.calls.push(super::calls::chat_call(id, name, input));
            }
            if said.agent.block == event.index {
                said.agent.block = None;
            }
            said.open = None;
        }
        "message_delta" => said.finished = true,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::frames::sse;
    use super::super::{Relay, Way};
    use super::*;
    use serde_json::json;

    fn event(kind: &str, data: Value) -> String {
        sse(kind, &data)
    }

    fn feed(relay: &mut Relay, events: &[String]) -> Vec<Value> {
        let out: String =
            events.iter().map(|e| String::from_utf8(relay.feed_slice(e.as_bytes()).to_vec()).unwrap()).collect();
        out.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| serde_json::from_str(e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap())
            .collect()
    }

    fn completion(text: &str, finish: Option<&str>) -> String {
        format!(
            "data: {}\n\n",
            json!({"id": "cmpl-2", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})
        )
    }

    fn responses_first_leg() -> Vec<String> {
        vec![
            event(
                "response.created",
                json!({"type": "response.created", "sequence_number": 0,
                "response": {"id": "resp_1", "object": "response", "created_at": 7, "model": "m", "status": "in_progress", "output": []}}),
            ),
            event(
                "response.output_item.added",
                json!({"type": "response.output_item.added", "sequence_number": 1,
                "output_index": 0, "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}),
            ),
            event(
                "response.content_part.added",
                json!({"type": "response.content_part.added", "sequence_number": 2,
                "item_id": "msg_1", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": ""}}),
            ),
            event(
                "response.output_text.delta",
                json!({"type": "response.output_text.delta", "sequence_number": 3,
                "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "the", "logprobs": []}),
            ),
        ]
    }

    #[test]
    fn a_responses_stream_goes_on_in_its_item_with_its_sequence_and_one_completed_response() {
        let mut relay = Relay::new(Dialect::Responses, Way::Text, false);
        let passed = feed(&mut relay, &responses_first_leg());
        assert_eq!(passed.len(), 4, "the first leg passes as it came");
        assert_eq!((relay.said.refusal(), relay.said.text.as_str(), relay.said.seam()), (None, "the", 1));
        relay.resumed(None);
        let usage = json!({"id": "cmpl-2", "choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 2}});
        let resumed = feed(
            &mut relay,
            &[
                completion(" cache", None),
                completion(" is", Some("length")),
                format!("data: {usage}\n\n"),
                "data: [DONE]\n\n".into(),
            ],
        );
        let kinds: Vec<&str> = resumed.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let sequence: Vec<u64> = resumed.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(sequence, [4, 5, 6, 7, 8, 9], "the first leg's sequence goes on");
        assert_eq!(
            resumed[0],
            json!({"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_1",
            "output_index": 0, "content_index": 0, "delta": " cache", "logprobs": []}),
            "written as the engine wrote its own"
        );
        let response = &resumed[5]["response"];
        assert_eq!((response["id"].clone(), response["created_at"].clone()), (json!("resp_1"), json!(7)));
        assert_eq!(response["status"], "incomplete", "it ran out of max_output_tokens, as vLLM says it");
        assert_eq!(response["output"][0]["content"][0]["text"], "the cache is");
        // The first prompt: the resumed prompt held the one token said before.
        assert_eq!(response["usage"]["input_tokens"], 30);
        assert_eq!(response["usage"]["output_tokens"], 3);
    }

    #[test]
    fn a_responses_seam_in_a_function_call_or_reasoning_item_is_refused() {
        for (item, refused) in [("function_call", Refusal::ToolCall), ("reasoning", Refusal::Reasoning)] {
            let mut relay = Relay::new(Dialect::Responses, Way::Text, false);
            let mut first = responses_first_leg();
            first[1] = event(
                "response.output_item.added",
                json!({"type": "response.output_item.added",
                "sequence_number": 1, "output_index": 0, "item": {"id": "x", "type": item}}),
            );
            feed(&mut relay, &first[..2]);
            assert_eq!(relay.said.refusal(), Some(refused), "{item}");
        }
    }

    fn messages_first_leg(block: Value, delta: Value) -> Vec<String> {
        vec![
            event(
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_a", "model": "m",
                "usage": {"input_tokens": 12, "output_tokens": 1}}}),
            ),
            event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": block})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": delta})),
        ]
    }

    #[test]
    fn a_messages_stream_goes_on_in_its_block_with_one_message_delta_and_one_stop() {
        let mut relay = Relay::new(Dialect::Messages, Way::Text, false);
        let first =
            messages_first_leg(json!({"type": "text", "text": ""}), json!({"type": "text_delta", "text": "the"}));
        feed(&mut relay, &first);
        assert_eq!(relay.said.refusal(), None);
        assert!(!relay.said.finished, "no message_delta yet");
        relay.resumed(None);
        let finish = format!(
            "data: {}\n\n",
            json!({"choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "END"}]})
        );
        let usage =
            format!("data: {}\n\n", json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 1}}));
        let resumed = feed(&mut relay, &[completion(" cache", None), finish, usage, "data: [DONE]\n\n".into()]);
        let kinds: Vec<&str> = resumed.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]);
        assert_eq!(
            resumed[0],
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " cache"}})
        );
        assert_eq!(
            resumed[2]["delta"],
            json!({"stop_reason": "stop_sequence", "stop_sequence": "END"}),
            "vLLM named the stop string"
        );
        assert_eq!(resumed[2]["usage"]["output_tokens"], 2, "both legs' tokens");
    }

    #[test]
    fn a_messages_seam_in_a_tool_use_or_thinking_block_is_refused_and_a_finished_answer_only_needs_its_stop() {
        let tool = messages_first_leg(
            json!({"type": "tool_use", "id": "t", "name": "ls", "input": {}}),
            json!({"type": "input_json_delta", "partial_json": "{\"pa"}),
        );
        let mut relay = Relay::new(Dialect::Messages, Way::Text, false);
        feed(&mut relay, &tool);
        assert_eq!(relay.said.refusal(), Some(Refusal::ToolCall));
        let thinking = messages_first_leg(
            json!({"type": "thinking", "thinking": ""}),
            json!({"type": "thinking_delta", "thinking": "hm"}),
        );
        let mut relay = Relay::new(Dialect::Messages, Way::Text, false);
        feed(&mut relay, &thinking);
        assert_eq!(relay.said.refusal(), Some(Refusal::Reasoning));
        let mut relay = Relay::new(Dialect::Messages, Way::Text, false);
        let mut whole =
            messages_first_leg(json!({"type": "text", "text": ""}), json!({"type": "text_delta", "text": "x"}));
        whole.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})));
        feed(&mut relay, &whole);
        assert!(relay.said.finished);
        assert_eq!(relay.ending(), b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    }

    #[test]
    fn after_a_finished_tool_use_or_reasoning_item_the_seam_goes_on_at_the_boundary_with_the_call_kept() {
        let mut relay = Relay::new(Dialect::Messages, Way::Text, false);
        let mut events = messages_first_leg(
            json!({"type": "tool_use", "id": "t1", "name": "ls", "input": {}}),
            json!({"type": "input_json_delta", "partial_json": "{\"path\":"}),
        );
        events.extend([
            event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": " \"/\"}"}}),
            ),
            event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 1,
                "content_block": {"type": "text", "text": ""}}),
            ),
            event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                "delta": {"type": "text_delta", "text": "Listed."}}),
            ),
        ]);
        feed(&mut relay, &events);
        assert_eq!(relay.said.refusal(), None, "the tool_use block was closed before the seam");
        let call =
            json!({"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}});
        assert_eq!(relay.said.calls(), std::slice::from_ref(&call), "its input's pieces joined");
        assert_eq!(relay.said.text, "Listed.");
        let request = json!({"model": "m", "messages": [{"role": "user", "content": "ls"}]});
        let t = super::super::transcript::transcript(Dialect::Messages, &request, &relay.said.text, relay.said.calls())
            .unwrap();
        assert_eq!(t.open_answer().unwrap(), json!({"role": "assistant", "content": "Listed.", "tool_calls": [call]}));

        let mut relay = Relay::new(Dialect::Responses, Way::Text, false);
        let mut first = responses_first_leg();
        first.insert(
            1,
            event(
                "response.output_item.added",
                json!({"type": "response.output_item.added", "sequence_number": 1,
                "output_index": 0, "item": {"id": "rs_1", "type": "reasoning"}}),
            ),
        );
        first.insert(
            2,
            event(
                "response.output_item.done",
                json!({"type": "response.output_item.done", "sequence_number": 2,
                "output_index": 0, "item": {"id": "rs_1", "type": "reasoning", "summary": []}}),
            ),
        );
        feed(&mut relay, &first);
        assert_eq!(relay.said.refusal(), None, "the reasoning item was done before the seam");
    }
}
