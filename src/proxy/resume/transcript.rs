//! The text way's prompt: the conversation a stream answers plus its answer
//! so far, as the engine that resumes it renders and tokenizes it (vLLM's
//! `/tokenize` with `continue_final_message`, or llama.cpp's
//! `/apply-template` then `/tokenize`). Responses and Messages requests are
//! written as the chat messages their endpoints turn them into (vLLM
//! serves both through its chat template): text, tool calls and their
//! results. What a chat template cannot be given from the request (an
//! image, a conversation stored on a replica) has no transcript, and the
//! stream is not continued (`Refusal::NoTranscript`).

use serde_json::{json, Map, Value};

use crate::policy::Dialect;

/// A conversation and its answer so far, to be tokenized.
#[derive(Debug, Clone, PartialEq)]
pub enum Transcript {
    /// Chat messages (the answer so far is not among them), the tools
    /// offered and the template's arguments.
    /// `calls`: the tool calls the answer finished before the seam.
    Chat {
        model: Option<Value>,
        messages: Vec<Value>,
        tools: Option<Value>,
        kwargs: Option<Value>,
        answer: String,
        calls: Vec<Value>,
    },
    /// A completion's prompt, the answer so far appended.
    Prompt { model: Option<Value>, text: String },
}

/// The transcript of `request` (of `dialect`) with `answer` so far, and
/// the tool `calls` it finished.
pub fn transcript(dialect: Dialect, request: &Value, answer: &str, calls: &[Value]) -> Option<Transcript> {
    let model = request.get("model").cloned();
    let answer = answer.to_string();
    let (messages, tools) = match dialect {
        Dialect::Completions => {
            let prompt = request.get("prompt")?.as_str()?;
            return Some(Transcript::Prompt { model, text: format!("{prompt}{answer}") });
        }
        Dialect::Chat => (request.get("messages")?.as_array()?.clone(), request.get("tools").cloned()),
        Dialect::Messages => (from_messages(request)?, chat_tools(request.get("tools"))?),
        Dialect::Responses => (from_responses(request)?, chat_tools(request.get("tools"))?),
        Dialect::Other => return None,
    };
    let kwargs = request.get("chat_template_kwargs").cloned();
    let tools = tools.filter(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()));
    Some(Transcript::Chat { model, messages, tools, kwargs, answer, calls: calls.to_vec() })
}

impl Transcript {
    /// vLLM's `/tokenize` request: the conversation rendered with the
    /// answer as the open last message (no generation prompt after it).
    pub fn vllm_tokenize(&self) -> Value {
        match self {
            Transcript::Chat { .. } => Value::Object(self.open_chat().expect("a chat transcript")),
            Transcript::Prompt { model, text } => json!({"model": model, "prompt": text}),
        }
    }

    /// The conversation with the answer so far as the open last message,
    /// rendered without a generation prompt after it (`continue_final_message`),
    /// with its tools and template arguments: vLLM's `/tokenize` request,
    /// and the body of a next leg on the chat endpoint (None for a
    /// completion's prompt).
    pub fn open_chat(&self) -> Option<Map<String, Value>> {
        let Transcript::Chat { model, messages, tools, kwargs, .. } = self else { return None };
        let mut all = messages.clone();
        all.push(self.open_answer()?);
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert("messages".into(), json!(all));
        body.insert("add_generation_prompt".into(), json!(false));
        body.insert("continue_final_message".into(), json!(true));
        if let Some(tools) = tools {
            body.insert("tools".into(), tools.clone());
        }
        if let Some(kwargs) = kwargs {
            body.insert("chat_template_kwargs".into(), kwargs.clone());
        }
        Some(body)
    }

    /// The answer so far as the open last message: its text, and the tool
    /// calls it finished (None for a completion's prompt).
    pub fn open_answer(&self) -> Option<Value> {
        let Transcript::Chat { answer, calls, .. } = self else { return None };
        let mut open = json!({"role": "assistant", "content": answer});
        if !calls.is_empty() {
            open["tool_calls"] = json!(calls);
        }
        Some(open)
    }

    pub fn llama_template(&self) -> Option<Value> {
        match self {
            Transcript::Chat { messages, tools, .. } => {
                let mut body = json!({"messages": messages});
                if let Some(tools) = tools {
                    body["tools"] = tools.clone();
                }
                Some(body)
            }
            Transcript::Prompt { .. } => None,
        }
    }

