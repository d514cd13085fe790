//! Streams that outlive their replica, the pure half (no I/O): what a
//! stream has said so far, whether it may go on elsewhere, the request that
//! resumes it, and the resumed leg's events re-framed as the first leg's.
//! The I/O half is `body.rs` (the break and the swap) and `attempt.rs`
//! (`Resumer`: the replica, the tokenize, the request).
//!
//! Two ways on (`Way`), both through `/v1/completions` with the prompt as
//! token ids, the same sampling, `max_tokens` less what was generated:
//! - **Ids** (exact): a chat or completion stream asks its engine for
//!   `return_token_ids` (vLLM: the prompt's ids in the first chunk, each
//!   chunk's own ids). The ids are kept (4 bytes each, at most `MAX_IDS`)
//!   and stripped from what the client reads unless it asked for them.
//! - **Text** (not exact): where the engine or endpoint gives no ids
//!   (llama.cpp, vLLM's Responses and Messages), the answer's text so far
//!   is kept, and the conversation plus that text is rendered and tokenized
//!   by the engine that resumes it (`transcript.rs`).
//!
//! The resumed leg's chunks reach the client as the first leg's: its id,
//! model and created, in its dialect's events (`agents.rs` for Responses
//! and Messages), no second role, one finish, one end, usage merged (the
//! first prompt, every leg's completion tokens).

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::policy::Dialect;
use scan::*;
use smallvec::SmallVec;

mod agents;
mod scan;
pub mod transcript;

/// Most token ids kept per stream (prompt and answer): 256 KiB. A stream
/// past it is not continuable, and it is known before it breaks. The text
/// kept on the text way is bounded the same: 4 bytes a token.
pub const MAX_IDS: usize = 65_536;
const MAX_TEXT: usize = MAX_IDS * 4;

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
    /// More ids than `MAX_IDS` (or text past `MAX_TEXT`).
    TooLong,
    /// `failover.max_continuations` legs already.
    Limit,
    /// No other replica could take it, or it refused the resumed leg.
    NoReplica,
    /// `failover.max_resuming` legs were starting already.
    Busy,
    /// The conversation cannot be rendered from the request (a stored
    /// conversation named by `previous_response_id`, an image, a prompt
    /// given as ids without ids back).
    NoTranscript,
    /// The replica renders and tokenizes no conversation (neither vLLM's
    /// `/tokenize` nor llama.cpp's `/apply-template` answered).
    NoTokenizer,
    /// A Responses stream that stores its response: the resumed answer is
    /// stored nowhere, and a follow-up naming its id would find no replica.
    StoredResponse,
}

impl Refusal {
    pub const ALL: [Refusal; 13] = [
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
        Refusal::NoTranscript,
        Refusal::NoTokenizer,
        Refusal::StoredResponse,
    ];

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
            Refusal::NoTranscript => "no_transcript",
            Refusal::NoTokenizer => "no_tokenizer",
            Refusal::StoredResponse => "stored_response",
        }
    }
}

/// What a streamed request asks that decides whether its stream may go on
/// elsewhere (the rest of the body is skimmed, not kept).
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
    /// Responses: its output format (`text.format`), whether it is stored,
    /// and the stored conversation it continues.
    text: Option<Value>,
    store: Option<bool>,
    previous_response_id: Option<Value>,
}

/// Whether a request's stream could ever go on elsewhere: refused before
/// anything is sent for what a seam would corrupt.
pub fn refusal_of(asked: &Asked, dialect: Dialect) -> Option<Refusal> {
    let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let format = asked.response_format.as_ref().or_else(|| asked.text.as_ref().and_then(|t| t.get("format")));
    let schema = format.and_then(|f| f.get("type")).and_then(Value::as_str);
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
    if dialect == Dialect::Responses {
        if set(&asked.previous_response_id) {
            return Some(Refusal::NoTranscript);
        }
        if asked.store != Some(false) {
            return Some(Refusal::StoredResponse);
        }
    }
    None
}

/// How a broken stream is resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// With the engine's token ids: token for token.
    Ids,
    /// With the answer's text, rendered and tokenized by the engine that
    /// resumes it: the event says `exact: false`.
    Text,
}

/// What a stream's relay does, decided before its request is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuity {
    /// Refused up front: a break says why.
    Refused(Refusal),
    /// Relay its events, kept for `way`; `ask_ids`: the gateway adds
    /// `return_token_ids` (the client did not ask, so they are stripped).
    Relay { way: Way, ask_ids: bool },
}

