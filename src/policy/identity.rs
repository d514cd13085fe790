//! Which dialect a request speaks, and its shape: the one entry point
//! (`extract`) over the dialect files (`chat.rs`, `completions.rs`,
//! `responses.rs`, `messages.rs`), which share the hash chain (`chain.rs`)
//! and know nothing of each other or of this file.

use std::borrow::Cow;

use serde::Deserialize;

use super::chain::parse_body;
pub use super::chain::{Boundary, Dialect, IdentityBlocks, Passed, PrefixKey, RequestShape, ShapeError};

/// Which extraction a path gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
    /// Any other `/v1/*` path: only the model is read, never required.
    Other,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Endpoint {
        let path = path.trim_end_matches('/');
        [Endpoint::Chat, Endpoint::Completions, Endpoint::Responses, Endpoint::Messages]
            .into_iter()
            .find(|e| e.path() == Some(path))
            .unwrap_or(Endpoint::Other)
    }

    /// The path of a known endpoint (None: `Other`, whose path varies).
    pub fn path(self) -> Option<&'static str> {
        match self {
            Endpoint::Chat => Some("/v1/chat/completions"),
            Endpoint::Completions => Some("/v1/completions"),
            Endpoint::Responses => Some("/v1/responses"),
            Endpoint::Messages => Some("/v1/messages"),
            Endpoint::Other => None,
        }
    }

    /// The API a path speaks (the shape of its errors, among other things).
    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Chat => Dialect::Chat,
            Endpoint::Completions => Dialect::Completions,
            Endpoint::Responses => Dialect::Responses,
            Endpoint::Messages => Dialect::Messages,
            Endpoint::Other => Dialect::Other,
        }
    }
}

pub fn extract(endpoint: Endpoint, body: &[u8], blocks: IdentityBlocks) -> Result<RequestShape, ShapeError> {
    match endpoint {
        Endpoint::Chat => super::chat::extract_chat(body),
        Endpoint::Completions => super::completions::extract_completion(body, blocks),
        Endpoint::Responses => super::responses::extract_responses(body),
        Endpoint::Messages => super::messages::extract_messages(body),
        Endpoint::Other => Ok(extract_other(body)),
    }
}

#[derive(Deserialize)]
struct OtherBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

