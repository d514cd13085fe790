//! The hash chain at message (or block) boundaries, and what every dialect
//! (one file each beside this one) shares: the request shape, the chain, the
//! canonical hashing of units, and body parsing.
//!
//! Why a chain and not "the first N KiB": a fixed window silently never pins
//! when the shared prefix is shorter than the window (the varying tail falls
//! inside it and every turn hashes differently). With a chain, boundary `i`
//! of turn 2 equals the last boundary of turn 1 whenever turn 2 extends it,
//! however short turn 1 was.
//!
//! The hash is XXH3-128 (xxhash-rust), a published, stable algorithm: keys
//! are persisted, so they must not change between builds or platforms
//! (std's `DefaultHasher` gives no such promise).
//!
//! Chain definition (stable; changing it orphans every persisted pin):
//! - `h0 = xxh3_128("prefixgate/v1\0" ++ field(model))`
//! - `h_i = xxh3_128(h_{i-1} as 16 LE bytes ++ canonical(unit_i))`
//! - chat: a unit is one message; canonical = tagged, length-prefixed role,
//!   name, content (text, or parts as canonical JSON with sorted keys),
//!   tool_calls (canonical JSON) and tool_call_id. JSON formatting, key order
//!   and string escapes do not matter.
//! - completions with a string prompt: a unit is a block of `block_bytes`
//!   bytes of the decoded prompt; the trailing partial block is a unit too.
//! - completions with a token-array prompt: a unit is a block of
//!   `block_tokens` token ids (u32 LE).
//! - Responses and Messages: see `responses.rs` and `messages.rs`.
//!
//! Beside each message's key, its *lead*: the chain before it, its role and
//! how it begins (the first line of its text, up to 32 bytes; or its whole
//! first content part when that is not text, a tool result). A served
//! request marks its last message's lead; a later request whose message
//! begins the same way after the same prefix, and goes on past it,
//! continues that conversation: an agent appended a reminder to its latest
//! message and strips it when it sends the next turn (`policy::continues`).
//! A lead is not part of the chain (no key above depends on it): changing
//! how leads are made loses only lead marks, which expire in 15 minutes.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use xxhash_rust::xxh3::Xxh3;

pub(super) use super::json::{canonical, field, Json};

/// A 128-bit key naming one prompt prefix (model included).
pub type PrefixKey = u128;

/// Block sizes for prompts that have no message boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct IdentityBlocks {
    /// Bytes per identity block of a `/v1/completions` string prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    #[schema(minimum = 1, maximum = 1073741824)]
    pub block_bytes: usize,
    /// Token ids per identity block of a `/v1/completions` token-array prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    #[schema(minimum = 1, maximum = 1073741824)]
    pub block_tokens: usize,
}

impl Default for IdentityBlocks {
    fn default() -> Self {
        IdentityBlocks { block_bytes: 1024, block_tokens: 256 }
    }
}

/// One point in the prompt where a prefix ends and could be cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    pub key: PrefixKey,
    /// Prompt content bytes up to and including this unit (for token estimates).
    pub bytes: usize,
}

/// The API a request speaks: it decides the identity rules, how usage and
/// the end of a stream are read, and the shape of error bodies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// OpenAI `/v1/chat/completions`.
    #[default]
    Chat,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI Responses, `/v1/responses` (Codex-style agents).
    Responses,
    /// Anthropic Messages, `/v1/messages` (Claude-Code-style agents).
    Messages,
    /// Anything else under `/v1`.
    Other,
}

impl Dialect {
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Chat => "chat",
            Dialect::Completions => "completions",
            Dialect::Responses => "responses",
            Dialect::Messages => "messages",
            Dialect::Other => "other",
        }
    }
}

/// What the router needs to know about a request, and nothing more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestShape {
    pub dialect: Dialect,
    pub model: Option<String>,
    /// Boundaries in prompt order; empty when the request has no prompt identity.
    pub boundaries: Vec<Boundary>,
    /// Each boundary's message lead (see the header), beside it; empty
    /// where units are not messages (completions' blocks).
    pub leads: Vec<Option<Boundary>>,
    /// True when the request carries history (more than one message, or more
    /// than one block): only such requests may be continuations.
    pub multi_unit: bool,
    /// Where a served request records its pin (None: never pinned).
    pub pin_at: Option<PrefixKey>,
    /// Prompt content bytes (for the token estimate).
    pub prompt_bytes: usize,
    /// The client's own name for the conversation: `prompt_cache_key`.
    pub cache_key: Option<String>,
    /// Responses API: the stored response this request continues.
    pub previous_response: Option<String>,
    /// Responses API: the replica will store the response (`store`, true
    /// unless the client says false).
    pub stores_response: bool,
    /// The client asked for a stream (one that may be continued elsewhere
    /// should its replica fail, `proxy::resume`).
    pub streamed: bool,
    /// What it asks that decides whether its stream may be continued.
    pub stream: super::stream::StreamAsks,
}

