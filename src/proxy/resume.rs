//! Streams that outlive their replica, the pure half (no I/O): what a
//! streamed chat or completion has said so far, whether it may go on
//! elsewhere, the request that resumes it, and the resumed leg's events
//! re-framed as the first leg's. The I/O half is `body.rs` (the break and
//! the swap) and `proxy/mod.rs` (`Resumer`: the replica and the request).
//!
//! Token for token: with `failover.continue_streams` on, a chat or
//! completion stream asks its engine for `return_token_ids` (vLLM: the
//! prompt's ids in the first chunk, each chunk's own ids). The ids are kept
//! (4 bytes each, at most `MAX_IDS`) and stripped from what the client
//! reads unless it asked for them. A break resumes on another replica with
//! `/v1/completions`: the prompt and the answer so far as token ids, the
//! same sampling, `max_tokens` less what was generated. Its chunks reach
//! the client as the first leg's: its id, model and created, no second
//! role, one finish, one `[DONE]`, usage merged (the first prompt, both
//! legs' completion tokens).

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::policy::Dialect;

/// Most token ids kept per stream (prompt and answer): 256 KiB. A stream
/// past it is not continuable, and it is known before it breaks.
pub const MAX_IDS: usize = 65_536;

/// Why a broken stream did not go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Guided or structured output: a seam would restart its grammar.
    StructuredOutput,
    /// `n > 1`: several answers in one stream.
    SeveralChoices,
    /// Log probabilities: the resumed leg's would be of another prompt.
    Logprobs,
    /// The seam fell inside a tool call's arguments.
    ToolCall,
    /// The seam fell inside a reasoning block.
    Reasoning,
    /// The engine gave no token ids for this stream.
    NoTokenIds,
    /// More ids than `MAX_IDS`.
    TooLong,
    /// `failover.max_continuations` legs already.
    Limit,
    /// No other replica could take it, or it refused the resumed leg.
    NoReplica,
    /// `failover.max_resuming` legs were starting already.
    Busy,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::StructuredOutput => "structured_output",
            Refusal::SeveralChoices => "n_greater_than_1",
            Refusal::Logprobs => "logprobs",
            Refusal::ToolCall => "inside_tool_call",
            Refusal::Reasoning => "inside_reasoning",
            Refusal::NoTokenIds => "no_token_ids",
            Refusal::TooLong => "too_many_tokens",
            Refusal::Limit => "max_continuations",
            Refusal::NoReplica => "no_replica",
            Refusal::Busy => "too_many_resuming",
        }
    }
}

/// What a streamed chat or completion asks that decides whether its
/// stream may go on (the rest of the body is skimmed, not kept).
#[derive(Debug, Default, serde::Deserialize)]
pub struct Asked {
    n: Option<u64>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
    return_token_ids: Option<Value>,
}

/// Whether a request's stream could ever go on elsewhere: refused before
/// anything is sent for what a seam would corrupt.
pub fn refusal_of(asked: &Asked) -> Option<Refusal> {
    let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let schema = asked.response_format.as_ref().and_then(|f| f.get("type")).and_then(Value::as_str);
    let guided = [&asked.guided_json, &asked.guided_regex, &asked.guided_choice, &asked.guided_grammar];
    if matches!(schema, Some("json_schema" | "json_object" | "structural_tag"))
        || set(&asked.structured_outputs)
        || guided.into_iter().any(set)
    {
        return Some(Refusal::StructuredOutput);
    }
    if asked.n.is_some_and(|n| n > 1) {
        return Some(Refusal::SeveralChoices);
    }
    let logprobs = asked.logprobs.as_ref().is_some_and(|v| !v.is_null() && v.as_bool() != Some(false));
    if logprobs || set(&asked.top_logprobs) {
        return Some(Refusal::Logprobs);
    }
    None
}

/// What a stream's relay does, decided before its request is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuity {
    /// Refused up front: a break says why.
    Refused(Refusal),
    /// Ask the engine for ids (`ask_ids`: the gateway adds the field; the
    /// client did not ask, so they are stripped) and relay its events.
    Relay { ask_ids: bool },
}

