//! The engine's own count of a session turn's prompt, before the turn runs
//! (`POST /tokenize`, as vLLM serves it: the chat template rendered as the
//! request will be, then tokenized).
//!
//! Why: the hold and the pauses reckon each session's context against a
//! pool of tokens, and the gateway has no tokenizer. Its estimates (bytes
//! over a ratio learned from usage reports) ran 3-11 % under vLLM's count
//! in a cold fleet's first seconds (an instance that has had no report yet
//! reckons 4 bytes a token; after that the ratio lags contexts that grow
//! denser), and a round that crossed a 3,072-token pool by 43 tokens went
//! by the estimates (docs/benchmarks-log.md, three instances on real vLLM). A
//! tokenize is milliseconds; a prefill is seconds, and a thrash many.
//!
//! Asked only where it matters: a turn of a session, the hold on, bound for
//! a replica whose KV is a pool of tokens (slots are counted whole). An
//! engine without the endpoint (404, 405, 501, or an answer that is not a
//! count) is not asked again; one that fails otherwise or takes longer than
//! `COUNT_TIMEOUT` is not asked for `COUNT_BACKOFF` (a busy API server, or a
//! prompt too large to count in time, costs a turn at most once in that
//! while). Either way the turn goes on with its estimate.

use std::time::Duration;

use actix_web::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::attempt::Upstream;
use crate::fleet::Replica;
use crate::policy::{Dialect, PrefixKey};
use crate::sessions::{Room, SessionConfig};

/// How long a count may take before the turn goes on with its estimate.
pub const COUNT_TIMEOUT: Duration = Duration::from_millis(250);

/// How long a replica is not asked after a count failed or timed out.
pub const COUNT_BACKOFF: Duration = Duration::from_secs(10);

/// What of a chat request decides its rendered prompt: the fields vLLM's
/// tokenize request reads (the rest, such as `stream` or `max_tokens`,
/// would be logged by vLLM as ignored on every call).
#[derive(Deserialize, Serialize)]
struct ChatToCount<'a> {
    #[serde(borrow, skip_serializing_if = "Option::is_none")]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: &'a RawValue,
    #[serde(borrow, skip_serializing_if = "Option::is_none")]
    tools: Option<&'a RawValue>,
    #[serde(borrow, skip_serializing_if = "Option::is_none")]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    add_generation_prompt: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    continue_final_message: Option<bool>,
}

#[derive(Deserialize, Serialize)]
struct CompletionToCount<'a> {
    #[serde(borrow, skip_serializing_if = "Option::is_none")]
    model: Option<&'a RawValue>,
    prompt: &'a str,
}

/// The tokenize request for a request `body` of `dialect`; None where the
/// engine's tokenize takes no such shape (Responses, Messages, a prompt of
/// token ids or several prompts).
pub fn tokenize_body(dialect: Dialect, body: &[u8]) -> Option<Vec<u8>> {
    match dialect {
        Dialect::Chat => serde_json::to_vec(&serde_json::from_slice::<ChatToCount>(body).ok()?).ok(),
        Dialect::Completions => serde_json::to_vec(&serde_json::from_slice::<CompletionToCount>(body).ok()?).ok(),
        _ => None,
    }
}

#[derive(Deserialize)]
struct Counted {
    count: u64,
}

/// A count is asked only where the replica's load with this turn, at its
/// estimate, plus this share of it (numerator, denominator) reaches the
/// pool: estimates ran up to 11 % short on real vLLM before any receipt had
/// calibrated them (3 % after). Further below the pool no pause or hold
/// turns on the difference, and asking would only cost the turn a round
/// trip that waits behind the engine's work (~11 ms idle on real vLLM, more
/// while it prefills: the hold cost 6-7 % below the wall with every turn
/// counted).
pub const ESTIMATE_MARGIN: (u64, u64) = (1, 8);

