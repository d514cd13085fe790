//! Continuation: streams that outlive their replica (docs/streams.md). This
//! module is its one owner: what a stream has said so far and whether it
//! may be continued (here), its events read and re-framed (`relay.rs`,
//! `agents.rs`, `calls.rs`, `scan.rs`), the conversation written for the
//! next leg (`transcript.rs`), the break-and-swap state machine the body
//! calls (`continuation.rs`) and the next leg's I/O (`leg.rs`).
//!
//! Two ways on (`Way`), both through `/v1/completions` with the prompt as
//! token ids, the same sampling, `max_tokens` less what was generated (a
//! request that offers tools goes through the chat endpoint instead, so the
//! engine parses a tool call after the seam):
//! - **Ids** (exact): a chat or completion stream asks its engine for
//!   `return_token_ids` (vLLM: the prompt's ids in the first chunk, each
//!   chunk's own ids). The ids are kept (4 bytes each, at most `MAX_IDS`)
//!   and stripped from what the client reads unless it asked for them.
//! - **Text** (not exact): where the engine or endpoint gives no ids
//!   (llama.cpp, vLLM's Responses and Messages), the answer's text so far
//!   is kept, and the conversation plus that text is rendered and tokenized
//!   by the engine that resumes it (`transcript.rs`).
//!
//! The next leg's chunks reach the client as the first leg's (`relay.rs`):
//! its id, model and created, in its dialect's events (`agents.rs` and
//! `calls.rs` for Responses and Messages), no second role, one finish, one
//! end, usage merged (the first prompt, every leg's completion tokens).

use bytes::{Bytes, BytesMut};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::policy::{Dialect, SeamRisk, StreamAsks};

mod agents;
mod calls;
mod continuation;
mod frames;
mod leg;
mod relay;
mod scan;
mod transcript;

pub use continuation::{Break, Continuation, Limits, Next};
pub use leg::Seed;
pub use relay::Relay;

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
    /// Log probabilities: the next leg's would be of another prompt.
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
    /// No other replica could take it, or it refused the next leg.
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

impl From<SeamRisk> for Refusal {
    fn from(risk: SeamRisk) -> Refusal {
        match risk {
            SeamRisk::StructuredOutput => Refusal::StructuredOutput,
            SeamRisk::SeveralChoices => Refusal::SeveralChoices,
            SeamRisk::Logprobs => Refusal::Logprobs,
            SeamRisk::StoredConversation => Refusal::NoTranscript,
            SeamRisk::StoredResponse => Refusal::StoredResponse,
        }
    }
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

/// Whether a stream may be continued, decided before its request is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuable {
    /// Refused up front: a break says why.
    No(Refusal),
    /// Relay its events, kept for `way`; `ask_ids`: the gateway adds
    /// `return_token_ids` (the client did not ask, so they are stripped);
    /// `usage`: the client asked for a usage chunk.
    Yes { way: Way, ask_ids: bool, usage: bool },
}

/// Whether a streamed request of `dialect` that asks `asks` (read in the
/// shape's parse) may be continued, on a replica that gives token ids as
/// far as is known (`gives_ids`).
pub fn continuable(asks: &StreamAsks, dialect: Dialect, gives_ids: bool) -> Continuable {
    if let Some(risk) = asks.risk {
        return Continuable::No(risk.into());
    }
    let usage = asks.usage;
    let text = Continuable::Yes { way: Way::Text, ask_ids: false, usage };
    match (dialect, asks.token_ids) {
        // vLLM serves token ids on chat and completions only.
        (Dialect::Responses | Dialect::Messages, _) => text,
        (Dialect::Other, _) => Continuable::No(Refusal::NoTranscript),
        (_, false) if gives_ids => Continuable::Yes { way: Way::Ids, ask_ids: true, usage },
        (_, false) => text,
        // The client's own: passed as it asked, ids kept if they come.
        (_, true) => Continuable::Yes { way: Way::Ids, ask_ids: false, usage },
    }
}

/// The field the gateway adds to a request to get token ids, before the
/// body's other fields (one of the two body edits the README lists). None
/// when the body is no JSON object.
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

/// The prompt's token ids as the engine gave them (its first event's
/// `prompt_token_ids`): the JSON array's bytes, read into ids only if the
/// stream breaks. A long prompt's ids are most of that event: parsed on
/// every stream, they were most of what continuation cost a stream that
/// never broke (bench/stream-cpu.sh, docs/benchmarks-log.md).
#[derive(Debug)]
pub struct PromptIds {
    raw: Bytes,
    pub len: usize,
}

impl PromptIds {
    /// The array `raw` (`[1,2,...]`), its ids counted by their commas.
    fn of(raw: &[u8]) -> PromptIds {
        let empty = raw.iter().all(|b| matches!(b, b'[' | b']') || b.is_ascii_whitespace());
        let len = if empty { 0 } else { memchr::memchr_iter(b',', raw).count() + 1 };
        PromptIds { raw: Bytes::copy_from_slice(raw), len }
    }
}

