//! Identity for the agent dialects: the OpenAI Responses API (Codex-style
//! agents) and the Anthropic Messages API (Claude-Code-style agents), on the
//! same hash chain as chat (see `identity.rs`).
//!
//! - The first link holds what the engine caches ahead of the first turn:
//!   the model, `cache_salt`, and the dialect's instructions/system prompt
//!   and tools. Two requests that differ there share no prefix.
//! - A unit is one input item (Responses) or one message (Messages).
//!   Message-like units hash their role and content; any other item (a
//!   function call, its output, a reasoning item, an item type invented next
//!   month) hashes as canonical JSON. Nothing is rejected for its type.
//! - Fields a client changes between turns without changing the prompt are
//!   left out: Anthropic's `cache_control` markers (Claude Code moves them to
//!   the newest message every turn, which would otherwise break every match)
//!   and the `id`/`status` the Responses API puts on items it returns (some
//!   clients strip them when they send the items back).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use super::identity::{
    canonical_value_skipping, field, parse_body, Boundary, Chain, Dialect, RequestShape, ShapeError,
};

const RESPONSES_SKIP: &[&str] = &["id", "status"];
const MESSAGES_SKIP: &[&str] = &["cache_control"];

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    instructions: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

/// Hashes one message-like unit: role, then content (a string is the same
/// content as one text part would be for the engine, but clients resend
/// what they sent, so the two forms are kept apart rather than guessed at).
/// Returns the unit's content bytes; `chain.close()` then gives its key.
fn message_unit(chain: &mut Chain, role: &str, content: Option<&Value>, skip: &[&str]) -> usize {
    let h = chain.unit();
    field(h, b'r', role.as_bytes());
    let mut bytes = role.len();
    if let Some(c) = content {
        h.update(b"c");
        bytes += canonical_value_skipping(h, c, skip);
    }
    bytes
}

fn shape(
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
        prompt_bytes,
        cache_key: cache_key.map(Cow::into_owned),
        previous_response: previous_response.map(Cow::into_owned),
    }
}