/// The continuity of a streamed request (`body`) of `dialect`, on a
/// replica that gives token ids as far as is known (`gives_ids`).
pub fn continuity(body: &[u8], dialect: Dialect, gives_ids: bool) -> Continuity {
    let Ok(asked) = serde_json::from_slice::<Asked>(body) else { return Continuity::Refused(Refusal::NoTranscript) };
    if let Some(refused) = refusal_of(&asked, dialect) {
        return Continuity::Refused(refused);
    }
    let text = Continuity::Relay { way: Way::Text, ask_ids: false };
    match (dialect, asked.return_token_ids) {
        // vLLM serves token ids on chat and completions only.
        (Dialect::Responses | Dialect::Messages, _) => text,
        (Dialect::Other, _) => Continuity::Refused(Refusal::NoTranscript),
        (_, None) if gives_ids => Continuity::Relay { way: Way::Ids, ask_ids: true },
        (_, None) => text,
        // The client's own: passed as it asked, ids kept if they come.
        (_, Some(_)) => Continuity::Relay { way: Way::Ids, ask_ids: false },
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
    #[serde(borrow)]
    usage: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct FirstLegChoice<'a> {
    #[serde(borrow)]
    delta: Option<FirstLegDelta<'a>>,
    /// A completion's text.
    #[serde(borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
    token_ids: Option<Vec<u32>>,
    #[serde(borrow)]
    finish_reason: Option<&'a RawValue>,
}

/// Its text, and only whether the others are there, and not null.
#[derive(serde::Deserialize)]
struct FirstLegDelta<'a> {
    #[serde(borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning: Option<&'a RawValue>,
}

/// What a stream said so far, as a resumed leg needs it.
#[derive(Debug)]
pub struct Said {
    pub way: Way,
    pub id: Option<Value>,
    pub model: Option<Value>,
    pub created: Option<Value>,
    /// The ids way: the prompt's ids and the answer's so far.
    pub prompt_ids: Option<Vec<u32>>,
    pub generated: Vec<u32>,
    /// The text way: the answer's text so far, and its tokens as the
    /// stream counted them (an event of text each, as engines stream).
    pub text: String,
    pub tokens: usize,
    /// A finish came: the answer is whole, only its end is missing.
    pub finished: bool,
    /// Why it may not go on, once known.
    pub refused: Option<Refusal>,
    /// Chat and completions: the answer's last event was inside a tool
    /// call or reasoning (a seam there is refused; after it, not).
    open: Option<Refusal>,
    /// Responses and Messages: what their resumed events carry on.
    agent: agents::AgentSaid,
}

impl FirstLeg<'_> {
    /// Its answer's text: a chat delta's content, or a completion's text.
    fn text(&self) -> &str {
        let Some(choice) = self.choices.first() else { return "" };
        choice.delta.as_ref().and_then(|d| d.content.as_deref()).or(choice.text.as_deref()).unwrap_or("")
    }
}

impl Said {
    fn new(way: Way) -> Said {
        Said {
            way,
            id: None,
            model: None,
            created: None,
            prompt_ids: None,
            generated: Vec::new(),
            text: String::new(),
            tokens: 0,
            finished: false,
            refused: None,
            open: None,
            agent: agents::AgentSaid::default(),
        }
    }

    /// Tokens past the seam: what the answer had when it broke.
    pub fn seam(&self) -> usize {
        match self.way {
            Way::Ids => self.generated.len(),
            Way::Text => self.tokens,
        }
    }

    /// Whether it goes on token for token.
    pub fn exact(&self) -> bool {
        self.way == Way::Ids
    }

    /// Ids kept: the prompt's and the answer's so far.
    fn kept(&self) -> usize {
        self.prompt_ids.as_ref().map_or(0, Vec::len) + self.generated.len()
    }

    fn keep_ids(&mut self, ids: impl Iterator<Item = u32>) {
        let room = MAX_IDS.saturating_sub(self.kept());
        let before = self.generated.len();
        self.generated.extend(ids.take(room + 1));
        if self.generated.len() - before > room {
            self.generated.truncate(before + room);
            self.refused.get_or_insert(Refusal::TooLong);
        }
    }

    /// Text of the answer, on the text way: kept, and counted a token.
    fn keep_text(&mut self, text: &str) {
        if self.way != Way::Text || text.is_empty() {
            return;
        }
        if self.text.len() + text.len() > MAX_TEXT {
            self.refused.get_or_insert(Refusal::TooLong);
            return;
        }
        self.text.push_str(text);
        self.tokens += 1;
    }