/// What a stream said so far, as a next leg needs it.
#[derive(Debug)]
pub struct Said {
    pub way: Way,
    pub id: Option<Value>,
    pub model: Option<Value>,
    pub created: Option<Value>,
    /// The ids way: the prompt's ids and the answer's so far.
    pub prompt_ids: Option<PromptIds>,
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
        self.prompt_ids.as_ref().map_or(0, |p| p.len) + self.generated.len()
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

    /// The tool calls the answer finished before the seam (Responses and
    /// Messages), as chat writes them.
    pub fn calls(&self) -> &[Value] {
        &self.agent.calls
    }

    /// Whether its first event came, with what a resume needs (its ids, on
    /// the ids way): from then on its silence is watched.
    pub fn started(&self) -> bool {
        match self.way {
            Way::Ids => self.prompt_ids.is_some(),
            Way::Text => self.id.is_some() || self.agent.created.is_some(),
        }
    }

    /// The prompt a next leg is sent on the ids way: the prompt's ids
    /// and the answer's so far.
    pub fn prompt_with_answer(&self) -> Option<Vec<u32>> {
        let mut prompt: Vec<u32> = scan::ids_in(&self.prompt_ids.as_ref()?.raw).collect();
        prompt.extend_from_slice(&self.generated);
        Some(prompt)
    }
}

/// The sampling a next leg carries from the client's request (`request`,
/// of `dialect`), `max_tokens` as what is left after `generated`, streamed
/// with usage (always asked: the merged count needs it; the relay passes
/// it on only to a client that asked for it).
fn carried(request: &Value, dialect: Dialect, generated: usize) -> Map<String, Value> {
    const CARRIED: [&str; 16] = [
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
        // llama.cpp's: a client that turned the prompt cache off for
        // repeatable answers keeps it off on the next leg.
        "cache_prompt",
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
    let max = match dialect {
        Dialect::Responses => request.get("max_output_tokens"),
        _ => request.get("max_completion_tokens").or_else(|| request.get("max_tokens")),
    };
    if let Some(max) = max.and_then(Value::as_u64) {
        out.insert("max_tokens".into(), json!(left_of(max, generated)));
    }
    out.insert("stream".into(), json!(true));
    out.insert("stream_options".into(), json!({"include_usage": true}));
    out
}

/// The `/v1/completions` request that continues the client's request
/// (`request`, of `dialect`) with `prompt` (token ids: the conversation
/// and the answer so far), after `generated` tokens.
pub fn resume_request(request: &Value, dialect: Dialect, prompt: &[u32], generated: usize) -> Option<Bytes> {
    let mut out = carried(request, dialect, generated);
    out.insert("prompt".into(), json!(prompt));
    out.insert("return_token_ids".into(), json!(true));
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

/// The chat request that continues a Responses or Messages `request` that
/// offers tools, after `generated` tokens: its `transcript` with the answer
/// so far as the open last message (`Transcript::open_chat`), so the
/// engine's tool parser sees a call the model starts after the seam, and
/// the request's sampling.
pub fn transcript_chat_request(
    request: &Value,
    dialect: Dialect,
    transcript: &transcript::Transcript,
    generated: usize,
) -> Option<Bytes> {
    let mut out = carried(request, dialect, generated);
    out.extend(transcript.open_chat()?);
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

/// What is left of a request's `max` tokens after `generated` (at least
/// one: a next leg asks for something).
fn left_of(max: u64, generated: usize) -> u64 {
    max.saturating_sub(generated as u64).max(1)
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
    out.insert("stream_options".into(), json!({"include_usage": true}));
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(max) = out.get(key).and_then(Value::as_u64) {
            out.insert(key.into(), json!(left_of(max, generated)));
        }
    }
    out.insert("stream".into(), json!(true));
    serde_json::to_vec(&Value::Object(out)).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::scan::strip_ids;
    use super::*;

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
    fn what_a_seam_would_corrupt_is_refused_before_anything_is_sent_and_the_rest_goes_the_way_it_can() {
        let of = |asks: StreamAsks, gives_ids| continuable(&asks, Dialect::Chat, gives_ids);
        let structured = StreamAsks { risk: Some(SeamRisk::StructuredOutput), ..Default::default() };
        assert_eq!(of(structured, true), Continuable::No(Refusal::StructuredOutput));
        let stored = StreamAsks { risk: Some(SeamRisk::StoredConversation), ..Default::default() };
        assert_eq!(continuable(&stored, Dialect::Responses, true), Continuable::No(Refusal::NoTranscript));
        let plain = StreamAsks::default();
        assert_eq!(of(plain, true), Continuable::Yes { way: Way::Ids, ask_ids: true, usage: false });
        let text = Continuable::Yes { way: Way::Text, ask_ids: false, usage: false };
        assert_eq!(of(plain, false), text, "no ids: the text way");
        assert_eq!(continuable(&plain, Dialect::Messages, true), text, "no ids on Messages");
        let own = StreamAsks { token_ids: true, usage: true, ..Default::default() };
        assert_eq!(of(own, false), Continuable::Yes { way: Way::Ids, ask_ids: false, usage: true }, "the client's own");
    }
}
