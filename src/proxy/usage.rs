//! Watches a response as it passes, without buffering a stream and without
//! touching the bytes: the usage each dialect reports (route receipts), the
//! id of a stored response (Responses API), and whether a stream ended the
//! way its API ends streams (a cut stream is a failed upstream).
//!
//! A non-streaming JSON body is kept (up to a cap) only to parse it at the
//! end; a stream is scanned line by line, and only the few events that carry
//! what we need are parsed.
//!
//! Where each dialect puts things:
//! - chat/completions: `usage.prompt_tokens`, `usage.prompt_tokens_details.cached_tokens`
//!   (streams: the chunk with `usage`, when `stream_options.include_usage`);
//!   streams end with `data: [DONE]`.
//! - Responses: `usage.input_tokens`, `usage.input_tokens_details.cached_tokens`
//!   (streams: in `response.completed`'s `response.usage`); the id in `id`
//!   (streams: `response.created`'s `response.id`); streams end with
//!   `response.completed`, `response.incomplete` or `response.failed`.
//! - Messages: `usage.input_tokens` excludes cached tokens, so the prompt is
//!   `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`
//!   and the cached part `cache_read_input_tokens` (streams: `message_start`'s
//!   `message.usage`); streams end with `message_stop`.

use std::borrow::Cow;
use std::sync::LazyLock;

use bytes::Bytes;
use memchr::memmem::Finder;
use serde::Deserialize;

use crate::policy::Dialect;

/// Largest non-streaming body kept for parsing; bigger ones are unmeasured.
const MAX_KEPT: usize = 4 * 1024 * 1024;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Details {
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

impl RawUsage {
    fn read(self, dialect: Dialect) -> Option<Usage> {
        match dialect {
            Dialect::Messages => {
                let read = self.cache_read_input_tokens.unwrap_or(0);
                Some(Usage {
                    prompt_tokens: self.input_tokens? + read + self.cache_creation_input_tokens.unwrap_or(0),
                    cached_tokens: self.cache_read_input_tokens,
                })
            }
            Dialect::Responses => Some(Usage {
                prompt_tokens: self.input_tokens.or(self.prompt_tokens)?,
                cached_tokens: self.input_tokens_details.and_then(|d| d.cached_tokens),
            }),
            _ => Some(Usage {
                prompt_tokens: self.prompt_tokens.or(self.input_tokens)?,
                cached_tokens: self.prompt_tokens_details.and_then(|d| d.cached_tokens),
            }),
        }
    }
}

#[derive(Deserialize)]
struct Inner<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    usage: Option<RawUsage>,
}

/// Any of the places a dialect puts usage and ids, top level or one down.
/// Ids are borrowed from the body: only a stored response's id is kept.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    usage: Option<RawUsage>,
    #[serde(borrow)]
    response: Option<Inner<'a>>,
    #[serde(borrow)]
    message: Option<Inner<'a>>,
}

pub struct UsageTap {
    dialect: Dialect,
    sse: bool,
    /// Non-streaming: the body's length when the head said it.
    expected: Option<u64>,
    /// Non-streaming: the body so far. Streaming: the current partial line.
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
    response_id: Option<String>,
    /// The response id was handed out by `new_response_id`.
    id_reported: bool,
    /// The last event type seen (from `event:` lines or a data object's `type`).
    last_event: Option<String>,
    saw_done: bool,
}

impl UsageTap {
    /// `expected`: the body's Content-Length, if the head had one.
    pub fn new(dialect: Dialect, sse: bool, expected: Option<u64>) -> UsageTap {
        UsageTap {
            dialect,
            sse,
            expected,
            buf: Vec::new(),
            overflow: false,
            found: None,
            response_id: None,
            id_reported: false,
            last_event: None,
            saw_done: false,
        }
    }