    /// A chat or completion event of the first leg, read whole (its first
    /// event, or any on the text way).
    fn read_whole(&mut self, event: &FirstLeg<'_>) {
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
        self.read_seam(event);
        self.keep_text(event.text());
        if let Some(ids) = event.choices.first().and_then(|c| c.token_ids.as_ref()) {
            self.keep_ids(ids.iter().copied());
        }
    }

    /// What an event says of a seam after it: the answer finished (a
    /// finish, or the usage that follows one), or is inside a tool call or
    /// reasoning, or in its text.
    fn read_seam(&mut self, event: &FirstLeg<'_>) {
        let Some(choice) = event.choices.first() else {
            self.finished |= event.usage.is_some();
            return;
        };
        if let Some(delta) = &choice.delta {
            if delta.tool_calls.is_some() {
                self.open = Some(Refusal::ToolCall);
            } else if delta.reasoning_content.is_some() || delta.reasoning.is_some() {
                self.open = Some(Refusal::Reasoning);
            } else if delta.content.as_deref().is_some_and(|c| !c.is_empty()) {
                self.open = None;
            }
        }
        if choice.finish_reason.is_some() {
            self.finished = true;
        }
    }

    /// Why this stream may not go on now (None: it may).
    pub fn refusal(&self) -> Option<Refusal> {
        let no_ids = self.way == Way::Ids && self.prompt_ids.is_none();
        self.refused.or(self.open).or(no_ids.then_some(Refusal::NoTokenIds))
    }

    /// Whether its first event came, with what a resume needs (its ids, on
    /// the ids way): from then on its silence is watched.
    pub fn started(&self) -> bool {
        match self.way {
            Way::Ids => self.prompt_ids.is_some(),
            Way::Text => self.id.is_some(),
        }
    }

    /// The prompt a resumed leg is sent on the ids way: the prompt's ids
    /// and the answer's so far.
    pub fn prompt_with_answer(&self) -> Option<Vec<u32>> {
        let mut prompt = self.prompt_ids.clone()?;
        prompt.extend_from_slice(&self.generated);
        Some(prompt)
    }
}

/// The `/v1/completions` request that resumes the client's request
/// (`request`, of `dialect`) with `prompt` (token ids: the conversation
/// and the answer so far), after `generated` tokens: its sampling, what is
/// left of its `max_tokens`.
pub fn resume_request(request: &Value, dialect: Dialect, prompt: &[u32], generated: usize) -> Option<Bytes> {
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
    // Messages names its stop strings otherwise.
    if let Some(stop) = request.get("stop_sequences").filter(|_| dialect == Dialect::Messages) {
        out.insert("stop".into(), stop.clone());
    }
    out.insert("prompt".into(), json!(prompt));
    let max = match dialect {
        Dialect::Responses => request.get("max_output_tokens"),
        _ => request.get("max_completion_tokens").or_else(|| request.get("max_tokens")),
    };
    if let Some(max) = max.and_then(Value::as_u64) {
        out.insert("max_tokens".into(), json!(max.saturating_sub(generated as u64).max(1)));
    }
    out.insert("stream".into(), json!(true));
    match dialect {
        // Their end carries usage: always asked for.
        Dialect::Responses | Dialect::Messages => {
            out.insert("stream_options".into(), json!({"include_usage": true}));
        }
        _ => {
            if let Some(options) = request.get("stream_options") {
                out.insert("stream_options".into(), options.clone());
            }
        }
    }
    out.insert("return_token_ids".into(), json!(true));
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

/// Whether a chat request offers tools the model may call: its stream is
/// then resumed through the chat endpoint, whose tool parser turns a call
/// after the seam into `tool_calls` (`/v1/completions` would pass its
/// markup as text).
pub fn offers_tools(request: &Value) -> bool {
    let tools = request.get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty());
    tools && request.get("tool_choice").and_then(Value::as_str) != Some("none")
}

/// The chat request that resumes the client's chat `request` after
/// `generated` tokens whose text is `answer`: its own request with the
/// answer as the open last message (`continue_final_message`, vLLM's),
/// what is left of its `max_tokens`.
pub fn chat_resume_request(request: &Value, answer: &str, generated: usize) -> Option<Bytes> {
    let mut out = request.as_object()?.clone();
    let mut messages = out.get("messages")?.as_array()?.clone();
    messages.push(json!({"role": "assistant", "content": answer}));
    out.insert("messages".into(), json!(messages));
    out.insert("continue_final_message".into(), json!(true));
    out.insert("add_generation_prompt".into(), json!(false));
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(max) = out.get(key).and_then(Value::as_u64) {
            out.insert(key.into(), json!(max.saturating_sub(generated as u64).max(1)));
        }
    }
    out.insert("stream".into(), json!(true));
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

