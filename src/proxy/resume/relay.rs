//! The client's stream as it passes (`Relay`): the first leg's events
//! read and passed on, a next leg's re-framed as the first leg's.

use bytes::{Bytes, BytesMut};
use serde_json::{json, Value};
use smallvec::SmallVec;

use super::scan::*;
use super::{agents, frames, FirstLeg, PromptIds, Said, Way, MAX_IDS};
use crate::policy::Dialect;

/// The client's stream, one whole SSE event at a time: the first leg's
/// events read and passed on (ids stripped unless the client asked for
/// them), a next leg's re-framed as the first leg's.
pub struct Relay {
    dialect: Dialect,
    /// The gateway asked for the ids: the client reads none.
    strip_ids: bool,
    pending: BytesMut,
    pub said: Said,
    /// Completion tokens of the legs before this one.
    generated_before: u64,
    /// Legs resumed so far.
    pub legs: u32,
    /// The next leg's finish and usage, for the dialects whose end
    /// carries them (Responses, Messages).
    finish: Option<Value>,
    usage: Option<Value>,
    /// The ids way: the first leg's last events, read whole at a break
    /// (`at_break`).
    last: Bytes,
    /// Where the client's chunks are written.
    out: BytesMut,
    /// The next leg runs on the chat endpoint (`resumed`).
    chat_leg: bool,
    /// Chat and completions: the client asked for usage
    /// (`stream_options.include_usage`). A next leg always asks for it
    /// (the merged count needs it); the client reads it only if it asked.
    client_usage: bool,
}

impl Relay {
    /// For a stream of `dialect` kept for `way`, whose ids the gateway
    /// asked for (`strip_ids`: the client reads none) or not.
    pub fn new(dialect: Dialect, way: Way, strip_ids: bool) -> Relay {
        Relay {
            dialect,
            strip_ids,
            pending: BytesMut::new(),
            said: Said::new(way),
            generated_before: 0,
            legs: 0,
            finish: None,
            usage: None,
            last: Bytes::new(),
            out: BytesMut::new(),
            chat_leg: false,
            client_usage: false,
        }
    }

    /// The client asked for a usage chunk (chat and completions).
    pub fn with_client_usage(mut self, asked: bool) -> Relay {
        self.client_usage = asked;
        self
    }

    /// At a break: what the first leg's last event says of the seam (the
    /// ids way read only the ids of its later events as they passed).
    pub fn at_break(&mut self) {
        agents::settle(&mut self.said);
        let last = std::mem::take(&mut self.last);
        let text = String::from_utf8_lossy(&last);
        let data = text
            .rsplit("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim))
            .find(|d| *d != "[DONE]");
        if let Some(event) = data.and_then(|d| serde_json::from_str::<FirstLeg>(d).ok()) {
            self.said.read_seam(&event);
        }
    }

    /// A next leg starts: what follows is its events. `via_chat`: it
    /// runs on the chat endpoint, continued from this text of the answer
    /// (from then on the answer is kept as text).
    pub fn resumed(&mut self, via_chat: Option<String>) {
        self.legs += 1;
        self.generated_before = self.said.seam() as u64;
        if let Some(text) = via_chat {
            (self.said.way, self.said.text, self.said.tokens) = (Way::Text, text, self.said.seam());
            self.chat_leg = true;
        }
        self.pending.clear();
        (self.finish, self.usage) = (None, None);
    }

    /// What ends the client's stream when the answer was whole (its finish
    /// came) and only its end was missing.
    pub fn ending(&self) -> &'static [u8] {
        match self.dialect {
            Dialect::Messages => b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            _ => b"data: [DONE]\n\n",
        }
    }

