//! Reading a stream's events without parsing them: the few members the
//! relay needs, found by a substring search (`members`), and the token-id
//! members the gateway asked for, cut out byte for byte (`strip_ids_into`).
//! Parsing each event cost the relay 2.3x a plain stream's CPU per chunk
//! (a `Value`) or 1.9x (a borrowed typed parse); searching with finders
//! built once, 1.35x (bench/stream-cpu.sh, docs/benchmarks.md).

use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::Finder;

/// The member names the relay looks for, quoted, each searched for with
/// a finder built once (building one per search cost as much as the
/// search: bench/stream-cpu.sh).
pub(super) struct Key(Finder<'static>);

pub(super) static TOKEN_IDS: LazyLock<Key> = LazyLock::new(|| Key::new("token_ids"));
pub(super) static PROMPT_TOKEN_IDS: LazyLock<Key> = LazyLock::new(|| Key::new("prompt_token_ids"));
pub(super) static FINISH_REASON: LazyLock<Key> = LazyLock::new(|| Key::new("finish_reason"));
pub(super) static TOOL_CALLS: LazyLock<Key> = LazyLock::new(|| Key::new("tool_calls"));
pub(super) static REASONING_CONTENT: LazyLock<Key> = LazyLock::new(|| Key::new("reasoning_content"));
pub(super) static REASONING: LazyLock<Key> = LazyLock::new(|| Key::new("reasoning"));
pub(super) static EVENT_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));
/// Both reasoning members' names hold it: one search rules both out.
pub(super) static REASONING_WORD: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"reasoning"));

impl Key {
    fn new(name: &str) -> Key {
        Key(Finder::new(format!("\"{name}\"").as_bytes()).into_owned())
    }
}

#[cfg(test)]
pub(super) fn strip_ids(data: &str) -> String {
    let mut out = BytesMut::with_capacity(data.len());
    strip_ids_into(data, &mut out);
    String::from_utf8(out.to_vec()).expect("cut at ASCII")
}

/// `strip_ids`, written to `out`.
pub(super) fn strip_ids_into(data: &str, out: &mut BytesMut) {
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
pub(super) fn strip_spans_into(data: &str, spans: smallvec::SmallVec<[(usize, usize); 2]>, out: &mut BytesMut) {
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
pub(super) fn members<'a>(bytes: &'a [u8], key: &'a Key) -> impl Iterator<Item = (usize, usize)> + 'a {
    let len = key.0.needle().len();
    key.0.find_iter(bytes).filter_map(move |at| {
        let before = bytes[..at].iter().rposition(|b| !b.is_ascii_whitespace())?;
        let colon = skip_ws(bytes, at + len);
        let named = matches!(bytes[before], b'{' | b',') && bytes.get(colon) == Some(&b':');
        named.then(|| (at, skip_ws(bytes, colon + 1)))
    })
}

/// The value of member `key` (quoted) in `data`, when there and not null.
pub(super) fn member<'a>(data: &'a str, key: &Key) -> Option<&'a str> {
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
pub(super) fn value_end(bytes: &[u8], start: usize) -> usize {
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