/// True where the count of session `session`'s turn (`tokens` at its
/// estimate) is worth asking for: counting is on (`sessions.count_tokens`)
/// with the hold on, the replica's KV is a pool of tokens, its engine
/// neither refused nor failed lately, and its load with this turn (`room`:
/// its room now, the session counted at its last turn) is near the pool
/// (`ESTIMATE_MARGIN`), where the count could change a decision.
pub fn worth_asking(
    sessions: &SessionConfig,
    replica: &Replica,
    session: PrefixKey,
    tokens: u64,
    room: impl FnOnce() -> Room,
) -> bool {
    let near_the_pool = || {
        let room = room();
        let before = replica.residents.get(session).map_or(0, |r| room.footprint(r.counted_tokens()));
        let load = room.taken.saturating_sub(before).saturating_add(tokens);
        let (num, den) = ESTIMATE_MARGIN;
        room.capacity.is_some_and(|pool| load.saturating_add(load * num / den) >= pool)
    };
    sessions.count_tokens
        && sessions.max_wait_ms > 0
        && replica.slot_tokens().is_none()
        && replica.kv_capacity().is_some()
        && replica.calibration.engine_counts(crate::clock::now_ms())
        && near_the_pool()
}

/// How an engine answered a count.
enum Answer {
    Count(u64),
    /// No such endpoint (404, 405, 501), or a success that is not a count.
    Refused,
    /// Anything else: an error, a timeout, a request it would not count.
    Failed,
}

/// Asks `replica`'s engine to count the prompt of `body`, within
/// `COUNT_TIMEOUT` all told; None: it did not (the turn goes on with its
/// estimate). A count also calibrates the replica's estimates at once
/// (`prompt_bytes` of prompt text).
pub async fn engine_count(
    upstream: &Upstream,
    replica: &Replica,
    caller: super::headers::Caller<'_>,
    shape: &crate::policy::RequestShape,
    body: &[u8],
) -> Option<u64> {
    let (dialect, prompt_bytes) = (shape.dialect, shape.prompt_bytes);
    let tokenize = tokenize_body(dialect, body)?;
    let request = upstream.post_json(&replica.spec(), caller, "/tokenize");
    let ask = async {
        let Ok(mut resp) = request.send_body(tokenize).await else { return Answer::Failed };
        let status = resp.status();
        let no_endpoint = [StatusCode::NOT_FOUND, StatusCode::METHOD_NOT_ALLOWED, StatusCode::NOT_IMPLEMENTED];
        match status {
            s if no_endpoint.contains(&s) => Answer::Refused,
            s if !s.is_success() => Answer::Failed,
            // The body carries every token id: read whole, within the bound.
            _ => match resp.json::<Counted>().limit(64 << 20).await {
                Ok(Counted { count }) if count > 0 => Answer::Count(count),
                _ => Answer::Refused,
            },
        }
    };
    match tokio::time::timeout(COUNT_TIMEOUT, ask).await.unwrap_or(Answer::Failed) {
        Answer::Count(count) => {
            replica.calibration.calibrate(prompt_bytes, count);
            Some(count)
        }
        Answer::Refused => {
            tracing::info!(replica = %replica.id, "the engine counts no prompts (POST /tokenize): estimates only");
            replica.calibration.engine_refused();
            None
        }
        Answer::Failed => {
            replica.calibration.engine_failed(crate::clock::now_ms() + COUNT_BACKOFF.as_millis() as u64);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_is_counted_by_what_renders_its_prompt_and_nothing_else() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":16,
            "tools":[{"type":"function","function":{"name":"f"}}],"temperature":0.2}"#;
        let sent: serde_json::Value = serde_json::from_slice(&tokenize_body(Dialect::Chat, body).unwrap()).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"hi"}],
                "tools":[{"type":"function","function":{"name":"f"}}]})
        );
    }

    #[test]
    fn only_shapes_the_engine_can_count_are_asked() {
        let sent = tokenize_body(Dialect::Completions, br#"{"model":"m","prompt":"once upon","max_tokens":4}"#);
        assert_eq!(sent.as_deref(), Some(&br#"{"model":"m","prompt":"once upon"}"#[..]));
        assert_eq!(tokenize_body(Dialect::Completions, br#"{"prompt":[1,2,3]}"#), None, "token ids");
        assert_eq!(tokenize_body(Dialect::Messages, br#"{"messages":[]}"#), None);
        assert_eq!(tokenize_body(Dialect::Responses, br#"{"input":"x"}"#), None);
        assert_eq!(tokenize_body(Dialect::Chat, b"not json"), None);
    }
}