/// The tagged first-link values a request carries (absent ones are left out,
/// so a request without them keeps the plain first link).
fn present<'v>(
    fields: &[(u8, &'v Option<Value>)],
    skip: &'static [&'static str],
) -> Vec<(u8, &'v Value, &'static [&'static str])> {
    fields.iter().filter_map(|(tag, v)| v.as_ref().map(|v| (*tag, v, skip))).collect()
}

pub(super) fn extract_responses(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let b: ResponsesBody = parse_body(body)?;
    let extra = present(&[(b'i', &b.instructions), (b't', &b.tools)], RESPONSES_SKIP);
    let mut chain = Chain::first_link(b.model.as_deref(), b.cache_salt.as_deref(), &extra);
    let mut boundaries = Vec::new();
    let mut bytes = 0usize;
    let mut push = |chain: &mut Chain, n: usize| {
        bytes += n;
        boundaries.push(Boundary { key: chain.close(), bytes });
    };
    match &b.input {
        // A plain string is one user message.
        Some(Value::String(text)) => {
            let unit = message_unit(&mut chain, "user", Some(&Value::String(text.clone())), RESPONSES_SKIP);
            push(&mut chain, unit);
        }
        Some(Value::Array(items)) => {
            for item in items {
                let message = item
                    .as_object()
                    .filter(|o| o.get("type").is_none_or(|t| t == "message"))
                    .and_then(|o| Some((o.get("role")?.as_str()?, o.get("content"))));
                let unit = match message {
                    Some((role, content)) => message_unit(&mut chain, role, content, RESPONSES_SKIP),
                    None => {
                        let h = chain.unit();
                        h.update(b"j");
                        canonical_value_skipping(h, item, RESPONSES_SKIP)
                    }
                };
                push(&mut chain, unit);
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(ShapeError("'input' must be a string or an array of input items".into())),
    }
    if b.previous_response_id.is_some() {
        // The body carries only the new items; the prefix lives in the stored
        // response. Hashing the new items alone would name a prefix that does
        // not exist (and two conversations that both say "continue" would
        // share it), so such a request has no prompt identity: its stored
        // response routes it.
        boundaries.clear();
    }
    let instructions_bytes = b.instructions.as_ref().and_then(Value::as_str).map_or(0, str::len);
    Ok(shape(
        Dialect::Responses,
        b.model,
        boundaries,
        bytes + instructions_bytes,
        b.prompt_cache_key,
        b.previous_response_id,
    ))
}

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    messages: Vec<Value>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

pub(super) fn extract_messages(body: &[u8]) -> Result<RequestShape, ShapeError> {
    let b: MessagesBody = parse_body(body)?;
    if b.messages.is_empty() {
        return Err(ShapeError("'messages' must contain at least one message".into()));
    }
    let extra = present(&[(b's', &b.system), (b't', &b.tools)], MESSAGES_SKIP);
    let mut chain = Chain::first_link(b.model.as_deref(), b.cache_salt.as_deref(), &extra);
    let mut boundaries = Vec::with_capacity(b.messages.len());
    let mut bytes = b.system.as_ref().and_then(Value::as_str).map_or(0, str::len);
    for m in &b.messages {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ShapeError("every message needs a string 'role'".into()))?;
        bytes += message_unit(&mut chain, role, m.get("content"), MESSAGES_SKIP);
        boundaries.push(Boundary { key: chain.close(), bytes });
    }
    Ok(shape(Dialect::Messages, b.model, boundaries, bytes, None, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::{extract, Endpoint, IdentityBlocks};

    fn responses(body: &str) -> RequestShape {
        extract(Endpoint::Responses, body.as_bytes(), IdentityBlocks::default()).unwrap()
    }

    fn messages(body: &str) -> RequestShape {
        extract(Endpoint::Messages, body.as_bytes(), IdentityBlocks::default()).unwrap()
    }

    #[test]
    fn a_responses_turn_extends_the_previous_one_whatever_the_server_ids() {
        let t1 = responses(r#"{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi"}]}"#);
        let t2 = responses(
            r#"{"model":"m","instructions":"be brief","input":[
                {"type":"message","role":"user","content":"hi"},
                {"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"hello","annotations":[]}]},
                {"type":"function_call","call_id":"c1","name":"ls","arguments":"{}"},
                {"type":"function_call_output","call_id":"c1","output":"a.txt"},
                {"type":"some_item_from_the_future","x":[1,2]}]}"#,
        );
        assert_eq!(t2.boundaries[0].key, t1.pin_at.unwrap());
        assert!(t2.multi_unit && t2.boundaries.len() == 5);
        // Instructions and tools are in the first link: change them, share nothing.
        let other = responses(r#"{"model":"m","instructions":"be verbose","input":[{"role":"user","content":"hi"}]}"#);
        assert_ne!(other.pin_at, t1.pin_at);
        let tools = responses(
            r#"{"model":"m","instructions":"be brief","tools":[{"type":"function","name":"ls"}],"input":[{"role":"user","content":"hi"}]}"#,
        );
        assert_ne!(tools.pin_at, t1.pin_at);
    }

    #[test]
    fn responses_keys_previous_id_and_string_input() {
        let s = responses(r#"{"model":"m","input":"hello","prompt_cache_key":"k1"}"#);
        assert_eq!(s.cache_key.as_deref(), Some("k1"));
        assert_eq!(s.boundaries.len(), 1);
        assert!(!s.multi_unit);
        let follow = responses(
            r#"{"model":"m","input":[{"role":"user","content":"a"},{"role":"user","content":"b"}],"previous_response_id":"resp_9"}"#,
        );
        assert_eq!(follow.previous_response.as_deref(), Some("resp_9"));
        assert_eq!(
            (follow.pin_at, follow.multi_unit),
            (None, false),
            "the prefix is in the stored response, not the body"
        );
        let salted = responses(r#"{"model":"m","input":"hello","cache_salt":"tenant-2"}"#);
        assert_ne!(salted.pin_at, s.pin_at, "different salts never share cache");
        assert!(extract(Endpoint::Responses, br#"{"input":5}"#, IdentityBlocks::default()).is_err());
    }

    #[test]
    fn a_messages_turn_extends_the_previous_one_when_cache_control_moves() {
        let t1 = messages(
            r#"{"model":"c","system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
                "messages":[{"role":"user","content":[{"type":"text","text":"q1","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        let t2 = messages(
            r#"{"model":"c","system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
                "messages":[{"role":"user","content":[{"type":"text","text":"q1"}]},
                {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"tool_use","id":"t1","name":"ls","input":{}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.txt","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        assert_eq!(t2.boundaries[0].key, t1.pin_at.unwrap());
        assert_eq!(t2.dialect, Dialect::Messages);
        let other_system = messages(
            r#"{"model":"c","system":"other","messages":[{"role":"user","content":[{"type":"text","text":"q1"}]}]}"#,
        );
        assert_ne!(other_system.pin_at, t1.pin_at);
        assert!(extract(Endpoint::Messages, br#"{"model":"c","messages":[]}"#, IdentityBlocks::default()).is_err());
        assert!(extract(
            Endpoint::Messages,
            br#"{"model":"c","messages":[{"content":"x"}]}"#,
            IdentityBlocks::default()
        )
        .is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            for e in [Endpoint::Responses, Endpoint::Messages] {
                if let Err(err) = extract(e, &body, IdentityBlocks::default()) {
                    proptest::prop_assert!(!err.0.is_empty());
                }
            }
        }

        #[test]
        fn arbitrary_json_items_never_panic(items in proptest::collection::vec(json_value(), 0..6)) {
            let input = serde_json::to_string(&items).unwrap();
            let _ = extract(Endpoint::Responses, format!(r#"{{"model":"m","input":{input}}}"#).as_bytes(), IdentityBlocks::default());
            let _ = extract(Endpoint::Messages, format!(r#"{{"model":"m","messages":{input}}}"#).as_bytes(), IdentityBlocks::default());
        }
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("(role|content|type|text|[a-z]{1,4})", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
