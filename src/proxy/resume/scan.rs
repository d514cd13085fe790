//! Reading a stream's events without parsing them: the few members the
//! relay needs, found by a substring search (`members`), and the token-id
//! members the gateway asked for, cut out byte for byte (`strip_ids_into`).
//! Parsing each event cost the relay 2.3x a plain stream's CPU per chunk
//! (a `Value`) or 1.9x (a borrowed typed parse); searching with finders
//! built once, 1.35x (bench/stream-cpu.sh, docs/benchmarks-log.md).

use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::Finder;
use smallvec::SmallVec;

pub(super) static EVENT_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));

/// The id members' names, quoted, each searched for with a finder built
/// once (building one per search cost as much as the search).
static TOKEN_IDS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"token_ids\""));
static PROMPT_TOKEN_IDS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"prompt_token_ids\""));
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

/// The `token_ids` members of `data` (events' JSON).
pub(super) fn token_ids(data: &[u8]) -> impl Iterator<Item = Found> + '_ {
    members(data, &TOKEN_IDS)
}

/// The `token_ids` member of one event (`data`) where it is the event's
/// last array, as engines write it (vLLM last in its choice; the
/// simulator's keys sorted, no array after it): found from the end in a
/// few bytes. None otherwise (the caller searches the whole event).
pub(super) fn last_array_token_ids(data: &[u8]) -> Option<Found> {
    const NAME: &[u8] = b"\"token_ids\"";
    let value = memchr::memrchr(b'[', data)?;
    let name = data[..value].trim_ascii_end().strip_suffix(b":")?.trim_ascii_end();
    let at = name.len().checked_sub(NAME.len())?;
    let before = name[..at].trim_ascii_end().last()?;
    let named = &name[at..] == NAME && matches!(before, b'{' | b',');
    // An array of numbers: it ends at its first `]`.
    let end = value + memchr::memchr(b']', &data[value..])? + 1;
    named.then_some(Found { at, value, end })
}

/// Every member named by `finder` in `data`.
fn members<'a>(data: &'a [u8], finder: &'a Finder<'static>) -> impl Iterator<Item = Found> + 'a {
    let len = finder.needle().len();
    finder.find_iter(data).filter_map(move |at| member_at(data, at, len))
}

/// The `prompt_token_ids` member of one event (`data`), if it has one: an
/// array of numbers, so it ends at its first `]` (found with memchr: a
/// long prompt's ids are most of the event, and a value walked byte by
/// byte cost more than the rest of the event).
pub(super) fn prompt_token_ids(data: &[u8]) -> Option<Found> {
    let len = PROMPT_TOKEN_IDS.needle().len();
    PROMPT_TOKEN_IDS.find_iter(data).find_map(|at| {
        let before = data[..at].iter().rposition(|b| !b.is_ascii_whitespace())?;
        let colon = skip_ws(data, at + len);
        let named = matches!(data[before], b'{' | b',') && data.get(colon) == Some(&b':');
        let value = skip_ws(data, colon + 1);
        let end = match data.get(value) {
            Some(b'[') => value + memchr::memchr(b']', &data[value..])? + 1,
            _ => value_end(data, value),
        };
        named.then_some(Found { at, value, end })
    })
}

/// The ids in a JSON array of numbers.
pub(super) fn ids_in(list: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        while list.get(i).is_some_and(|b| !b.is_ascii_digit()) {
            i += 1;
        }
        let mut id: Option<u32> = None;
        while let Some(d) = list.get(i).filter(|b| b.is_ascii_digit()) {
            id = Some(id.unwrap_or(0).wrapping_mul(10).wrapping_add(u32::from(d - b'0')));
            i += 1;
        }
        id
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
    fn token_ids_members_are_found_and_never_in_text() {
        let data = br#"{"token_ids":[4],"text":"\"token_ids\":[9]", "choices":[{"token_ids" : [1, 22,333]}],"x":"\"token_ids\""}"#;
        let found: Vec<&[u8]> = token_ids(data).map(|f| &data[f.value..f.end]).collect();
        assert_eq!(found, [&b"[4]"[..], &b"[1, 22,333]"[..]], "the members, not the text");
        assert_eq!(ids_in(found[1]).collect::<Vec<_>>(), [1, 22, 333]);
        assert_eq!(ids_in(b"[]").count(), 0);
        let event = br#"data: {"choices":[{"delta":{"content":"a["},"token_ids":[7]}],"id":"x"}"#;
        let last = last_array_token_ids(event).unwrap();
        assert_eq!(&event[last.value..last.end], b"[7]");
        let cut = |data: &[u8], f: Found| {
            let mut out = BytesMut::new();
            strip_spans_into(data, smallvec::smallvec![(f.at, f.end)], &mut out);
            out
        };
        assert_eq!(&cut(event, last)[..], br#"data: {"choices":[{"delta":{"content":"a["}}],"id":"x"}"#);
        let first = br#"{ "token_ids" : [1] , "x":1}"#;
        assert_eq!(&cut(first, last_array_token_ids(first).unwrap())[..], br#"{ "x":1}"#);
        assert_eq!(last_array_token_ids(br#"{"token_ids":[1],"x":["a"]}"#), None, "another array after it");
        assert_eq!(last_array_token_ids(br#"{"text":"\"token_ids\":[9]"}"#), None, "text that says it");
        assert_eq!(token_ids(br#"{"text":"\"token_ids\":[9]"}"#).count(), 0);
    }
}