/// The continuity of a streamed chat or completion request (`body`), on a
/// replica that gives token ids as far as is known (`gives_ids`).
pub fn continuity(body: &[u8], gives_ids: bool) -> Continuity {
    let Ok(asked) = serde_json::from_slice::<Asked>(body) else { return Continuity::Refused(Refusal::NoTokenIds) };
    if let Some(refused) = refusal_of(&asked) {
        return Continuity::Refused(refused);
    }
    match asked.return_token_ids {
        None if gives_ids => Continuity::Relay { ask_ids: true },
        None => Continuity::Refused(Refusal::NoTokenIds),
        // The client's own: passed as it asked, ids kept if they come.
        Some(_) => Continuity::Relay { ask_ids: false },
    }
}

/// The field the gateway adds to a request to get token ids, before the
/// body's other fields (the one edit, README "Streams that outlive their
/// replica"). None when the body is no JSON object.
pub fn ask_for_ids(body: &[u8]) -> Option<Bytes> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[start] != b'{' {
        return None;
    }
    let rest = &body[start + 1..];
    let empty = rest.iter().all(|b| b.is_ascii_whitespace() || *b == b'}');
    let mut out = BytesMut::with_capacity(body.len() + 26);
    out.extend_from_slice(if empty { b"{\"return_token_ids\":true" } else { b"{\"return_token_ids\":true," });
    out.extend_from_slice(rest);
    Some(out.freeze())
}

/// The member names the relay looks for, quoted, each searched for with
/// a finder built once (building one per search cost as much as the
/// search: bench/stream-cpu.sh).
struct Key(Finder<'static>);

static TOKEN_IDS: LazyLock<Key> = LazyLock::new(|| Key::new("token_ids"));
static PROMPT_TOKEN_IDS: LazyLock<Key> = LazyLock::new(|| Key::new("prompt_token_ids"));
static FINISH_REASON: LazyLock<Key> = LazyLock::new(|| Key::new("finish_reason"));
static TOOL_CALLS: LazyLock<Key> = LazyLock::new(|| Key::new("tool_calls"));
static REASONING_CONTENT: LazyLock<Key> = LazyLock::new(|| Key::new("reasoning_content"));
static REASONING: LazyLock<Key> = LazyLock::new(|| Key::new("reasoning"));
static EVENT_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));
/// Both reasoning members' names hold it: one search rules both out.
static REASONING_WORD: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"reasoning"));

impl Key {
    fn new(name: &str) -> Key {
        Key(Finder::new(format!("\"{name}\"").as_bytes()).into_owned())
    }
}

/// A first leg's chunk, as far as the relay reads it: borrowed, the rest
/// skipped.
#[derive(serde::Deserialize)]
struct FirstLeg<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    created: Option<&'a RawValue>,
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(borrow, default)]
    choices: Vec<FirstLegChoice<'a>>,
}

#[derive(serde::Deserialize)]
struct FirstLegChoice<'a> {
    #[serde(borrow)]
    delta: Option<FirstLegDelta<'a>>,
    token_ids: Option<Vec<u32>>,
    #[serde(borrow)]
    finish_reason: Option<&'a RawValue>,
}

/// Only whether these are there, and not null.
#[derive(serde::Deserialize)]
struct FirstLegDelta<'a> {
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning: Option<&'a RawValue>,
}

/// What a stream said so far, as a resumed leg needs it.
#[derive(Debug, Default)]
pub struct Said {
    pub id: Option<Value>,
    pub model: Option<Value>,
    pub created: Option<Value>,
    pub prompt_ids: Option<Vec<u32>>,
    pub generated: Vec<u32>,
    /// A `finish_reason` came: the answer is whole, only its end is missing.
    pub finished: bool,
    /// Why it may not go on, once known.
    pub refused: Option<Refusal>,
}

impl Said {
    /// Tokens past the seam: what the answer had when it broke.
    pub fn seam(&self) -> usize {
        self.generated.len()
    }

    /// Ids kept: the prompt's and the answer's so far.
    fn kept(&self) -> usize {
        self.prompt_ids.as_ref().map_or(0, Vec::len) + self.generated.len()
    }