    /// llama.cpp's `/tokenize` request: the rendered template (`rendered`)
    /// and the answer so far; a completion's prompt with its BOS.
    pub fn llama_tokenize(&self, rendered: Option<&str>) -> Value {
        match self {
            // The template wrote its own BOS: none added (a BOS doubled shifts the prefix).
            Transcript::Chat { answer, .. } => {
                json!({"content": format!("{}{answer}", rendered.unwrap_or("")), "add_special": false})
            }
            Transcript::Prompt { text, .. } => json!({"content": text, "add_special": true}),
        }
    }
}

/// The token ids a `/tokenize` answered (vLLM and llama.cpp both say
/// `tokens`); None for an answer without any (llama.cpp asked in vLLM's
/// form answers an empty list).
pub fn tokens_of(body: &[u8]) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Tokenized {
        tokens: Vec<u32>,
    }
    let ids = serde_json::from_slice::<Tokenized>(body).ok()?.tokens;
    (!ids.is_empty()).then_some(ids)
}

/// Text blocks as one string: a string, an array of text blocks, or none.
fn text_of(content: Option<&Value>) -> Option<String> {
    match content {
        None | Some(Value::Null) => Some(String::new()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("text" | "input_text" | "output_text") => text.push_str(part.get("text")?.as_str()?),
                    _ => return None,
                }
            }
            Some(text)
        }
        Some(_) => None,
    }
}

fn message(role: &str, content: String) -> Value {
    json!({"role": role, "content": content})
}

/// An assistant's tool call as chat writes it.
fn tool_call(id: &Value, name: &Value, arguments: String) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// Anthropic Messages as chat messages: `system`, text, `tool_use` as tool
/// calls, `tool_result` as tool messages (thinking of past turns is not
/// rendered, as templates drop it).
fn from_messages(request: &Value) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    if let Some(system) = request.get("system").filter(|s| !s.is_null()) {
        out.push(message("system", text_of(Some(system))?));
    }
    for m in request.get("messages")?.as_array()? {
        let role = m.get("role")?.as_str()?;
        let Some(blocks) = m.get("content").and_then(Value::as_array) else {
            out.push(message(role, text_of(m.get("content"))?));
            continue;
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for block in blocks {
            match block.get("type").and_then(Value::as_str)? {
                "text" => text.push_str(block.get("text")?.as_str()?),
                "tool_use" => calls.push(tool_call(&block["id"], &block["name"], block["input"].to_string())),
                "tool_result" => out.push(json!({"role": "tool", "tool_call_id": block["tool_use_id"],
                                                 "content": text_of(block.get("content"))?})),
                "thinking" | "redacted_thinking" => {}
                _ => return None,
            }
        }
        if !text.is_empty() || !calls.is_empty() {
            let mut said = message(role, text);
            if !calls.is_empty() {
                said["tool_calls"] = json!(calls);
            }
            out.push(said);
        }
    }
    Some(out)
}

/// A Responses request as chat messages: `instructions`, message items,
/// function calls and their outputs (reasoning items are not rendered).
fn from_responses(request: &Value) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    if let Some(instructions) = request.get("instructions").filter(|i| !i.is_null()) {
        out.push(message("system", text_of(Some(instructions))?));
    }
    let items = match request.get("input")? {
        Value::String(text) => return Some([out, vec![message("user", text.clone())]].concat()),
        Value::Array(items) => items,
        _ => return None,
    };
    for item in items {
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = match item.get("role")?.as_str()? {
                    "developer" => "system",
                    role => role,
                };
                out.push(message(role, text_of(item.get("content"))?));
            }
            Some("function_call") => {
                let arguments = item.get("arguments")?.as_str()?.to_string();
                let call = tool_call(&item["call_id"], &item["name"], arguments);
                match out.last_mut().filter(|m| m["role"] == "assistant") {
                    Some(last) if last.get("tool_calls").is_some() => last["tool_calls"].as_array_mut()?.push(call),
                    Some(last) => last["tool_calls"] = json!([call]),
                    None => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => {
                let output = text_of(item.get("output"))?;
                out.push(json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}));
            }
            Some("reasoning") => {}
            Some(_) => return None,
        }
    }
    Some(out)
}