    /// Bytes from the replica in; the whole events among them out (what is
    /// left of the last waits for its end).
    pub fn feed(&mut self, chunk: &Bytes) -> Bytes {
        // Most chunks are whole events and nothing waits: on the ids way,
        // read as one (`later_events`).
        if self.pending.is_empty() && self.reads_ids_only() && chunk.ends_with(b"\n\n") {
            return self.later_events(chunk);
        }
        let whole = match self.pending.is_empty() {
            true => chunk.clone(),
            false => {
                // An event that came in many reads (a long prompt's ids:
                // 150 KB for a 100 KB prompt): only the new bytes are
                // searched for its end, and it is taken whole once it came
                // (searched and copied again at every read, it was
                // quadratic in the event's size).
                let searched = self.pending.len().saturating_sub(1);
                self.pending.extend_from_slice(chunk);
                if EVENT_END.find(&self.pending[searched..]).is_none() {
                    return Bytes::new();
                }
                std::mem::take(&mut self.pending).freeze()
            }
        };
        let mut out = std::mem::take(&mut self.out);
        out.reserve(whole.len());
        let mut at = 0;
        while let Some(end) = EVENT_END.find(&whole[at..]) {
            self.event(&whole[at..at + end + 2], &mut out);
            at += end + 2;
        }
        self.pending.extend_from_slice(&whole[at..]);
        let passed = out.split().freeze();
        self.out = out;
        passed
    }

    #[cfg(test)]
    pub(super) fn feed_slice(&mut self, chunk: &[u8]) -> Bytes {
        self.feed(&Bytes::copy_from_slice(chunk))
    }

    /// Whether the events now are the ids way's later ones: only their ids
    /// are read as they pass.
    fn reads_ids_only(&self) -> bool {
        self.legs == 0 && self.said.way == Way::Ids && self.said.id.is_some()
    }

    /// Whole later events of the ids way (`chunk`), read as one: their ids
    /// kept and cut out, the rest passed byte for byte (and without a copy
    /// when there is nothing to cut). Per event, with the event's other
    /// members searched as well, the relay cost 1.36x a plain stream's CPU
    /// per chunk (bench/stream-cpu.sh, docs/benchmarks-log.md).
    fn later_events(&mut self, chunk: &Bytes) -> Bytes {
        self.last = chunk.clone();
        // One event (no line end before its last two): its ids found from
        // its end; else every member searched for.
        let one_event = memchr::memchr(b'\n', &chunk[..chunk.len() - 2]).is_none();
        let found: SmallVec<[Found; 2]> = match one_event.then(|| last_array_token_ids(chunk)).flatten() {
            Some(found) => smallvec::smallvec![found],
            None => token_ids(chunk).collect(),
        };
        for found in &found {
            self.said.keep_ids(ids_in(&chunk[found.value..found.end]));
        }
        if found.is_empty() || !self.strip_ids {
            return chunk.clone();
        }
        let spans = found.iter().map(|f| (f.at, f.end)).collect();
        self.written(chunk.len(), |out| strip_spans_into(chunk, spans, out))
    }

    /// What `write` writes (about `len` bytes), as a chunk for the client.
    /// One buffer, taken back once the chunks before were written and
    /// dropped (an allocation per chunk otherwise).
    fn written(&mut self, len: usize, write: impl FnOnce(&mut BytesMut)) -> Bytes {
        self.out.reserve(len);
        write(&mut self.out);
        self.out.split().freeze()
    }

