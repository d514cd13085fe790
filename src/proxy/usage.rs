//! Reads `usage` from a response as it passes, without buffering it and
//! without touching the client's request: a non-streaming JSON body is kept
//! (up to a cap) only to parse its usage at the end; a streaming body is
//! scanned line by line for the chunk that carries usage (present when the
//! client asked for `stream_options.include_usage`).

use bytes::Bytes;
use serde::Deserialize;

/// Largest non-streaming body kept for usage parsing; bigger ones are unmeasured.
const MAX_KEPT: usize = 4 * 1024 * 1024;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WithUsage {
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

pub struct UsageTap {
    sse: bool,
    /// Non-streaming: the body so far. Streaming: the current partial line.
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
}

impl UsageTap {
    pub fn new(sse: bool) -> UsageTap {
        UsageTap { sse, buf: Vec::new(), overflow: false, found: None }
    }

    pub fn observe(&mut self, chunk: &Bytes) {
        if !self.sse {
            if self.buf.len() + chunk.len() > MAX_KEPT {
                self.overflow = true;
                self.buf = Vec::new();
            } else if !self.overflow {
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
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Cheap filter: only chunks that mention usage are parsed.
        if memchr_usage(data) {
            if let Some(u) = parse(data) {
                self.found = Some(u);
            }
        }
    }

    /// The usage seen, if any (call at the end of the body).
    pub fn usage(&self) -> Option<Usage> {
        if self.sse {
            self.found
        } else if self.overflow {
            None
        } else {
            parse(&self.buf)
        }
    }
}

fn memchr_usage(data: &[u8]) -> bool {
    data.windows(7).any(|w| w == b"\"usage\"")
}

fn parse(json: &[u8]) -> Option<Usage> {
    let u = serde_json::from_slice::<WithUsage>(json.trim_ascii()).ok()?.usage?;
    Some(Usage {
        prompt_tokens: u.prompt_tokens?,
        cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_usage_in_a_json_body_split_across_chunks() {
        let mut tap = UsageTap::new(false);
        tap.observe(&Bytes::from_static(br#"{"id":"x","usage":{"prompt_tokens":10,"#));
        tap.observe(&Bytes::from_static(br#""prompt_tokens_details":{"cached_tokens":8}}}"#));
        assert_eq!(tap.usage(), Some(Usage { prompt_tokens: 10, cached_tokens: Some(8) }));
    }

    #[test]
    fn finds_usage_in_an_sse_stream_with_lines_split_across_chunks() {
        let mut tap = UsageTap::new(true);
        tap.observe(&Bytes::from_static(b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"us"));
        tap.observe(&Bytes::from_static(b"age\":{\"prompt_tokens\":5}}\n\ndata: [DONE]\n\n"));
        assert_eq!(tap.usage(), Some(Usage { prompt_tokens: 5, cached_tokens: None }));
        let mut none = UsageTap::new(true);
        none.observe(&Bytes::from_static(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"));
        assert_eq!(none.usage(), None);
    }
}