    fn keep_ids(&mut self, ids: impl Iterator<Item = u32>) {
        for id in ids {
            if self.kept() >= MAX_IDS {
                self.refused.get_or_insert(Refusal::TooLong);
                return;
            }
            self.generated.push(id);
        }
    }

    /// One event of the first leg (a chat or completion chunk), read.
    fn read_first_leg(&mut self, event: &FirstLeg<'_>) {
        let owned = |v: Option<&RawValue>| v.and_then(|v| serde_json::from_str(v.get()).ok());
        if self.id.is_none() {
            (self.id, self.model, self.created) = (owned(event.id), owned(event.model), owned(event.created));
        }
        if let Some(ids) = &event.prompt_token_ids {
            if ids.len() > MAX_IDS {
                self.refused.get_or_insert(Refusal::TooLong);
            } else {
                self.prompt_ids = Some(ids.clone());
            }
        }
        let Some(choice) = event.choices.first() else { return };
        if let Some(delta) = &choice.delta {
            if delta.tool_calls.is_some() {
                self.refused.get_or_insert(Refusal::ToolCall);
            }
            if delta.reasoning_content.is_some() || delta.reasoning.is_some() {
                self.refused.get_or_insert(Refusal::Reasoning);
            }
        }
        if let Some(ids) = &choice.token_ids {
            self.keep_ids(ids.iter().copied());
        }
        if choice.finish_reason.is_some() {
            self.finished = true;
        }
    }

    /// A later event of the first leg, searched (`members`), not parsed.
    /// Returns where its `token_ids` member is (start, end), for the strip.
    fn read_later_event(&mut self, data: &str) -> Option<(usize, usize)> {
        let bytes = data.as_bytes();
        let ids = members(bytes, &TOKEN_IDS).next().map(|(at, value)| (at, value, value_end(bytes, value)));
        if let Some((_, value, end)) = ids {
            let list = data[value..end].trim_start_matches('[').trim_end_matches(']');
            self.keep_ids(list.split(',').filter_map(|id| id.trim().parse().ok()));
        }
        if member(data, &FINISH_REASON).is_some() {
            self.finished = true;
        }
        if member(data, &TOOL_CALLS).is_some() {
            self.refused.get_or_insert(Refusal::ToolCall);
        }
        let reasoning = || member(data, &REASONING_CONTENT).or_else(|| member(data, &REASONING)).is_some();
        if REASONING_WORD.find(bytes).is_some() && reasoning() {
            self.refused.get_or_insert(Refusal::Reasoning);
        }
        ids.map(|(at, _, end)| (at, end))
    }

    /// Why this stream may not go on now (None: it may).
    pub fn refusal(&self) -> Option<Refusal> {
        self.refused.or(self.prompt_ids.is_none().then_some(Refusal::NoTokenIds))
    }
}