/// The client's stream, one whole SSE event at a time: the first leg's
/// events read and passed on (ids stripped unless the client asked for
/// them), a resumed leg's re-framed as the first leg's.
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
    /// The resumed leg's finish and usage, for the dialects whose end
    /// carries them (Responses, Messages).
    finish: Option<Value>,
    usage: Option<Value>,
    /// The ids way: the first leg's last events, read whole at a break
    /// (`at_break`).
    last: Bytes,
    /// Where the client's chunks are written.
    out: BytesMut,
    /// The resumed leg runs on the chat endpoint (`resumed`).
    chat_leg: bool,
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
        }
    }

    /// At a break: what the first leg's last event says of the seam (the
    /// ids way read only the ids of its later events as they passed).
    pub fn at_break(&mut self) {
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

    /// A resumed leg starts: what follows is its events.
    /// A resumed leg starts: what follows is its events. `via_chat`: it
    /// runs on the chat endpoint, resumed from this text of the answer
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
        let mut out = std::mem::take(&mut self.out);
        out.reserve(chunk.len() + self.pending.len());
        let whole = match self.pending.is_empty() {
            true => &chunk[..],
            false => {
                self.pending.extend_from_slice(chunk);
                &std::mem::take(&mut self.pending)[..]
            }
        };
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
    fn feed_slice(&mut self, chunk: &[u8]) -> Bytes {
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
    /// per chunk (bench/stream-cpu.sh, docs/benchmarks.md).
    fn later_events(&mut self, chunk: &Bytes) -> Bytes {
        self.last = chunk.clone();
        // One event (no line end before its last two): its ids found from
        // its end; else every member searched for.
        let one_event = memchr::memchr(b'\n', &chunk[..chunk.len() - 2]).is_none();
        if let Some(found) = one_event.then(|| last_array_token_ids(chunk)).flatten() {
            self.said.keep_ids(ids_in(&chunk[found.value..found.end]));
            if !self.strip_ids {
                return chunk.clone();
            }
            return self.written(chunk.len(), |out| without_member(chunk, found.at, found.end, out));
        }
        let found: SmallVec<[scan::Found; 2]> = token_ids(chunk).collect();
        let mut spans: SmallVec<[(usize, usize); 2]> = SmallVec::new();
        for found in found {
            self.said.keep_ids(ids_in(&chunk[found.value..found.end]));
            spans.push((found.at, found.end));
        }
        if spans.is_empty() || !self.strip_ids {
            return chunk.clone();
        }
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
                agents::read(&mut self.said, self.dialect, data);
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
        if let Ok(event) = serde_json::from_str::<FirstLeg>(data) {
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
        strip_ids_into(data.as_bytes(), out);
        out.extend_from_slice(&text.as_bytes()[at + data.len()..]);
    }

    /// A resumed leg's completion chunk, re-framed as the first leg's
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
        let usage = event.get("usage").filter(|u| !u.is_null() && choice.is_none());
        match self.dialect {
            Dialect::Responses | Dialect::Messages => {
                if !text.is_empty() {
                    out.extend_from_slice(agents::delta(&mut self.said, self.dialect, text).as_bytes());
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
                if let Some(chunk) = self.reframed_chunk(text, finish, &ids, usage) {
                    out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
                }
            }
        }
    }

    /// A resumed chat leg's chunk (a chat that offers tools): its delta as
    /// the engine parsed it (text or a tool call), with the first leg's
    /// id, model and created, no role; usage merged.
    fn resumed_chat_event(&mut self, event: &Value, choice: Option<&Value>, out: &mut BytesMut) {
        let mut delta = choice.and_then(|c| c.get("delta")).cloned().unwrap_or_else(|| json!({}));
        if let Some(delta) = delta.as_object_mut() {
            delta.remove("role");
        }
        self.said.keep_text(delta.get("content").and_then(Value::as_str).unwrap_or(""));
        let finish = choice.and_then(|c| c.get("finish_reason")).filter(|f| !f.is_null());
        let usage = event.get("usage").filter(|u| !u.is_null() && choice.is_none());
        let mut chunk = json!({"id": self.said.id, "object": "chat.completion.chunk", "created": self.said.created, "model": self.said.model});
        if let Some(usage) = usage {
            let (prompt, completion) = self.merged_usage(usage);
            chunk["choices"] = json!([]);
            chunk["usage"] =
                json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
        } else if delta.as_object().is_some_and(|d| !d.is_empty()) || finish.is_some() {
            chunk["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
        } else {
            return;
        }
        out.extend_from_slice(format!("data: {chunk}\n\n").as_bytes());
    }

    /// The resumed leg's `[DONE]`: passed on for chat and completions; for
    /// Responses and Messages, their own end (the item closed, the usage).
    fn resumed_end(&mut self, text: &str, out: &mut BytesMut) {
        match self.dialect {
            Dialect::Responses | Dialect::Messages => {
                let (prompt, completion) = self.merged_usage(self.usage.as_ref().unwrap_or(&Value::Null));
                let end = agents::ending(&mut self.said, self.dialect, self.finish.as_ref(), prompt, completion);
                out.extend_from_slice(end.as_bytes());
            }
            _ => out.extend_from_slice(text.as_bytes()),
        }
    }

    /// A resumed leg's completion chunk as a chat or completion chunk of
    /// the first leg; None for one that says nothing (no text, no finish,
    /// no usage).
    fn reframed_chunk(&self, text: &str, finish: Option<&Value>, ids: &[u32], usage: Option<&Value>) -> Option<Value> {
        let mut out = json!({"id": self.said.id, "object": self.object(), "created": self.said.created, "model": self.said.model});
        if let Some(usage) = usage {
            let (prompt, completion) = self.merged_usage(usage);
            out["choices"] = json!([]);
            out["usage"] =
                json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
            return Some(out);
        }
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
    fn merged_usage(&self, usage: &Value) -> (u64, u64) {
        let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        let prompt = match &self.said.prompt_ids {
            Some(ids) => ids.len() as u64,
            // The text way: the resumed prompt held the answer so far.
            None => count("prompt_tokens").saturating_sub(self.generated_before),
        };
        (prompt, self.generated_before + count("completion_tokens"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(v: Value) -> String {
        format!("data: {v}\n\n")
    }

    #[test]
    fn every_refusal_is_a_metric_label_from_the_start() {
        assert_eq!(Refusal::ALL.map(Refusal::as_str), crate::metrics::NOT_CONTINUED_REASONS);
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
        let of = |v: Value| continuity(v.to_string().as_bytes(), Dialect::Chat, true);
        let refused = |v: Value| of(v) == Continuity::Refused(Refusal::StructuredOutput);
        assert!(refused(json!({"response_format": {"type": "json_schema", "json_schema": {}}})));
        assert!(refused(json!({"guided_regex": "a+"})));
        assert_eq!(of(json!({"n": 2})), Continuity::Refused(Refusal::SeveralChoices));
        assert_eq!(of(json!({"logprobs": true})), Continuity::Refused(Refusal::Logprobs));
        assert_eq!(of(json!({"logprobs": 2})), Continuity::Refused(Refusal::Logprobs));
        let plain = json!({"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": false,
            "response_format": {"type": "text"}});
        assert_eq!(of(plain.clone()), Continuity::Relay { way: Way::Ids, ask_ids: true });
        let text = Continuity::Relay { way: Way::Text, ask_ids: false };
        assert_eq!(continuity(plain.to_string().as_bytes(), Dialect::Chat, false), text, "no ids: the text way");
        assert_eq!(
            of(json!({"return_token_ids": true})),
            Continuity::Relay { way: Way::Ids, ask_ids: false },
            "the client's own"
        );
    }

    #[test]
    fn a_chat_stream_resumes_as_a_completion_and_reads_as_one_stream() {
        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true);
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
        assert!(relay.said.prompt_ids.as_ref().unwrap().len() + relay.said.generated.len() <= MAX_IDS);
    }

    #[test]
    fn a_chat_that_offers_tools_goes_on_through_chat_and_a_tool_call_after_the_seam_arrives_parsed() {
        let request = json!({"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10, "stream": true,
            "tools": [{"type": "function", "function": {"name": "ls"}}]});
        assert!(offers_tools(&request));
        let mut none = request.clone();
        none["tool_choice"] = json!("none");
        assert!(!offers_tools(&none));
        let resume: Value = serde_json::from_slice(&chat_resume_request(&request, "I will", 2).unwrap()).unwrap();
        assert_eq!(resume["messages"][1], json!({"role": "assistant", "content": "I will"}));
        assert_eq!(
            (resume["continue_final_message"].clone(), resume["add_generation_prompt"].clone()),
            (json!(true), json!(false))
        );
        assert_eq!((resume["max_tokens"].clone(), resume["tools"].clone()), (json!(8), request["tools"].clone()));

        let mut relay = Relay::new(Dialect::Chat, Way::Ids, true);
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
}