/// Tools as chat offers them: Messages' (`input_schema`) and Responses'
/// (flat) function tools; Some(None) for none; None for a tool a template
/// cannot be given (a built-in one).
fn chat_tools(tools: Option<&Value>) -> Option<Option<Value>> {
    let Some(tools) = tools.and_then(Value::as_array) else { return Some(None) };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let parameters = tool.get("input_schema").or_else(|| tool.get("parameters"));
        let custom = tool.get("type").is_none_or(|t| t == "function" || t == "custom");
        if !custom || parameters.is_none() {
            return None;
        }
        out.push(json!({"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                                          "parameters": parameters}}));
    }
    Some(Some(json!(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(t: &Transcript) -> (&Vec<Value>, &Option<Value>) {
        match t {
            Transcript::Chat { messages, tools, .. } => (messages, tools),
            other => panic!("not chat: {other:?}"),
        }
    }

    #[test]
    fn a_messages_conversation_is_written_as_the_chat_messages_vllm_renders_it_from() {
        let request = json!({"model": "m", "system": [{"type": "text", "text": "be brief", "cache_control": {}}],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "/"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a b"}, {"type": "text", "text": "and?"}]}]});
        let t = transcript(Dialect::Messages, &request, "the answer", &[]).unwrap();
        let (messages, tools) = chat(&t);
        assert_eq!(messages[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(messages[2]["content"], "looking");
        assert_eq!(messages[2]["tool_calls"][0]["function"], json!({"name": "ls", "arguments": "{\"path\":\"/\"}"}));
        assert_eq!(messages[3], json!({"role": "tool", "tool_call_id": "t1", "content": "a b"}));
        assert_eq!(messages[4], json!({"role": "user", "content": "and?"}));
        assert_eq!(tools.as_ref().unwrap()[0]["function"]["parameters"], json!({"type": "object"}));
        let body = t.vllm_tokenize();
        assert_eq!(body["messages"][5], json!({"role": "assistant", "content": "the answer"}));
        assert_eq!(
            (body["continue_final_message"].clone(), body["add_generation_prompt"].clone()),
            (json!(true), json!(false))
        );
        let image = json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
        assert_eq!(transcript(Dialect::Messages, &image, "", &[]), None, "an image cannot be rendered from text");
    }

    #[test]
    fn a_responses_input_is_written_as_chat_messages_with_its_calls_and_outputs() {
        let request = json!({"model": "m", "instructions": "sys",
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
            "input": [{"role": "developer", "content": "dev"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                      {"type": "reasoning", "summary": []},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "42"}]});
        let t = transcript(Dialect::Responses, &request, "so", &[]).unwrap();
        let (messages, _) = chat(&t);
        let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "tool"]);
        assert_eq!(messages[3]["tool_calls"][0]["id"], "c1");
        let builtin = json!({"input": "q", "tools": [{"type": "web_search"}]});
        assert_eq!(transcript(Dialect::Responses, &builtin, "", &[]), None);
    }

    #[test]
    fn llama_cpp_gets_the_template_then_the_rendered_text_with_the_answer_and_no_second_bos() {
        let t = transcript(Dialect::Chat, &json!({"messages": [{"role": "user", "content": "q"}]}), " so far", &[])
            .unwrap();
        assert_eq!(t.llama_template().unwrap(), json!({"messages": [{"role": "user", "content": "q"}]}));
        assert_eq!(
            t.llama_tokenize(Some("<s>user q</s><s>assistant")),
            json!({"content": "<s>user q</s><s>assistant so far", "add_special": false})
        );
        let p = transcript(Dialect::Completions, &json!({"prompt": "Once"}), " upon", &[]).unwrap();
        assert_eq!(p.vllm_tokenize()["prompt"], "Once upon");
        assert_eq!(p.llama_tokenize(None), json!({"content": "Once upon", "add_special": true}));
        assert_eq!(transcript(Dialect::Completions, &json!({"prompt": [1, 2]}), "", &[]), None, "ids without ids back");
        assert_eq!(tokens_of(br#"{"tokens":[],"count":0}"#), None);
        assert_eq!(tokens_of(br#"{"tokens":[5,6],"count":2}"#), Some(vec![5, 6]));
    }
}
