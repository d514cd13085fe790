//! What a streamed request asks that decides whether its stream can be
//! continued on another replica should its own fail (`proxy::resume`),
//! read in the shape's one parse. The fields are borrowed as raw JSON: a
//! request that sends none of them pays a missing key each, and the body
//! is never parsed a second time for them.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::chain::Dialect;

/// Why a stream can never be continued, known from its request: a seam
/// would corrupt what it asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeamRisk {
    /// Guided or structured output: a seam would restart its grammar.
    StructuredOutput,
    /// `n > 1`: several answers in one stream.
    SeveralChoices,
    /// Log probabilities: the next leg's would be of another prompt.
    Logprobs,
    /// Responses: `previous_response_id` names a stored conversation no
    /// transcript can render.
    StoredConversation,
    /// Responses: the response is stored (`store` not false), and the
    /// continued answer would be stored nowhere.
    StoredResponse,
}

/// What a streamed request asks, as continuation reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamAsks {
    /// Why it can never be continued, if it cannot.
    pub risk: Option<SeamRisk>,
    /// The client asked for token ids itself (`return_token_ids`).
    pub token_ids: bool,
    /// The client asked for a usage chunk (`stream_options.include_usage`).
    pub usage: bool,
    /// It offers tools the model may call (`tool_choice` is not "none").
    pub tools: bool,
}

/// The raw fields as a dialect's body carries them (absent: None).
#[derive(Default)]
pub(super) struct Asked<'a> {
    pub n: Option<&'a RawValue>,
    pub logprobs: Option<&'a RawValue>,
    pub top_logprobs: Option<&'a RawValue>,
    /// Chat's and completions' `response_format`.
    pub response_format: Option<&'a RawValue>,
    /// Responses' `text` (its `format`).
    pub text: Option<&'a RawValue>,
    /// `structured_outputs` and vLLM's `guided_json`, `guided_regex`,
    /// `guided_choice`, `guided_grammar`.
    pub guided: [Option<&'a RawValue>; 5],
    pub return_token_ids: Option<&'a RawValue>,
    pub stream_options: Option<&'a RawValue>,
    /// Whether `tools` is a non-empty list, and the `tool_choice`.
    pub tools: bool,
    pub tool_choice: Option<&'a RawValue>,
    /// Responses: `store`, and whether `previous_response_id` is set.
    pub store: Option<bool>,
    pub previous_response: bool,
}

/// Set: present and not null.
fn set(v: Option<&RawValue>) -> bool {
    v.is_some_and(|v| v.get() != "null")
}

