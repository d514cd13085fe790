//! Reading a stream's events without parsing them: the few members the
//! relay needs, found by a substring search (`members`), and the token-id
//! members the gateway asked for, cut out byte for byte (`strip_ids_into`).
//! Parsing each event cost the relay 2.3x a plain stream's CPU per chunk
//! (a `Value`) or 1.9x (a borrowed typed parse); searching with finders
//! built once, 1.35x (bench/stream-cpu.sh, docs/benchmarks.md).

use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::{Finder, FinderRev};
use smallvec::SmallVec;

pub(super) static EVENT_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));

/// The id members' names, quoted, each searched for with a finder built
/// once (building one per search cost as much as the search).
static TOKEN_IDS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"token_ids\""));
static PROMPT_TOKEN_IDS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"prompt_token_ids\""));
/// Engines write a chunk's `token_ids` last in its choice, near the end
/// of the event: searched for from the end (from the start, and with the
/// event's other members searched too, the relay cost 1.36x a plain
/// stream's CPU per chunk: bench/stream-cpu.sh).
static TOKEN_IDS_FROM_END: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(b"\"token_ids\""));

/// A member found: where its name starts, where its value starts and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Found {
    pub at: usize,
    pub value: usize,
    pub end: usize,
}

/// The member whose name (quoted) starts at `at` and is `len` bytes long,
/// if it is one. Found by a substring search, not a parse: in valid JSON a
/// quote inside a string is escaped, so a `"name"` after `{` or `,` and
/// before `:` is a member's name, and never text that says it.
fn member_at(data: &[u8], at: usize, len: usize) -> Option<Found> {
    let before = data[..at].iter().rposition(|b| !b.is_ascii_whitespace())?;
    let colon = skip_ws(data, at + len);
    let named = matches!(data[before], b'{' | b',') && data.get(colon) == Some(&b':');
    let value = skip_ws(data, colon + 1);
    named.then(|| Found { at, value, end: value_end(data, value) })
}

/// The last `token_ids` member of `data` (one event's JSON).
pub(super) fn token_ids(data: &[u8]) -> Option<Found> {
    let len = TOKEN_IDS_FROM_END.needle().len();
    TOKEN_IDS_FROM_END.rfind_iter(data).find_map(|at| member_at(data, at, len))
}

/// Every member named by `finder` in `data`.
fn members<'a>(data: &'a [u8], finder: &'a Finder<'static>) -> impl Iterator<Item = Found> + 'a {
    let len = finder.needle().len();
    finder.find_iter(data).filter_map(move |at| member_at(data, at, len))
}

/// The ids in a JSON array of numbers.
pub(super) fn ids_in(list: &[u8]) -> impl Iterator<Item = u32> + '_ {
    list.split(|b| matches!(b, b',' | b'[' | b']')).filter_map(|n| {
        let n = n.trim_ascii();
        let digits = !n.is_empty() && n.iter().all(u8::is_ascii_digit);
        digits.then(|| n.iter().fold(0u32, |v, d| v.wrapping_mul(10).wrapping_add(u32::from(d - b'0'))))
    })
}

#[cfg(test)]
pub(super) fn strip_ids(data: &str) -> String {
    let mut out = BytesMut::with_capacity(data.len());
    strip_ids_into(data.as_bytes(), &mut out);
    String::from_utf8(out.to_vec()).expect("cut at ASCII")
}

/// `data` (one event's JSON) without the token-id members the gateway
/// asked for (`prompt_token_ids`, `token_ids`): the rest byte for byte, to
/// `out`.
pub(super) fn strip_ids_into(data: &[u8], out: &mut BytesMut) {
    let mut spans: SmallVec<[(usize, usize); 2]> =
        members(data, &TOKEN_IDS).chain(members(data, &PROMPT_TOKEN_IDS)).map(|f| (f.at, f.end)).collect();
    spans.sort_unstable();
    strip_spans_into(data, spans, out);
}

/// `data` without the members at `spans` (start, end; in order), each
/// with one comma, to `out`.
pub(super) fn strip_spans_into(data: &[u8], spans: SmallVec<[(usize, usize); 2]>, out: &mut BytesMut) {
    let mut last = 0;
    for (at, end) in spans {
        // The member and one comma: the one before it, else the one after.
        let before = data[last..at].trim_ascii_end();
        match before.strip_suffix(b",") {
            Some(kept) => {
                out.extend_from_slice(kept);
                last = end;
            }
            None => {
                out.extend_from_slice(&data[last..at]);
                let after = skip_ws(data, end);
                last = if data.get(after) == Some(&b',') { skip_ws(data, after + 1) } else { end };
            }
        }
    }
    out.extend_from_slice(&data[last..]);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_token_ids_member_is_found_from_the_end_and_never_in_text() {
        let data = br#"{"token_ids":[4],"text":"\"token_ids\":[9]", "choices":[{"token_ids" : [1, 22,333]}],"x":"\"token_ids\""}"#;
        let found = token_ids(data).unwrap();
        assert_eq!(&data[found.value..found.end], b"[1, 22,333]");
        assert_eq!(ids_in(&data[found.value..found.end]).collect::<Vec<_>>(), [1, 22, 333]);
        assert_eq!(ids_in(b"[]").count(), 0);
        assert_eq!(token_ids(br#"{"text":"\"token_ids\":[9]"}"#), None);
    }
}