/// The `/v1/completions` request that resumes `said` for `request` (the
/// client's chat or completion request): the prompt and the answer so far
/// as ids, its sampling, what is left of its `max_tokens`.
pub fn resume_request(request: &Value, said: &Said) -> Option<Bytes> {
    const CARRIED: [&str; 15] = [
        "model",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "cache_salt",
    ];
    let mut out = Map::new();
    for key in CARRIED {
        if let Some(v) = request.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    let mut prompt = said.prompt_ids.clone()?;
    prompt.extend_from_slice(&said.generated);
    out.insert("prompt".into(), json!(prompt));
    let max = request.get("max_completion_tokens").or_else(|| request.get("max_tokens")).and_then(Value::as_u64);
    if let Some(max) = max {
        out.insert("max_tokens".into(), json!(max.saturating_sub(said.generated.len() as u64).max(1)));
    }
    out.insert("stream".into(), json!(true));
    if let Some(options) = request.get("stream_options") {
        out.insert("stream_options".into(), options.clone());
    }
    out.insert("return_token_ids".into(), json!(true));
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

/// The client's stream, one whole SSE event at a time: the first leg's
/// events read and passed on (ids stripped unless the client asked for
/// them), a resumed leg's re-framed as the first leg's.
pub struct Relay {
    dialect: Dialect,
    client_ids: bool,
    pending: BytesMut,
    pub said: Said,
    /// Completion tokens of the legs before this one.
    generated_before: u64,
    /// Legs resumed so far.
    pub legs: u32,
}

impl Relay {
    /// For a streamed chat or completion (`dialect`) whose client asked for
    /// token ids itself (`client_ids`) or not.
    pub fn new(dialect: Dialect, client_ids: bool) -> Relay {
        Relay { dialect, client_ids, pending: BytesMut::new(), said: Said::default(), generated_before: 0, legs: 0 }
    }

    /// A resumed leg starts: what follows is its events.
    pub fn resumed(&mut self) {
        self.legs += 1;
        self.generated_before = self.said.generated.len() as u64;
        self.pending.clear();
    }

    /// Bytes from the replica in; the whole events among them out (what is
    /// left of the last waits for its end).
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(chunk.len() + self.pending.len());
        // Most chunks are whole events, and nothing waits: read in place.
        let whole = match self.pending.is_empty() {
            true => chunk,
            false => {
                self.pending.extend_from_slice(chunk);
                &std::mem::take(&mut self.pending)[..]
            }
        };
        let mut at = 0;
        while let Some(end) = EVENT_END.find(&whole[at..]) {
            let event = &whole[at..at + end + 2];
            match std::str::from_utf8(event) {
                Ok(text) => self.event(text, &mut out),
                Err(_) => out.extend_from_slice(event),
            }
            at += end + 2;
        }
        self.pending.extend_from_slice(&whole[at..]);
        out.freeze()
    }

    fn event(&mut self, text: &str, out: &mut BytesMut) {
        let Some(data) = text.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim_start) else {
            out.extend_from_slice(text.as_bytes());
            return;
        };
        if data == "[DONE]" {
            out.extend_from_slice(text.as_bytes());
            return;
        }
        if self.legs == 0 {
            // The first event parsed (its id, model, created, prompt ids);
            // every later one searched for the few members the relay reads
            // (a `Value` per event cost the relay 2.3x the CPU per chunk of
            // a plain stream, a borrowed parse 1.9x: bench/stream-cpu.sh).
            let later_ids = match self.said.id.is_none() {
                true => {
                    if let Ok(event) = serde_json::from_str::<FirstLeg>(data) {
                        self.said.read_first_leg(&event);
                    }
                    None
                }
                false => Some(self.said.read_later_event(data)),
            };
            if self.client_ids {
                out.extend_from_slice(text.as_bytes());
                return;
            }
            let at = data.as_ptr() as usize - text.as_ptr() as usize;
            out.extend_from_slice(&text.as_bytes()[..at]);
            match later_ids {
                // A later event: its one `token_ids` member, found already.
                Some(span) => strip_spans_into(data, span.into_iter().collect(), out),
                None => strip_ids_into(data, out),
            }
            out.extend_from_slice(&text.as_bytes()[at + data.len()..]);
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            out.extend_from_slice(text.as_bytes());
            return;
        };
        if let Some(reframed) = self.reframe(&event) {
            out.extend_from_slice(format!("data: {reframed}\n\n").as_bytes());
        }
    }

    /// A resumed leg's completion chunk as the first leg's dialect frames
    /// it; None for a chunk that says nothing (no text, no finish, no usage).
    fn reframe(&mut self, event: &Value) -> Option<Value> {
        let choice = event.get("choices").and_then(|c| c.get(0));
        let text = choice.and_then(|c| c.get("text")).and_then(Value::as_str).unwrap_or("");
        let finish = choice.and_then(|c| c.get("finish_reason")).filter(|f| !f.is_null()).cloned();
        let ids: Vec<u32> = choice
            .and_then(|c| c.get("token_ids"))
            .and_then(Value::as_array)
            .map(|ids| ids.iter().filter_map(Value::as_u64).map(|id| id as u32).collect())
            .unwrap_or_default();
        self.said.generated.extend_from_slice(&ids);
        let head = |object: &str| json!({"id": self.said.id, "object": object, "created": self.said.created, "model": self.said.model});
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            if choice.is_none() {
                let mut out = head(self.object());
                out["choices"] = json!([]);
                out["usage"] = self.merged_usage(usage);
                return Some(out);
            }
        }
        if text.is_empty() && finish.is_none() {
            return None;
        }
        let mut choice = match self.dialect {
            Dialect::Chat if text.is_empty() => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Dialect::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": finish}),
            _ => json!({"index": 0, "text": text, "finish_reason": finish}),
        };
        if self.client_ids {
            choice["token_ids"] = json!(ids);
        }
        let mut out = head(self.object());
        out["choices"] = json!([choice]);
        Some(out)
    }

    fn object(&self) -> &'static str {
        match self.dialect {
            Dialect::Chat => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// The resumed leg's usage as the client's: the first leg's prompt,
    /// every leg's completion tokens.
    fn merged_usage(&self, usage: &Value) -> Value {
        let prompt = self.said.prompt_ids.as_ref().map_or(0, Vec::len) as u64;
        let completion = self.generated_before + usage.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }
}