impl RequestShape {
    /// The index of the request's own last boundary, where its pin goes
    /// (the last one; a completion's last full block): how far it goes, for
    /// `policy::continues`, and where the boundaries it passes end.
    pub fn pin_index(&self) -> Option<usize> {
        self.boundaries.iter().rposition(|b| Some(b.key) == self.pin_at)
    }

    /// The boundaries it passes on the way to its own pin, as keys and
    /// estimated tokens (its marks, `PinTable::passed_marks`): none when
    /// it has no pin.
    ///
    /// Then its last message's lead, marked as a boundary it ended at
    /// (`went_on` 0): the next turn finds the conversation there when the
    /// agent stripped what it appended to that message.
    pub fn passed(&self) -> Vec<Passed> {
        let Some(upto) = self.pin_index() else { return Vec::new() };
        let tokens = |b: &Boundary| crate::tokens::estimate_tokens(b.bytes);
        let marks = self.boundaries[..upto].iter().enumerate();
        let mut passed: Vec<Passed> =
            marks.map(|(i, b)| Passed { key: b.key, tokens: tokens(b), went_on: (upto - i) as u32 }).collect();
        // A first turn of one message too: an agent without a system
        // prompt appends its reminder to it.
        if let Some(Some(lead)) = self.leads.get(upto) {
            passed.push(Passed { key: lead.key, tokens: tokens(lead), went_on: 0 });
        }
        passed
    }
}

/// A boundary a request passed on its way to its own pin, or its last
/// message's lead: a mark to write (`PinTable::passed_marks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passed {
    pub key: PrefixKey,
    /// Estimated prompt tokens up to it.
    pub tokens: u64,
    /// How many boundaries the request went on past it (0: a lead).
    pub went_on: u32,
}

/// Input the router cannot route; becomes a 400 with this message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses a request body. JSON text is UTF-8 (RFC 8259), so the body is
/// checked once as a whole and parsed as text: parsing bytes would check
/// every string again on its own, a dozen calls on a short chat request.
pub(super) fn parse_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ShapeError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ShapeError(format!("invalid JSON body: not UTF-8 at byte {}", e.valid_up_to())))?;
    serde_json::from_str(text).map_err(|e| ShapeError(format!("invalid JSON body: {e}")))
}

/// The running hash chain. One hasher serves every unit of a request (reset
/// between units): a fresh XXH3 state is ~600 bytes to set up and move.
pub(super) struct Chain {
    prev: PrefixKey,
    h: Xxh3,
}

impl Chain {
    /// The chain's first link: the model, then what the engine caches ahead
    /// of the first message: vLLM's `cache_salt` (requests with different
    /// salts never share cache), and a dialect's instructions, system prompt
    /// and tools (tagged values). With none of these it is exactly the
    /// original `h0 = xxh3(tag ++ field(model))`, so persisted keys hold.
    pub(super) fn first_link(model: Option<&str>, salt: Option<&str>, extra: &[(u8, &Json, &[&str])]) -> Chain {
        let mut h = Xxh3::new();
        h.update(b"prefixgate/v1\0");
        field(&mut h, b'm', model.unwrap_or("").as_bytes());
        if let Some(salt) = salt {
            field(&mut h, b'z', salt.as_bytes());
        }
        for (tag, v, skip) in extra {
            h.update(&[*tag]);
            canonical(&mut h, v, skip);
        }
        Chain { prev: h.digest128(), h }
    }

    /// The first link's boundary, where a dialect's instructions, system
    /// prompt or tools make one (`extra` not empty): the prompt every
    /// conversation after the same system prompt and tools shares, which
    /// a chat request's leading system message is too.
    pub(super) fn first_boundary(&self, extra: &[(u8, &Json, &[&str])], bytes: usize) -> Option<Boundary> {
        (!extra.is_empty()).then_some(Boundary { key: self.prev, bytes })
    }

    /// Starts the next unit: the hasher, seeded with the chain so far.
    pub(super) fn unit(&mut self) -> &mut Xxh3 {
        self.h.reset();
        self.h.update(&self.prev.to_le_bytes());
        &mut self.h
    }