/// A member of a small raw object, read on its own.
fn member<'a, T: Deserialize<'a>>(raw: Option<&'a RawValue>) -> Option<T> {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct TextOptions<'a> {
    #[serde(borrow)]
    format: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

impl Asked<'_> {
    pub(super) fn read(&self, dialect: Dialect) -> StreamAsks {
        // OpenAI's "none", Anthropic's {"type": "none"}.
        let tool_choice_none = self.tool_choice.is_some_and(|c| c.get() == "\"none\"")
            || member::<Typed>(self.tool_choice).is_some_and(|t| t.kind.as_deref() == Some("none"));
        let usage = member::<StreamOptions>(self.stream_options).and_then(|o| o.include_usage);
        StreamAsks {
            risk: self.risk(dialect),
            token_ids: self.return_token_ids.is_some(),
            usage: usage == Some(true),
            tools: self.tools && !tool_choice_none,
        }
    }

    fn risk(&self, dialect: Dialect) -> Option<SeamRisk> {
        let format = match self.response_format {
            Some(format) => Some(format),
            None => member::<TextOptions>(self.text).and_then(|t| t.format),
        };
        let schema = member::<Typed>(format).and_then(|t| t.kind);
        let structured = matches!(schema.as_deref(), Some("json_schema" | "json_object" | "structural_tag"));
        if structured || self.guided.iter().any(|g| set(*g)) {
            return Some(SeamRisk::StructuredOutput);
        }
        if member::<u64>(self.n).is_some_and(|n| n > 1) {
            return Some(SeamRisk::SeveralChoices);
        }
        let logprobs = self.logprobs.is_some_and(|v| !matches!(v.get(), "null" | "false"));
        if logprobs || set(self.top_logprobs) {
            return Some(SeamRisk::Logprobs);
        }
        if dialect == Dialect::Responses {
            if self.previous_response {
                return Some(SeamRisk::StoredConversation);
            }
            if self.store != Some(false) {
                return Some(SeamRisk::StoredResponse);
            }
        }
        None
    }
}

/// Whether a raw `tools` is a non-empty list.
pub(super) fn some_tools(tools: Option<&RawValue>) -> bool {
    tools.is_some_and(|t| t.get().starts_with('[') && t.get()[1..].trim_start() != "]")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::identity::{extract, Endpoint};
    use crate::policy::IdentityBlocks;

    fn asks(endpoint: Endpoint, body: serde_json::Value) -> StreamAsks {
        extract(endpoint, body.to_string().as_bytes(), IdentityBlocks::default()).unwrap().stream
    }

    fn chat(extra: serde_json::Value) -> StreamAsks {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        asks(Endpoint::Chat, body)
    }

    #[test]
    fn what_a_seam_would_corrupt_is_read_in_the_shapes_one_parse() {
        let risk = |extra| chat(extra).risk;
        assert_eq!(
            risk(json!({"response_format": {"type": "json_schema", "json_schema": {}}})),
            Some(SeamRisk::StructuredOutput)
        );
        assert_eq!(risk(json!({"guided_regex": "a+"})), Some(SeamRisk::StructuredOutput));
        assert_eq!(risk(json!({"structured_outputs": {"json": {}}})), Some(SeamRisk::StructuredOutput));
        assert_eq!(risk(json!({"n": 2})), Some(SeamRisk::SeveralChoices));
        assert_eq!(risk(json!({"logprobs": true})), Some(SeamRisk::Logprobs));
        assert_eq!(risk(json!({"logprobs": 2})), Some(SeamRisk::Logprobs));
        assert_eq!(risk(json!({"top_logprobs": 3})), Some(SeamRisk::Logprobs));
        let plain = json!({"n": 1, "logprobs": false, "response_format": {"type": "text"}, "guided_json": null});
        assert_eq!(chat(plain), StreamAsks::default());
        let completion = json!({"model": "m", "prompt": "x", "stream": true, "n": 3});
        assert_eq!(asks(Endpoint::Completions, completion).risk, Some(SeamRisk::SeveralChoices));
    }

    #[test]
    fn a_responses_stream_that_stores_or_names_a_stored_conversation_is_at_risk() {
        let of = |extra: serde_json::Value| {
            let mut body = json!({"model": "m", "input": "x", "stream": true});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            asks(Endpoint::Responses, body).risk
        };
        assert_eq!(of(json!({})), Some(SeamRisk::StoredResponse), "store is true unless said");
        assert_eq!(of(json!({"store": false})), None);
        assert_eq!(of(json!({"store": false, "previous_response_id": "resp_1"})), Some(SeamRisk::StoredConversation));
        assert_eq!(
            of(json!({"store": false, "text": {"format": {"type": "json_schema", "schema": {}}}})),
            Some(SeamRisk::StructuredOutput)
        );
    }

    #[test]
    fn usage_ids_and_tools_as_the_client_asked() {
        let asked = chat(json!({"stream_options": {"include_usage": true}, "return_token_ids": true,
            "tools": [{"type": "function", "function": {"name": "ls"}}]}));
        assert_eq!((asked.usage, asked.token_ids, asked.tools), (true, true, true));
        let none = chat(json!({"tools": [{"type": "function", "function": {"name": "ls"}}], "tool_choice": "none"}));
        assert!(!none.tools, "tool_choice none offers no tool");
        assert!(!chat(json!({"tools": [ ]})).tools, "an empty list offers none");
        let messages = json!({"model": "m", "max_tokens": 4, "stream": true, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "ls", "input_schema": {}}]});
        assert!(asks(Endpoint::Messages, messages.clone()).tools);
        let mut none = messages;
        none["tool_choice"] = json!({"type": "none"});
        assert!(!asks(Endpoint::Messages, none).tools, "Anthropic's none");
    }
}