/// `data` (one event's JSON) without the token-id members the gateway
/// asked for (`prompt_token_ids`, `token_ids`): the rest byte for byte.
#[cfg(test)]
fn strip_ids(data: &str) -> String {
    let mut out = BytesMut::with_capacity(data.len());
    strip_ids_into(data, &mut out);
    String::from_utf8(out.to_vec()).expect("cut at ASCII")
}

/// `strip_ids`, written to `out`.
fn strip_ids_into(data: &str, out: &mut BytesMut) {
    let bytes = data.as_bytes();
    let mut spans: smallvec::SmallVec<[(usize, usize); 2]> = smallvec::SmallVec::new();
    for key in [&*TOKEN_IDS, &*PROMPT_TOKEN_IDS] {
        for (at, value) in members(bytes, key) {
            spans.push((at, value_end(bytes, value)));
        }
    }
    spans.sort_unstable();
    strip_spans_into(data, spans, out);
}

/// `data` without the members at `spans` (start, end; in order), each
/// with one comma, to `out`.
fn strip_spans_into(data: &str, spans: smallvec::SmallVec<[(usize, usize); 2]>, out: &mut BytesMut) {
    let bytes = data.as_bytes();
    let mut last = 0;
    for (at, end) in spans {
        // The member and one comma: the one before it, else the one after.
        let before = data[last..at].trim_end();
        match before.strip_suffix(',') {
            Some(kept) => {
                out.extend_from_slice(kept.as_bytes());
                last = end;
            }
            None => {
                out.extend_from_slice(&bytes[last..at]);
                let after = skip_ws(bytes, end);
                last = if bytes.get(after) == Some(&b',') { skip_ws(bytes, after + 1) } else { end };
            }
        }
    }
    out.extend_from_slice(&bytes[last..]);
}

/// Where the object member named `key` (with its quotes) starts, and where
/// its value starts, for each one in `bytes` (a JSON text). Found by a
/// substring search, not a parse: in valid JSON a quote inside a string is
/// escaped, so `"key"` after `{` or `,` and before `:` is a member's name.
fn members<'a>(bytes: &'a [u8], key: &'a Key) -> impl Iterator<Item = (usize, usize)> + 'a {
    let len = key.0.needle().len();
    key.0.find_iter(bytes).filter_map(move |at| {
        let before = bytes[..at].iter().rposition(|b| !b.is_ascii_whitespace())?;
        let colon = skip_ws(bytes, at + len);
        let named = matches!(bytes[before], b'{' | b',') && bytes.get(colon) == Some(&b':');
        named.then(|| (at, skip_ws(bytes, colon + 1)))
    })
}

/// The value of member `key` (quoted) in `data`, when there and not null.
fn member<'a>(data: &'a str, key: &Key) -> Option<&'a str> {
    let bytes = data.as_bytes();
    let (_, value) = members(bytes, key).next()?;
    let text = &data[value..value_end(bytes, value)];
    (text != "null").then_some(text)
}