    fn event(&mut self, event: &[u8], out: &mut BytesMut) {
        if self.reads_ids_only() {
            let passed = self.later_events(&Bytes::copy_from_slice(event));
            out.extend_from_slice(&passed);
            return;
        }
        let Ok(text) = std::str::from_utf8(event) else {
            out.extend_from_slice(event);
            return;
        };
        let Some(data) = text.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim_start) else {
            out.extend_from_slice(event);
            return;
        };
        match (self.legs, self.dialect) {
            (0, Dialect::Responses | Dialect::Messages) => {
                let name = text.lines().find_map(|l| l.strip_prefix("event:")).map(str::trim);
                agents::read(&mut self.said, self.dialect, name, data);
                out.extend_from_slice(event);
            }
            (0, _) => self.first_leg(text, data, out),
            _ if data == "[DONE]" => self.resumed_end(text, out),
            _ => {
                let Ok(event) = serde_json::from_str::<Value>(data) else {
                    out.extend_from_slice(text.as_bytes());
                    return;
                };
                self.resumed_event(&event, out);
            }
        }
    }

    /// A chat or completion event of the first leg read whole (its first,
    /// or any on the text way), and passed on (its ids stripped where the
    /// gateway asked for them).
    fn first_leg(&mut self, text: &str, data: &str, out: &mut BytesMut) {
        if data == "[DONE]" {
            out.extend_from_slice(text.as_bytes());
            return;
        }
        // A `Value` per event cost the relay 2.3x the CPU per chunk of a
        // plain stream, a borrowed parse 1.9x (bench/stream-cpu.sh): only
        // the first event of the ids way is parsed, and every event of the
        // text way (its text is a JSON string to unescape).
        // The prompt's ids are kept as their bytes and cut out before the
        // rest of the event is parsed (`PromptIds`).
        let prompt = prompt_token_ids(data.as_bytes());
        let mut cut = BytesMut::new();
        let rest = match prompt {
            Some(f) => {
                strip_spans_into(data.as_bytes(), smallvec::smallvec![(f.at, f.end)], &mut cut);
                std::str::from_utf8(&cut).unwrap_or(data)
            }
            None => data,
        };
        if let Some(f) = prompt {
            match PromptIds::of(&data.as_bytes()[f.value..f.end]) {
                ids if ids.len > MAX_IDS => _ = self.said.refused.get_or_insert(super::Refusal::TooLong),
                ids => self.said.prompt_ids = Some(ids),
            }
        }
        if let Ok(event) = serde_json::from_str::<FirstLeg>(rest) {
            let first = self.said.id.is_none();
            self.said.read_whole(&event);
            if first && self.said.way == Way::Ids && self.said.prompt_ids.is_none() {
                // Asked for ids and none came: the text way, from here.
                self.said.way = Way::Text;
                self.said.keep_text(event.text());
            }
        }
        if !self.strip_ids {
            out.extend_from_slice(text.as_bytes());
            return;
        }
        let at = data.as_ptr() as usize - text.as_ptr() as usize;
        out.extend_from_slice(&text.as_bytes()[..at]);
        strip_ids_into(rest.as_bytes(), out);
        out.extend_from_slice(&text.as_bytes()[at + data.len()..]);
    }

    /// A next leg's completion chunk, re-framed as the first leg's
    /// dialect frames it (a chunk that says nothing is dropped).
    fn resumed_event(&mut self, event: &Value, out: &mut BytesMut) {
        let choice = event.get("choices").and_then(|c| c.get(0));
        if self.chat_leg {
            return self.resumed_chat_event(event, choice, out);
        }
        let text = choice.and_then(|c| c.get("text")).and_then(Value::as_str).unwrap_or("");
        let finish = choice.and_then(|c| c.get("finish_reason")).filter(|f| !f.is_null());
        let ids: Vec<u32> = choice
            .and_then(|c| c.get("token_ids"))
            .and_then(Value::as_array)
            .map(|ids| ids.iter().filter_map(Value::as_u64).map(|id| id as u32).collect())
            .unwrap_or_default();
        match self.said.way {
            Way::Ids => self.said.keep_ids(ids.iter().copied()),
            Way::Text => self.said.keep_text(text),
        }
        // Wherever the engine puts it: vLLM in a chunk of its own,
        // llama-server in its finish chunk.
        let usage = event.get("usage").filter(|u| !u.is_null());
        match self.dialect {
            Dialect::Responses | Dialect::Messages => {
                if !text.is_empty() {
                    out.extend_from_slice(frames::delta(&mut self.said, self.dialect, text).as_bytes());
                }
                if finish.is_some() {
                    // vLLM names the stop string or token that ended it.
                    let stop = choice.and_then(|c| c.get("stop_reason")).cloned().unwrap_or(Value::Null);
                    self.finish = Some(json!({"finish_reason": finish, "stop_reason": stop}));
                }
                if let Some(usage) = usage {
                    self.usage = Some(usage.clone());
                }
            }
            _ => {
                if let Some(chunk) = self.reframed_chunk(text, finish, &ids) {
                    out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
                }
                self.usage_chunk(usage, out);
            }
        }
    }

    /// The merged usage as a chunk of its own (`choices: []`, as OpenAI
    /// writes it), when the client asked for usage.
    fn usage_chunk(&self, usage: Option<&Value>, out: &mut BytesMut) {
        let Some(usage) = usage.filter(|_| self.client_usage) else { return };
        let (prompt, completion) = self.merged_usage(usage);
        let chunk = json!({"id": self.said.id, "object": self.object(), "created": self.said.created,
            "model": self.said.model, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}});
        out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
    }

    /// A resumed chat leg's chunk (a chat that offers tools): its delta as
    /// the engine parsed it (text or a tool call), with the first leg's
    /// id, model and created, no role; usage merged.
    fn resumed_chat_event(&mut self, event: &Value, choice: Option<&Value>, out: &mut BytesMut) {
        if matches!(self.dialect, Dialect::Responses | Dialect::Messages) {
            return self.resumed_agent_chat_event(event, choice, out);
        }
        let mut delta = choice.and_then(|c| c.get("delta")).cloned().unwrap_or_else(|| json!({}));
        if let Some(delta) = delta.as_object_mut() {
            delta.remove("role");
        }
        self.said.keep_text(delta.get("content").and_then(Value::as_str).unwrap_or(""));
        let finish = choice.and_then(|c| c.get("finish_reason")).filter(|f| !f.is_null());
        if delta.as_object().is_some_and(|d| !d.is_empty()) || finish.is_some() {
            let chunk = json!({"id": self.said.id, "object": "chat.completion.chunk", "created": self.said.created,
                "model": self.said.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
            out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
        }
        self.usage_chunk(event.get("usage").filter(|u| !u.is_null()), out);
    }

    /// A Responses or Messages stream's next leg on the chat endpoint (it
    /// offers tools): its text as the first leg's deltas, its tool calls as
    /// the dialect's own items or blocks (`calls.rs`); its finish and usage
    /// kept for the end.
    fn resumed_agent_chat_event(&mut self, event: &Value, choice: Option<&Value>, out: &mut BytesMut) {
        let delta = choice.and_then(|c| c.get("delta"));
        let text = delta.and_then(|d| d.get("content")).and_then(Value::as_str).unwrap_or("");
        if !text.is_empty() {
            self.said.keep_text(text);
            out.extend_from_slice(frames::delta(&mut self.said, self.dialect, text).as_bytes());
        }
        for call in delta.and_then(|d| d.get("tool_calls")).and_then(Value::as_array).into_iter().flatten() {
            out.extend_from_slice(super::calls::tool_call_delta(&mut self.said, self.dialect, call).as_bytes());
        }
        if let Some(finish) = choice.and_then(|c| c.get("finish_reason")).filter(|f| !f.is_null()) {
            self.finish = Some(json!({"finish_reason": finish, "stop_reason": Value::Null}));
        }
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(usage.clone());
        }
    }

    /// The next leg's `[DONE]`: passed on for chat and completions; for
    /// Responses and Messages, their own end (the item closed, the usage).
    fn resumed_end(&mut self, text: &str, out: &mut BytesMut) {
        match self.dialect {
            Dialect::Responses | Dialect::Messages => {
                let (prompt, completion) = self.merged_usage(self.usage.as_ref().unwrap_or(&Value::Null));
                let call = super::calls::close_call(&mut self.said, self.dialect);
                let end = frames::ending(&mut self.said, self.dialect, self.finish.as_ref(), prompt, completion);
                out.extend_from_slice(call.as_bytes());
                out.extend_from_slice(end.as_bytes());
            }
            _ => out.extend_from_slice(text.as_bytes()),
        }
    }

    /// A next leg's completion chunk as a chat or completion chunk of
    /// the first leg; None for one that says nothing (no text, no finish).
    fn reframed_chunk(&self, text: &str, finish: Option<&Value>, ids: &[u32]) -> Option<Value> {
        if text.is_empty() && finish.is_none() {
            return None;
        }
        let mut choice = match self.dialect {
            Dialect::Chat if text.is_empty() => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Dialect::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": finish}),
            _ => json!({"index": 0, "text": text, "finish_reason": finish}),
        };
        if !self.strip_ids && self.said.way == Way::Ids {
            choice["token_ids"] = json!(ids);
        }
        Some(json!({"id": self.said.id, "object": self.object(), "created": self.said.created,
            "model": self.said.model, "choices": [choice]}))
    }

    fn object(&self) -> &'static str {
        match self.dialect {
            Dialect::Chat => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// The next leg's usage as the client's: the first leg's prompt,
    /// every leg's completion tokens.
    fn merged_usage(&self, usage: &Value) -> (u64, u64) {
        let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        let prompt = match &self.said.prompt_ids {
            Some(ids) => ids.len as u64,
            // The text way: the resumed prompt held the answer so far.
            None => count("prompt_tokens").saturating_sub(self.generated_before),
        };
        (prompt, self.generated_before + count("completion_tokens"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{chat_resume_request, resume_request, Refusal, MAX_IDS};
    use super::*;

    fn chunk(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    #[test]
    fn a_chat_stream_resumes_as_a_completion_and_reads_as_one_stream() {
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true).with_client_usage(true);
        let first = chunk(json!({"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "prompt_token_ids": [10, 11],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "the"}, "token_ids": [1], "finish_reason": null}]}));
        // Split mid-event: nothing passes until the event is whole.
        let (a, b) = first.split_at(30);
        assert!(relay.feed_slice(a.as_bytes()).is_empty());
        let out = relay.feed_slice(b.as_bytes());
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.starts_with("data: ") && !text.contains("token_ids"), "{text}");
        assert_eq!(relay.said.refusal(), None);
        let request = json!({"model": "m", "messages": [], "max_tokens": 4, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true}});
        let resume: Value = serde_json::from_slice(
            &resume_request(&request, Dialect::Chat, &relay.said.prompt_with_answer().unwrap(), relay.said.seam())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(resume["prompt"], json!([10, 11, 1]));
        assert_eq!(resume["max_tokens"], 3);
        assert_eq!((resume["temperature"].clone(), resume["return_token_ids"].clone()), (json!(0), json!(true)));
        assert!(resume.get("messages").is_none());
        relay.resumed(None);
        let second = [
            json!({"id": "cmpl-x", "object": "text_completion", "created": 9, "model": "m", "prompt_token_ids": [10, 11, 1],
                "choices": [{"index": 0, "text": " cache", "token_ids": [2], "finish_reason": null}]}),
            json!({"id": "cmpl-x", "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}),
            json!({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
        ];
        let mut body = String::new();
        for e in &second {
            body.push_str(std::str::from_utf8(&relay.feed_slice(chunk(e.clone()).as_bytes())).unwrap());
        }
        body.push_str(std::str::from_utf8(&relay.feed_slice(b"data: [DONE]\n\n")).unwrap());
        let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 4, "{body}");
        let parsed: Vec<Value> = events[..3].iter().map(|e| serde_json::from_str(&e[6..]).unwrap()).collect();
        assert_eq!(parsed[0]["id"], "c1", "the first leg's id");
        assert_eq!(parsed[0]["created"], 5);
        assert_eq!(parsed[0]["choices"][0]["delta"], json!({"content": " cache"}), "no second role");
        assert_eq!(parsed[1]["choices"][0]["finish_reason"], "length");
        assert_eq!(parsed[1]["choices"][0]["delta"], json!({}), "a finish says no text");
        assert_eq!(parsed[2]["usage"], json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}));
        assert_eq!(events[3], "data: [DONE]");
        assert_eq!(relay.said.generated, vec![1, 2]);
    }

    #[test]
    fn a_seam_inside_a_tool_call_or_reasoning_is_refused_and_a_stream_without_ids_keeps_its_text() {
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true);
        relay.feed_slice(chunk(json!({"id": "c", "choices": [{"delta": {"content": "hi"}}]})).as_bytes());
        relay.feed_slice(chunk(json!({"choices": [{"delta": {"content": " there"}}]})).as_bytes());
        assert_eq!(
            (relay.said.way, relay.said.text.as_str(), relay.said.seam()),
            (Way::Text, "hi there", 2),
            "no ids came: its text is kept"
        );
        assert_eq!(relay.said.refusal(), None);
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, false);
        relay.feed_slice(
            chunk(json!({"prompt_token_ids": [1], "choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), Some(Refusal::ToolCall));
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, false);
        relay.feed_slice(
            chunk(json!({"prompt_token_ids": [1], "choices": [{"delta": {"reasoning_content": "hm"}}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), Some(Refusal::Reasoning));
    }

    #[test]
    fn later_events_are_read_by_their_members_not_by_what_their_text_says() {
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true);
        relay.feed_slice(
            chunk(
                json!({"id": "c", "prompt_token_ids": [5], "choices": [{"delta": {"content": "a"}, "token_ids": [1]}]}),
            )
            .as_bytes(),
        );
        let tricky = r#"data: {"choices":[{"delta":{"content":"\"token_ids\":[9], \"tool_calls\":[1]"},"token_ids":[2],"finish_reason":null}]}"#;
        let out = relay.feed_slice(format!("{tricky}\n\n").as_bytes());
        assert_eq!(relay.said.generated, vec![1, 2], "the member, not the text");
        relay.at_break();
        assert_eq!((relay.said.finished, relay.said.refusal()), (false, None), "the text says it, not the event");
        assert!(std::str::from_utf8(&out).unwrap().contains(r#"\"token_ids\":[9]"#), "the text is left alone");
        // A seam inside a tool call is refused; once its text goes on, not.
        relay.feed_slice(
            chunk(json!({"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "token_ids": [3]}]})).as_bytes(),
        );
        relay.at_break();
        assert_eq!(relay.said.refusal(), Some(Refusal::ToolCall));
        relay.feed_slice(chunk(json!({"choices": [{"delta": {"content": "done."}, "token_ids": [4]}]})).as_bytes());
        relay.at_break();
        assert_eq!(relay.said.refusal(), None, "after the tool call, the seam resumes at the boundary");
        relay.feed_slice(
            chunk(json!({"choices": [{"delta": {}, "token_ids": [], "finish_reason": "stop"}]})).as_bytes(),
        );
        assert!(!relay.said.finished, "read at the break only");
        relay.at_break();
        assert!(relay.said.finished);
        assert_eq!(relay.said.generated, vec![1, 2, 3, 4]);
    }

    #[test]
    fn the_ids_kept_are_bounded_and_past_the_bound_the_stream_is_known_not_continuable() {
        let mut relay = Relay::new(Dialect::Completions, Way::Ids, false);
        let prompt: Vec<u32> = (0..MAX_IDS as u32 - 2).collect();
        relay.feed_slice(
            chunk(json!({"prompt_token_ids": prompt, "choices": [{"text": "a", "token_ids": [1, 2]}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), None);
        relay.feed_slice(chunk(json!({"choices": [{"text": "b", "token_ids": [3]}]})).as_bytes());
        assert_eq!(relay.said.refusal(), Some(Refusal::TooLong));
        assert!(relay.said.prompt_ids.as_ref().unwrap().len + relay.said.generated.len() <= MAX_IDS);
    }

    #[test]
    fn a_chat_that_offers_tools_goes_on_through_chat_and_a_tool_call_after_the_seam_arrives_parsed() {
        let request = json!({"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10, "stream": true,
            "tools": [{"type": "function", "function": {"name": "ls"}}]});
        let resume: Value = serde_json::from_slice(&chat_resume_request(&request, "I will", 2).unwrap()).unwrap();
        assert_eq!(resume["messages"][1], json!({"role": "assistant", "content": "I will"}));
        assert_eq!(
            (resume["continue_final_message"].clone(), resume["add_generation_prompt"].clone()),
            (json!(true), json!(false))
        );
        assert_eq!((resume["max_tokens"].clone(), resume["tools"].clone()), (json!(8), request["tools"].clone()));

        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true).with_client_usage(true);
        relay.feed_slice(
            chunk(json!({"id": "c1", "created": 5, "model": "m", "prompt_token_ids": [10],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "I"}, "token_ids": [1]}]}))
            .as_bytes(),
        );
        relay.feed_slice(
            chunk(json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": " will"}, "token_ids": [2]}]}))
                .as_bytes(),
        );
        relay.resumed(Some("I will".into()));
        assert_eq!((relay.said.way, relay.said.seam()), (Way::Text, 2), "kept as text from here");
        let call = json!([{"index": 0, "id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]);
        let legs = [
            json!({"id": "chatcmpl-2", "created": 9, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": " look"}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"tool_calls": call}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"id": "chatcmpl-2", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
        ];
        let out: String = legs
            .iter()
            .map(|e| String::from_utf8(relay.feed_slice(chunk(e.clone()).as_bytes()).to_vec()).unwrap())
            .collect();
        let events: Vec<Value> =
            out.split("\n\n").filter(|e| !e.is_empty()).map(|e| serde_json::from_str(&e[6..]).unwrap()).collect();
        assert!(events.iter().all(|e| e["id"] == "c1" && e["created"] == 5), "the first leg's id and created");
        assert_eq!(events[0]["choices"][0]["delta"], json!({"content": " look"}), "no second role");
        assert_eq!(events[1]["choices"][0]["delta"]["tool_calls"], call, "the engine's parsed call, as it sent it");
        assert_eq!(events[2]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            events[3]["usage"],
            json!({"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}),
            "the first prompt"
        );
    }

    #[test]
    fn usage_in_a_finish_chunk_is_merged_and_the_client_reads_it_only_if_it_asked() {
        // llama-server's completion stream: no ids, usage in its finish chunk.
        let leg = |relay: &mut Relay| -> Vec<Value> {
            relay.feed_slice(
                chunk(json!({"id": "c", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}))
                .as_bytes(),
            );
            relay.feed_slice(chunk(json!({"choices": [{"index": 0, "delta": {"content": " b"}}]})).as_bytes());
            relay.resumed(None);
            let finish = json!({"id": "x", "choices": [{"index": 0, "text": " c", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}});
            let mut out = relay.feed_slice(chunk(finish).as_bytes()).to_vec();
            out.extend_from_slice(&relay.feed_slice(b"data: [DONE]\n\n"));
            let out = String::from_utf8(out).unwrap();
            out.split("\n\n")
                .filter(|e| e.starts_with("data: {"))
                .map(|e| serde_json::from_str(&e[6..]).unwrap())
                .collect()
        };
        let mut asked = Relay::new(Dialect::Chat, Way::Text, false).with_client_usage(true);
        let events = leg(&mut asked);
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[0]["choices"][0]["delta"], json!({"content": " c"}));
        assert_eq!(events[1]["choices"], json!([]), "a usage chunk of its own, as OpenAI writes it");
        assert_eq!(
            events[1]["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}),
            "the first prompt (the resumed one held the answer so far), every leg's completion"
        );
        let mut not_asked = Relay::new(Dialect::Chat, Way::Text, false);
        assert!(leg(&mut not_asked).iter().all(|e| e["usage"].is_null()), "not asked, not read");
    }

    #[test]
    fn a_long_prompts_first_event_in_many_reads_passes_once_whole_with_its_ids_kept_as_bytes() {
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true);
        let prompt: Vec<u32> = (0..5_000).collect();
        let first = chunk(json!({"id": "c", "prompt_token_ids": prompt,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "token_ids": [7]}]}));
        let mut out = Vec::new();
        for piece in first.as_bytes().chunks(100) {
            let passed = relay.feed_slice(piece);
            assert!(passed.is_empty() || out.is_empty(), "passed once");
            out.extend_from_slice(&passed);
        }
        let out = String::from_utf8(out).unwrap();
        assert!(out.ends_with("\n\n") && !out.contains("token_ids"), "whole, the ids stripped: {out}");
        assert_eq!(relay.said.prompt_ids.as_ref().map(|p| p.len), Some(5_000));
        assert_eq!(relay.said.prompt_with_answer().unwrap(), (0..5_000).chain([7]).collect::<Vec<u32>>());
    }
}