    pub fn observe(&mut self, chunk: &Bytes) {
        if !self.sse {
            if self.buf.is_empty() && self.expected == Some(chunk.len() as u64) {
                // The whole body in one chunk (most replies): read it as it
                // passes, nothing kept.
                self.read_body(chunk);
                self.expected = None;
            } else if self.overflow || self.buf.len() + chunk.len() > MAX_KEPT {
                (self.overflow, self.buf) = (true, Vec::new());
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest: &[u8] = chunk;
        while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
            if self.buf.is_empty() {
                self.line(&rest[..nl]);
            } else {
                self.buf.extend_from_slice(&rest[..nl]);
                let line = std::mem::take(&mut self.buf);
                self.line(&line);
            }
            rest = &rest[nl + 1..];
        }
        if self.buf.len() + rest.len() <= MAX_KEPT {
            self.buf.extend_from_slice(rest);
        } else {
            self.buf.clear();
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(name) = line.strip_prefix(b"event:") {
            self.last_event = Some(String::from_utf8_lossy(name.trim_ascii()).into_owned());
            return;
        }
        let Some(data) = line.strip_prefix(b"data:").map(<[u8]>::trim_ascii) else {
            return;
        };
        if data == b"[DONE]" {
            self.saw_done = true;
            return;
        }
        if let Some(t) = leading_type(data) {
            self.last_event = Some(t.to_string());
        }
        // Cheap filters: only events that can carry usage or the id are parsed.
        let wants_id = self.dialect == Dialect::Responses && self.response_id.is_none() && ID_KEY.find(data).is_some();
        if USAGE_KEY.find(data).is_some() || wants_id {
            self.take(data);
        }
    }

    /// Reads usage and the response id from one JSON document.
    fn take(&mut self, json: &[u8]) {
        let Ok(e) = serde_json::from_slice::<Envelope>(json) else { return };
        let (inner_id, inner_usage) = match (e.response, e.message) {
            (Some(i), _) | (None, Some(i)) => (i.id, i.usage),
            (None, None) => (None, None),
        };
        if let Some(u) = e.usage.or(inner_usage).and_then(|u| u.read(self.dialect)) {
            self.found = Some(u);
        }
        if self.dialect == Dialect::Responses && self.response_id.is_none() {
            self.response_id = inner_id.or(e.id).filter(|id| !id.is_empty()).map(Cow::into_owned);
        }
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Call once, when the body has ended.
    pub fn finish(&mut self) {
        if self.sse || self.overflow || self.buf.is_empty() {
            return;
        }
        let body = std::mem::take(&mut self.buf);
        self.read_body(&body);
    }

    /// A whole non-streaming body. Only a stored response's id needs the
    /// whole document parsed; usage alone is read from its own key.
    fn read_body(&mut self, body: &[u8]) {
        match usage_value(body) {
            Some(usage) if self.dialect != Dialect::Responses => self.take_usage(usage),
            _ => self.take(body.trim_ascii()),
        }
    }

    /// Reads a `usage` object on its own (the bytes from its `{` onward).
    fn take_usage(&mut self, json: &[u8]) {
        // Read as text when it is (one UTF-8 check, not one per key).
        let parsed = match std::str::from_utf8(json) {
            Ok(text) => RawUsage::deserialize(&mut serde_json::Deserializer::from_str(text)),
            Err(_) => RawUsage::deserialize(&mut serde_json::Deserializer::from_slice(json)),
        };
        if let Some(u) = parsed.ok().and_then(|u| u.read(self.dialect)) {
            self.found = Some(u);
        }
    }

    /// The usage seen, if any (after `finish`).
    pub fn usage(&self) -> Option<Usage> {
        self.found
    }

    /// The id of the response this body carried (Responses API).
    pub fn response_id(&self) -> Option<&str> {
        self.response_id.as_deref()
    }

    /// The response id, the first time it is asked for after being read
    /// (None before it is read and ever after): the id is announced as soon
    /// as it passes, not when the body ends.
    pub fn new_response_id(&mut self) -> Option<&str> {
        if self.id_reported || self.response_id.is_none() {
            return None;
        }
        self.id_reported = true;
        self.response_id.as_deref()
    }

    /// For a stream: did it end the way its API ends streams?
    pub fn stream_completed(&self) -> bool {
        let last = self.last_event.as_deref();
        match self.dialect {
            Dialect::Responses => {
                matches!(last, Some("response.completed" | "response.incomplete" | "response.failed" | "error"))
            }
            Dialect::Messages => matches!(last, Some("message_stop" | "error")),
            _ => self.saw_done,
        }
    }
}

// Searchers built once: `memmem::find` builds one per call, and a stream
// asks on every line.
static USAGE_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
static ID_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"id\""));

/// The value of a JSON body's last `"usage"` key, from its first byte on.
/// The bytes `"usage"` then a colon can only be a key: inside a string every
/// quote is escaped (a backslash before the first quote: skipped), and a
/// string value is followed by `,` `]` or `}`. The last such key is the
/// top-level one in every dialect's replies (`usage` follows `choices`,
/// `content` or `output`).
///
/// Candidates come from a vectorized reverse search for the byte `u`; a
/// reverse substring search has no such prefilter and compared every byte
/// of the body's tail (~500 instructions on a short reply, callgrind).
fn usage_value(body: &[u8]) -> Option<&[u8]> {
    let keys = memchr::memrchr_iter(b'u', body)
        .filter(|&u| u > 0 && body[u - 1] == b'"' && body[u..].starts_with(b"usage\""))
        .map(|u| u - 1);
    keys.filter_map(|at| {
        let escaped = at > 0 && body[at - 1] == b'\\';
        let value = body[at + 7..].trim_ascii_start().strip_prefix(b":")?;
        (!escaped).then(|| value.trim_ascii_start())
    })
    .next()
}

/// The `type` of a data object that starts with it (`{"type":"x",...}`),
/// as the Responses and Messages APIs write their events.
fn leading_type(data: &[u8]) -> Option<&str> {
    let rest = data.strip_prefix(b"{\"type\":")?.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    std::str::from_utf8(&rest[..end]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tap(dialect: Dialect, sse: bool, chunks: &[&[u8]]) -> UsageTap {
        let mut t = UsageTap::new(dialect, sse, None);
        for c in chunks {
            t.observe(&Bytes::copy_from_slice(c));
        }
        t.finish();
        t
    }

    #[test]
    fn finds_usage_in_a_json_body_split_across_chunks() {
        let t = tap(
            Dialect::Chat,
            false,
            &[br#"{"id":"x","usage":{"prompt_tokens":10,"#, br#""prompt_tokens_details":{"cached_tokens":8}}}"#],
        );
        assert_eq!(t.usage(), Some(Usage { prompt_tokens: 10, cached_tokens: Some(8) }));
        assert_eq!(t.response_id(), None, "only the Responses API has stored responses");
    }

    #[test]
    fn usage_is_read_whether_or_not_the_rest_of_the_body_is_utf8() {
        let text = r#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}},"x":"é"}"#.as_bytes();
        let mut bytes = br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}},"x":""#.to_vec();
        bytes.extend_from_slice(b"\xff\"}");
        for body in [text, &bytes[..]] {
            let t = tap(Dialect::Chat, false, &[body]);
            assert_eq!(t.usage(), Some(Usage { prompt_tokens: 7, cached_tokens: Some(3) }));
        }
    }

    #[test]
    fn a_body_usage_is_its_top_level_key_not_the_word_in_a_string() {
        // The word as a string value, a key ending in an escaped quote, and
        // an escaped key inside a string: none of them is the usage.
        let body = br#"{"choices":[{"message":{"content":"usage","tool_calls":[{"arguments":"{\"usage\":{\"prompt_tokens\":1}}"}]}}],"usage" : {"prompt_tokens":30,"prompt_tokens_details":null},"odd\"usage":{"prompt_tokens":2},"x":"usage"}"#;
        serde_json::from_slice::<serde_json::Value>(body).expect("the test body is valid JSON");
        let whole = tap(Dialect::Chat, false, &[body]);
        assert_eq!(whole.usage(), Some(Usage { prompt_tokens: 30, cached_tokens: None }));
        let (a, b) = body.split_at(100);
        assert_eq!(tap(Dialect::Chat, false, &[a, b]).usage(), whole.usage(), "same in two chunks");
        let mut known = UsageTap::new(Dialect::Chat, false, Some(body.len() as u64));
        known.observe(&Bytes::from_static(body));
        assert_eq!(known.usage(), whole.usage(), "a whole body of the announced length is read as it passes");
        known.finish();
        assert_eq!(known.usage(), whole.usage());
        assert_eq!(tap(Dialect::Chat, false, &[br#"{"usage":null}"#]).usage(), None);
        assert_eq!(tap(Dialect::Chat, false, &[br#"{"choices":[]}"#]).usage(), None);
        let messages = br#"{"content":[],"usage":{"input_tokens":3,"cache_read_input_tokens":9}}"#;
        assert_eq!(
            tap(Dialect::Messages, false, &[messages]).usage(),
            Some(Usage { prompt_tokens: 12, cached_tokens: Some(9) })
        );
    }

    #[test]
    fn finds_usage_in_an_sse_stream_with_lines_split_across_chunks() {
        let t = tap(
            Dialect::Chat,
            true,
            &[
                b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"us",
                b"age\":{\"prompt_tokens\":5}}\n\ndata: [DONE]\n\n",
            ],
        );
        assert_eq!(t.usage(), Some(Usage { prompt_tokens: 5, cached_tokens: None }));
        assert!(t.stream_completed());
        let none = tap(Dialect::Chat, true, &[b"data: {\"choices\":[]}\n\n"]);
        assert_eq!(none.usage(), None);
        assert!(!none.stream_completed(), "no [DONE]: cut");
    }

    #[test]
    fn responses_bodies_and_streams_give_usage_id_and_their_end() {
        let body = br#"{"id":"resp_1","object":"response","usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":64},"output_tokens":5}}"#;
        let t = tap(Dialect::Responses, false, &[body]);
        assert_eq!(t.usage(), Some(Usage { prompt_tokens: 100, cached_tokens: Some(64) }));
        assert_eq!(t.response_id(), Some("resp_1"));
        let stream: &[&[u8]] = &[
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\",\"status\":\"in_progress\"}}\n\n",
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n",
            b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_2\",\"usage\":{\"input_tokens\":7,\"input_tokens_details\":{\"cached_tokens\":0}}}}\n\n",
        ];
        let t = tap(Dialect::Responses, true, stream);
        assert_eq!((t.response_id(), t.usage().map(|u| u.prompt_tokens)), (Some("resp_2"), Some(7)));
        assert!(t.stream_completed());
        assert!(!tap(Dialect::Responses, true, &stream[..2]).stream_completed());
    }

    #[test]
    fn messages_usage_counts_cache_reads_into_the_prompt() {
        let stream: &[&[u8]] = &[
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":90,\"cache_creation_input_tokens\":0,\"output_tokens\":1}}}\n\n",
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"x\"}}\n\n",
            b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":3}}\n\n",
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ];
        let t = tap(Dialect::Messages, true, stream);
        assert_eq!(t.usage(), Some(Usage { prompt_tokens: 100, cached_tokens: Some(90) }));
        assert!(t.stream_completed());
        assert!(!tap(Dialect::Messages, true, &stream[..3]).stream_completed());
        let body = br#"{"type":"message","usage":{"input_tokens":5,"cache_read_input_tokens":20,"output_tokens":2}}"#;
        assert_eq!(
            tap(Dialect::Messages, false, &[body]).usage(),
            Some(Usage { prompt_tokens: 25, cached_tokens: Some(20) })
        );
    }
}