/// The index just past the string that opens at `start`.
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The index just past the JSON value that starts at `start`.
fn value_end(bytes: &[u8], start: usize) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i = string_end(bytes, i);
                if depth == 0 {
                    return i;
                }
                continue;
            }
            b'[' | b'{' => depth += 1,
            b']' | b'}' if depth == 0 => return i,
            b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            b',' if depth == 0 => return i,
            _ => {}
        }
        i += 1;
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    #[test]
    fn every_refusal_is_a_metric_label_from_the_start() {
        let all = [
            Refusal::StructuredOutput,
            Refusal::SeveralChoices,
            Refusal::Logprobs,
            Refusal::ToolCall,
            Refusal::Reasoning,
            Refusal::NoTokenIds,
            Refusal::TooLong,
            Refusal::Limit,
            Refusal::NoReplica,
            Refusal::Busy,
        ];
        assert_eq!(all.map(Refusal::as_str), crate::metrics::NOT_CONTINUED_REASONS);
    }

    #[test]
    fn the_ids_the_gateway_asked_for_are_stripped_and_nothing_else_changes() {
        let event = r#"{"id":"c1","prompt_token_ids":[1,2,3],"choices":[{"index":0,"delta":{"content":"a, \"b\""},"token_ids":[7],"finish_reason":null}]}"#;
        assert_eq!(
            strip_ids(event),
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"a, \"b\""},"finish_reason":null}]}"#
        );
        let first = r#"{"token_ids":[1], "text":"x"}"#;
        assert_eq!(strip_ids(first), r#"{"text":"x"}"#);
        let only = r#"{"a":{"token_ids":null}}"#;
        assert_eq!(strip_ids(only), r#"{"a":{}}"#);
        let text_mentions = r#"{"text":"\"token_ids\":[1]"}"#;
        assert_eq!(strip_ids(text_mentions), text_mentions, "a string that says it is no member");
    }

    #[test]
    fn a_request_asks_for_ids_before_its_own_fields() {
        assert_eq!(&ask_for_ids(b" {\"a\":1}").unwrap()[..], b"{\"return_token_ids\":true,\"a\":1}");
        assert_eq!(&ask_for_ids(b"{}").unwrap()[..], b"{\"return_token_ids\":true}");
        assert!(ask_for_ids(b"[1]").is_none());
    }

    #[test]
    fn what_a_seam_would_corrupt_is_refused_before_anything_is_sent() {
        let of = |v: Value| continuity(v.to_string().as_bytes(), true);
        let refused = |v: Value| of(v) == Continuity::Refused(Refusal::StructuredOutput);
        assert!(refused(json!({"response_format": {"type": "json_schema", "json_schema": {}}})));
        assert!(refused(json!({"guided_regex": "a+"})));
        assert_eq!(of(json!({"n": 2})), Continuity::Refused(Refusal::SeveralChoices));
        assert_eq!(of(json!({"logprobs": true})), Continuity::Refused(Refusal::Logprobs));
        assert_eq!(of(json!({"logprobs": 2})), Continuity::Refused(Refusal::Logprobs));
        let plain = json!({"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": false,
            "response_format": {"type": "text"}});
        assert_eq!(of(plain.clone()), Continuity::Relay { ask_ids: true });
        assert_eq!(continuity(plain.to_string().as_bytes(), false), Continuity::Refused(Refusal::NoTokenIds));
        assert_eq!(of(json!({"return_token_ids": true})), Continuity::Relay { ask_ids: false }, "the client's own");
    }

    #[test]
    fn a_chat_stream_resumes_as_a_completion_and_reads_as_one_stream() {
        let mut relay = Relay::new(Dialect::Chat, false);
        let first = chunk(json!({"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "prompt_token_ids": [10, 11],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "the"}, "token_ids": [1], "finish_reason": null}]}));
        // Split mid-event: nothing passes until the event is whole.
        let (a, b) = first.split_at(30);
        assert!(relay.feed(a.as_bytes()).is_empty());
        let out = relay.feed(b.as_bytes());
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.starts_with("data: ") && !text.contains("token_ids"), "{text}");
        assert_eq!(relay.said.refusal(), None);
        let request = json!({"model": "m", "messages": [], "max_tokens": 4, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true}});
        let resume: Value = serde_json::from_slice(&resume_request(&request, &relay.said).unwrap()).unwrap();
        assert_eq!(resume["prompt"], json!([10, 11, 1]));
        assert_eq!(resume["max_tokens"], 3);
        assert_eq!((resume["temperature"].clone(), resume["return_token_ids"].clone()), (json!(0), json!(true)));
        assert!(resume.get("messages").is_none());
        relay.resumed();
        let second = [
            json!({"id": "cmpl-x", "object": "text_completion", "created": 9, "model": "m", "prompt_token_ids": [10, 11, 1],
                "choices": [{"index": 0, "text": " cache", "token_ids": [2], "finish_reason": null}]}),
            json!({"id": "cmpl-x", "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}),
            json!({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
        ];
        let mut body = String::new();
        for e in &second {
            body.push_str(std::str::from_utf8(&relay.feed(chunk(e.clone()).as_bytes())).unwrap());
        }
        body.push_str(std::str::from_utf8(&relay.feed(b"data: [DONE]\n\n")).unwrap());
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
    fn a_seam_inside_a_tool_call_or_reasoning_or_without_ids_is_refused() {
        let mut relay = Relay::new(Dialect::Chat, false);
        relay.feed(chunk(json!({"choices": [{"delta": {"content": "hi"}}]})).as_bytes());
        assert_eq!(relay.said.refusal(), Some(Refusal::NoTokenIds));
        let mut relay = Relay::new(Dialect::Chat, true);
        relay.feed(
            chunk(json!({"prompt_token_ids": [1], "choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), Some(Refusal::ToolCall));
        let mut relay = Relay::new(Dialect::Chat, true);
        relay.feed(
            chunk(json!({"prompt_token_ids": [1], "choices": [{"delta": {"reasoning_content": "hm"}}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), Some(Refusal::Reasoning));
    }

    #[test]
    fn later_events_are_read_by_their_members_not_by_what_their_text_says() {
        let mut relay = Relay::new(Dialect::Chat, false);
        relay.feed(
            chunk(
                json!({"id": "c", "prompt_token_ids": [5], "choices": [{"delta": {"content": "a"}, "token_ids": [1]}]}),
            )
            .as_bytes(),
        );
        let tricky = r#"data: {"choices":[{"delta":{"content":"\"token_ids\":[9], \"tool_calls\":[1]"},"token_ids":[2],"finish_reason":null}]}"#;
        let out = relay.feed(format!("{tricky}\n\n").as_bytes());
        assert_eq!(relay.said.generated, vec![1, 2], "the member, not the text");
        assert_eq!((relay.said.finished, relay.said.refusal()), (false, None));
        assert!(std::str::from_utf8(&out).unwrap().contains(r#"\"token_ids\":[9]"#), "the text is left alone");
        relay.feed(chunk(json!({"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "token_ids": [3]}]})).as_bytes());
        assert_eq!(relay.said.refusal(), Some(Refusal::ToolCall));
        relay.feed(chunk(json!({"choices": [{"delta": {}, "token_ids": [], "finish_reason": "stop"}]})).as_bytes());
        assert!(relay.said.finished);
    }

    #[test]
    fn the_ids_kept_are_bounded_and_past_the_bound_the_stream_is_known_not_continuable() {
        let mut relay = Relay::new(Dialect::Completions, true);
        let prompt: Vec<u32> = (0..MAX_IDS as u32 - 2).collect();
        relay.feed(
            chunk(json!({"prompt_token_ids": prompt, "choices": [{"text": "a", "token_ids": [1, 2]}]})).as_bytes(),
        );
        assert_eq!(relay.said.refusal(), None);
        relay.feed(chunk(json!({"choices": [{"text": "b", "token_ids": [3]}]})).as_bytes());
        assert_eq!(relay.said.refusal(), Some(Refusal::TooLong));
        assert!(relay.said.prompt_ids.as_ref().unwrap().len() + relay.said.generated.len() <= MAX_IDS);
    }
}