/// Other endpoints (embeddings, audio, ...): the model if the body is a JSON
/// object that names one; the body is forwarded whatever it is.
fn extract_other(body: &[u8]) -> RequestShape {
    let model = parse_body::<OtherBody>(body).ok().and_then(|b| b.model.map(Cow::into_owned));
    RequestShape { dialect: Dialect::Other, model, ..RequestShape::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> RequestShape {
        extract(Endpoint::Chat, body.as_bytes(), IdentityBlocks::default()).unwrap()
    }

    #[test]
    fn formatting_key_order_and_escapes_do_not_change_keys() {
        let a = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi /x"}]}"#);
        let b = chat("{ \"messages\" : [ { \"content\" : \"hi \\/x\" , \"role\" : \"user\" } ], \"model\": \"m\", \"temperature\": 0 }");
        assert_eq!(a.boundaries[0].key, b.boundaries[0].key);
    }

    #[test]
    fn model_role_name_tools_and_parts_change_keys() {
        let base = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).pin_at;
        for other in [
            r#"{"model":"n","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","name":"a","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"tool","tool_call_id":"x","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi","tool_calls":[{"id":"1"}]}]}"#,
        ] {
            assert_ne!(chat(other).pin_at, base, "{other}");
        }
    }

    #[test]
    fn a_chat_turn_extends_the_previous_one_when_cache_control_moves() {
        let t1 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},
                {"role":"user","content":[{"type":"text","text":"q1","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},
                {"role":"user","content":[{"type":"text","text":"q1"}]},
                {"role":"assistant","content":"a1"},
                {"role":"user","content":[{"type":"text","text":"q2","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        assert_eq!(t2.boundaries[1].key, t1.pin_at.unwrap());
        assert_eq!(t2.boundaries[1].bytes, t1.prompt_bytes);
        // A first part that is not text leads alike with or without its marker.
        let image = |marker: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"u"}}{marker}}}]}}]}}"#
            ))
            .leads[0]
            .map(|l| l.key)
        };
        assert!(image("").is_some());
        assert_eq!(image(r#","cache_control":{"type":"ephemeral"}"#), image(""));
    }

    #[test]
    fn a_message_with_a_reminder_appended_leads_like_the_bare_message_and_passes_it_on() {
        let lead = |body: &str, i: usize| chat(body).leads[i].map(|l| l.key);
        let sys = r#"{"role":"system","content":"s"}"#;
        let with_reminder = format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"fix it\n<system-reminder>x</system-reminder>"}}]}}"#
        );
        let bare = format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"fix it"}},{{"role":"assistant","content":"ok"}}]}}"#
        );
        let other = format!(r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"fix that"}}]}}"#);
        assert!(lead(&with_reminder, 1).is_some());
        assert_eq!(lead(&with_reminder, 1), lead(&bare, 1));
        assert_ne!(lead(&with_reminder, 1), lead(&other, 1), "another first line");
        assert_ne!(chat(&with_reminder).boundaries[1].key, chat(&bare).boundaries[1].key);
        // The served request marks its last message's lead as where it ended.
        let served = chat(&with_reminder);
        let passed = served.passed();
        assert_eq!(passed.last().map(|p| (p.key, p.went_on)), Some((served.leads[1].unwrap().key, 0)));
        // A first turn of one message marks its lead too (no system prompt:
        // the reminder is on that one message).
        let single = chat(r#"{"model":"m","messages":[{"role":"user","content":"fix it\n<r>x</r>"}]}"#);
        let later = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"fix it"},{"role":"assistant","content":"ok"}]}"#,
        );
        assert_eq!(
            single.passed().iter().map(|p| (p.key, p.went_on)).collect::<Vec<_>>(),
            [(later.leads[0].unwrap().key, 0)]
        );
        // A message cut short (a replay keeping a share of every text) still
        // leads like the whole one, from its first 32 bytes on.
        let long = "a".repeat(100);
        let cut =
            |n: usize| format!(r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"{}"}}]}}"#, &long[..n]);
        assert_eq!(lead(&cut(40), 1), lead(&cut(100), 1));
        assert_ne!(lead(&cut(20), 1), lead(&cut(100), 1));
        // Parts: a reminder block after a tool result (Messages, as agents send it).
        let blocks = |extra: &str| {
            let body = format!(
                r#"{{"model":"m","max_tokens":1,"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":"out"}}{extra}]}}]}}"#
            );
            extract(Endpoint::Messages, body.as_bytes(), IdentityBlocks::default()).unwrap().leads[0].map(|l| l.key)
        };
        assert!(blocks("").is_some());
        assert_eq!(blocks(r#",{"type":"text","text":"<system-reminder>x</system-reminder>"}"#), blocks(""));
        // An empty first line, or a completion's blocks, lead nowhere.
        assert_eq!(lead(r#"{"model":"m","messages":[{"role":"user","content":"\nx"}]}"#, 0), None);
        let completion = extract(Endpoint::Completions, br#"{"model":"m","prompt":"abc"}"#, IdentityBlocks::default());
        assert!(completion.unwrap().leads.is_empty());
    }

    #[test]
    fn a_longer_conversation_shares_every_earlier_boundary() {
        let t1 = chat(r#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#);
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}"#,
        );
        assert!(!t1.multi_unit);
        assert!(t2.multi_unit);
        assert_eq!(t2.boundaries[0].key, t1.pin_at.unwrap());
        assert_eq!(t2.pin_at, Some(t2.boundaries[2].key));
    }

    #[test]
    fn string_prompts_use_byte_blocks_and_pin_at_the_last_full_block() {
        let blocks = IdentityBlocks { block_bytes: 4, block_tokens: 2 };
        let s = extract(Endpoint::Completions, br#"{"model":"m","prompt":"abcdefghij"}"#, blocks).unwrap();
        assert_eq!(s.boundaries.len(), 3);
        assert_eq!(s.pin_at, Some(s.boundaries[1].key));
        let longer = extract(Endpoint::Completions, br#"{"model":"m","prompt":"abcdefghijklmnop"}"#, blocks).unwrap();
        assert_eq!(longer.boundaries[1].key, s.pin_at.unwrap());
        let tokens = extract(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3,4,5]}"#, blocks).unwrap();
        assert_eq!(tokens.boundaries.len(), 3);
        let batch = extract(Endpoint::Completions, br#"{"model":"m","prompt":["a","b"]}"#, blocks).unwrap();
        assert!(batch.boundaries.is_empty() && batch.pin_at.is_none());
    }

    #[test]
    fn unroutable_bodies_are_errors_not_panics() {
        for bad in [
            "",
            "not json",
            "[]",
            r#"{"model":"m"}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":"hi"}"#,
            r#"{"model":"m","messages":[{"content":"no role"}]}"#,
            r#"{"model":1,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
        ] {
            assert!(extract(Endpoint::Chat, bad.as_bytes(), IdentityBlocks::default()).is_err(), "{bad}");
        }
        assert!(extract(Endpoint::Completions, br#"{"prompt":[-1]}"#, IdentityBlocks::default()).is_err());
        assert_eq!(extract(Endpoint::Other, b"\xff\xfe", IdentityBlocks::default()).unwrap().model, None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Arbitrary bytes never panic; they route or they are a clear error.
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            for e in [Endpoint::Chat, Endpoint::Completions, Endpoint::Other] {
                if let Err(err) = extract(e, &body, IdentityBlocks::default()) {
                    proptest::prop_assert!(!err.0.is_empty());
                }
            }
        }

        /// Structurally plausible JSON with wrong types in every field.
        #[test]
        fn wrong_types_are_clear_errors_and_right_types_route(
            model in r#"(null|1|"m"|\[\]|\{\})"#,
            messages in r#"(null|1|"x"|\[\]|\[1\]|\[\{\}\]|\[\{"role":1\}\]|\[\{"role":"user","content":\{"a":\[1,null\]\}\}\])"#,
            prompt in r#"(null|1|"x"|\[\]|\[-1\]|\[1\.5\]|\[\[1\],"a"\]|\[4294967296\])"#,
        ) {
            // A body routes only when every field has a type the API allows:
            // model a string or absent, messages a list of role-bearing
            // messages, prompt text, token ids (u32) or a batch of them.
            let model_ok = model == "null" || model == r#""m""#;
            let chat = format!(r#"{{"model":{model},"messages":{messages}}}"#);
            let routed = extract(Endpoint::Chat, chat.as_bytes(), IdentityBlocks::default());
            let chat_ok = model_ok && messages.starts_with(r#"[{"role":"user""#);
            proptest::prop_assert_eq!(routed.is_ok(), chat_ok, "{}", chat);
            if let Err(e) = routed {
                proptest::prop_assert!(!e.0.is_empty());
            }
            let completion = format!(r#"{{"model":{model},"prompt":{prompt}}}"#);
            let routed = extract(Endpoint::Completions, completion.as_bytes(), IdentityBlocks::default());
            let prompt_ok = model_ok && matches!(prompt.as_str(), r#""x""# | "[]" | r#"[[1],"a"]"#);
            proptest::prop_assert_eq!(routed.is_ok(), prompt_ok, "{}", completion);
            if let Err(e) = routed {
                proptest::prop_assert!(!e.0.is_empty());
            }
        }
    }

    #[test]
    fn deep_nesting_huge_strings_and_invalid_utf8_are_handled() {
        // serde_json's recursion limit turns deep nesting into an error, not a stack overflow.
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":{}{}}}]}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(extract(Endpoint::Chat, deep.as_bytes(), IdentityBlocks::default()).is_err());
        let huge = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(8 << 20));
        assert_eq!(
            extract(Endpoint::Chat, huge.as_bytes(), IdentityBlocks::default()).unwrap().prompt_bytes,
            (8 << 20) + 4
        );
        let mut bad = br#"{"model":"m","messages":[{"role":"user","content":"#.to_vec();
        bad.extend_from_slice(b"\"\xff\xfe\"}]}");
        assert!(extract(Endpoint::Chat, &bad, IdentityBlocks::default()).is_err());
        // Also where the router would not read the string: JSON is UTF-8 text.
        let ignored = b"{\"user\":\"\xff\",\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
        let e = extract(Endpoint::Chat, ignored, IdentityBlocks::default()).unwrap_err();
        assert_eq!(e.0, "invalid JSON body: not UTF-8 at byte 9");
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // Persisted pins depend on this exact value: if it changes, every
        // stored pin is orphaned. Change it only with a migration.
        let s = chat(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#);
        assert_eq!(format!("{:032x}", s.pin_at.unwrap()), STABLE_KEY);
    }
    const STABLE_KEY: &str = "ab6ee19cb77686fdb420cb8f5ace4e0e";

    #[test]
    fn every_units_key_is_stable_across_builds_in_every_dialect() {
        // Values computed by 73d4aa3 (a fresh hash state per unit); the
        // chain now reuses one state and must give the same keys.
        let cases: [(Endpoint, &str, [&str; 4]); 3] = [
            (
                Endpoint::Chat,
                r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}]}"#,
                [
                    "2272f0a05efceafce5443bab64986d2c",
                    "cd3617a70e34243e6a092c3851924607",
                    "c7bfb119ffeb2358cca0afcff54d95d8",
                    "40e6c73da13e7cd94efe36cc9d8083c6",
                ],
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","system":"sys","max_tokens":5,"messages":[{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"text","text":"b"}]},{"role":"user","content":"c"}]}"#,
                [
                    // The system prompt's own boundary (the first link), then the messages'.
                    "775917d55711304d4eda9dcf53b6f241",
                    "a769634069eaf8863b299dfd0f1e4f9a",
                    "1380f76c17cf2ec57d5fce46828c9350",
                    "159c2f3a928a7b4d6396eb15dbf0710c",
                ],
            ),
            (
                Endpoint::Responses,
                r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"a"},{"type":"function_call","call_id":"x","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"x","output":"o"}]}"#,
                [
                    "d734e127c079e55cddfb6505a4ee841e",
                    "14332bbecda0fdfee63c70b213143d47",
                    "7fbc609db2e15f3fcc7664a26d4a967f",
                    "9c4cd921e2b74ea6199217d8323fdc0e",
                ],
            ),
        ];
        for (endpoint, body, want) in cases {
            let s = extract(endpoint, body.as_bytes(), IdentityBlocks::default()).unwrap();
            let got: Vec<String> = s.boundaries.iter().map(|b| format!("{:032x}", b.key)).collect();
            let want: Vec<&str> = want.into_iter().filter(|k| !k.is_empty()).collect();
            assert_eq!(got, want, "{endpoint:?}");
        }
    }
}

/// The agent dialects, through `extract`.
#[cfg(test)]
mod agent_tests {
    use super::*;
    use serde_json::Value;

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
        // Its first boundary is the instructions' (the first link).
        assert_eq!(t2.boundaries[0].key, t1.boundaries[0].key);
        assert_eq!(t2.boundaries[1].key, t1.pin_at.unwrap());
        assert!(t2.multi_unit && t2.boundaries.len() == 6);
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
        assert_eq!(t2.boundaries[1].key, t1.pin_at.unwrap());
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

        /// Any list of JSON items as Responses input or Anthropic messages:
        /// it routes with one boundary at most per item (and the chain is
        /// the same on a second read), or it is an error that says why.
        #[test]
        fn arbitrary_json_items_route_deterministically_or_are_clear_errors(items in proptest::collection::vec(json_value(), 0..6)) {
            let input = serde_json::to_string(&items).unwrap();
            for (endpoint, body) in [
                (Endpoint::Responses, format!(r#"{{"model":"m","input":{input}}}"#)),
                (Endpoint::Messages, format!(r#"{{"model":"m","messages":{input}}}"#)),
            ] {
                match extract(endpoint, body.as_bytes(), IdentityBlocks::default()) {
                    Ok(shape) => {
                        proptest::prop_assert!(shape.boundaries.len() <= items.len() + 1, "{}", body);
                        let again = extract(endpoint, body.as_bytes(), IdentityBlocks::default()).unwrap();
                        let keys = |s: &crate::policy::RequestShape| s.boundaries.iter().map(|b| b.key).collect::<Vec<_>>();
                        proptest::prop_assert_eq!(keys(&shape), keys(&again));
                    }
                    Err(e) => proptest::prop_assert!(!e.0.is_empty()),
                }
            }
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