    /// Ends the unit `unit` started: its key, which the next unit extends.
    pub(super) fn close(&mut self) -> PrefixKey {
        self.prev = self.h.digest128();
        self.prev
    }

    /// The next unit's lead (call before `unit`): the chain so far, the
    /// unit's role and how its content begins (`Opening`), with the prompt
    /// bytes up to there (`bytes`: the chain's, then the lead's own).
    /// `skip`: the keys the unit's own hash leaves out (`message_unit`).
    pub(super) fn lead(&mut self, role: &str, content: Option<&Json>, skip: &[&str], bytes: usize) -> Option<Boundary> {
        let opening = Opening::of(content?)?;
        // The chain's own hasher: `unit` resets it for the unit after.
        let h = &mut self.h;
        h.reset();
        h.update(b"prefixgate/lead\0");
        h.update(&self.prev.to_le_bytes());
        field(h, b'r', role.as_bytes());
        let seen = match opening {
            Opening::Line(line) => {
                field(h, b'l', line.as_bytes());
                line.len()
            }
            Opening::Part(part) => {
                h.update(b"p");
                canonical(h, part, skip)
            }
        };
        Some(Boundary { key: h.digest128(), bytes: bytes + role.len() + seen })
    }
}

/// How a message begins, for its lead: its text's first line (a string, or
/// a first part with text), else its whole first part (a tool result, an image).
enum Opening<'j> {
    Line(&'j str),
    Part(&'j Json<'j>),
}

impl<'j> Opening<'j> {
    fn of(content: &'j Json<'j>) -> Option<Opening<'j>> {
        match content {
            Json::String(s) => first_line(s).map(Opening::Line),
            Json::Array(parts) => {
                let part = parts.first().filter(|p| p.is_object())?;
                match part.get("text").and_then(Json::as_str) {
                    Some(text) => first_line(text).map(Opening::Line),
                    None => Some(Opening::Part(part)),
                }
            }
            _ => None,
        }
    }
}

/// How many bytes of a unit's first line its lead reads. Short, because a
/// message that lost its tail may have lost it before its first line ends:
/// an agent cutting an old message, or a replay keeping a share of every
/// text, so the bare message is a prefix of the one the reminder followed.
/// The chain before it already names the conversation; the opening only
/// tells this message from the next one there.
const LEAD_BYTES: usize = 32;

/// A text's first line, at most `LEAD_BYTES` (None when it is empty).
fn first_line(text: &str) -> Option<&str> {
    let mut end = text.len().min(LEAD_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let line = text[..end].split('\n').next().unwrap_or("");
    Some(line).filter(|l| !l.is_empty())
}

/// Hashes one message-like unit: role, then content (a string is the same
/// content as one text part would be for the engine, but clients resend
/// what they sent, so the two forms are kept apart rather than guessed at).
/// Returns the unit's content bytes and its lead (`bytes`: the prompt's
/// before it); `chain.close()` then gives its key.
pub(super) fn message_unit(
    chain: &mut Chain,
    role: &str,
    content: Option<&Json>,
    skip: &[&str],
    bytes: usize,
) -> (usize, Option<Boundary>) {
    let lead = chain.lead(role, content, skip, bytes);
    let h = chain.unit();
    field(h, b'r', role.as_bytes());
    let mut unit = role.len();
    if let Some(c) = content {
        h.update(b"c");
        unit += canonical(h, c, skip);
    }
    (unit, lead)
}

pub(super) fn shape(
    dialect: Dialect,
    model: Option<Cow<str>>,
    boundaries: Vec<Boundary>,
    prompt_bytes: usize,
    cache_key: Option<Cow<str>>,
    previous_response: Option<Cow<str>>,
) -> RequestShape {
    RequestShape {
        dialect,
        model: model.map(Cow::into_owned),
        pin_at: boundaries.last().map(|b| b.key),
        multi_unit: boundaries.len() > 1,
        boundaries,
        leads: Vec::new(),
        prompt_bytes,
        cache_key: cache_key.map(Cow::into_owned),
        previous_response: previous_response.map(Cow::into_owned),
        stores_response: false,
        streamed: false,
        stream: Default::default(),
    }
}

/// The tagged first-link values a request carries (absent ones are left out,
/// so a request without them keeps the plain first link).
pub(super) fn present<'v, 'a>(
    fields: &[(u8, &'v Option<Json<'a>>)],
    skip: &'static [&'static str],
) -> Vec<(u8, &'v Json<'a>, &'static [&'static str])> {
    fields.iter().filter_map(|(tag, v)| v.as_ref().map(|v| (*tag, v, skip))).collect()
}
