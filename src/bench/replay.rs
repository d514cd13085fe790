//! `bench replay`: recorded agent traffic, sent again. A trace is JSON
//! lines, one model call each, in the order each task made them:
//!
//! ```json
//! {"task": "fix-login", "after_ms": 850, "path": "/v1/chat/completions", "body": {"messages": [...], "tools": [...]}}
//! ```
//!
//! `task` names the agent (its calls go one at a time, in order),
//! `after_ms` is the recorded pause between the end of its previous call
//! and this one (a tool running; absent: 0), `path` the API (chat,
//! completions, Responses, Messages; absent: chat) and `body` the request
//! as recorded. Every task starts at once, as the recorded agents did.
//!
//! What is changed, and only that: `model` (the replicas under test serve
//! their own), `stream: true` (TTFT is read from the stream), the output
//! cap (`--max-tokens`, so every router decodes the same), and with
//! `--keep-text F` every text (message contents, text parts, system
//! prompts, tool descriptions) cut to its first fraction F: the same text
//! is cut the same way in every call, so a recorded prefix stays a prefix
//! and a long recording fits a small model. Tool-call arguments are never
//! cut (engines parse them as JSON), nor names, ids or schemas.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use super::client::{send, Api};
use super::{Common, Sample};

#[derive(Debug, Clone, Deserialize)]
pub struct Call {
    pub task: String,
    #[serde(default)]
    pub after_ms: u64,
    #[serde(default = "chat_path")]
    pub path: String,
    pub body: Value,
}

fn chat_path() -> String {
    "/v1/chat/completions".into()
}

/// The trace's calls grouped by task, tasks in order of first appearance.
pub fn read_trace(path: &Path) -> Result<Vec<(String, Vec<Call>)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut tasks: Vec<(String, Vec<Call>)> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let call: Call = serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
        if api_of(&call.path).is_none() {
            return Err(format!("{}:{}: unknown path {}", path.display(), i + 1, call.path));
        }
        match tasks.iter_mut().find(|(t, _)| *t == call.task) {
            Some((_, calls)) => calls.push(call),
            None => tasks.push((call.task.clone(), vec![call])),
        }
    }
    Ok(tasks)
}

fn api_of(path: &str) -> Option<Api> {
    match path {
        "/v1/chat/completions" | "/v1/completions" => Some(Api::Chat),
        "/v1/responses" => Some(Api::Responses),
        "/v1/messages" => Some(Api::Messages),
        _ => None,
    }
}

/// The body sent for `call`: the recorded one with the edits the module
/// names.
pub fn body_for(call: &Call, common: &Common, keep_text: f64) -> Value {
    let mut body = call.body.clone();
    if keep_text < 1.0 {
        cut_texts(&mut body, keep_text, false);
    }
    body["model"] = json!(common.model);
    body["stream"] = json!(true);
    match call.path.as_str() {
        "/v1/responses" => body["max_output_tokens"] = json!(common.max_tokens),
        "/v1/messages" => body["max_tokens"] = json!(common.max_tokens),
        _ => {
            body["max_tokens"] = json!(common.max_tokens);
            if let Some(o) = body.as_object_mut() {
                o.remove("max_completion_tokens");
            }
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    body
}

/// The keys whose strings are prose: message contents and text parts,
/// system prompts and instructions, tool and parameter descriptions, tool
/// results (Responses' `output`), completions' `prompt`.
const PROSE: [&str; 7] = ["content", "text", "system", "instructions", "description", "output", "prompt"];

/// Cuts every text under a key that holds prose to its first `keep`
/// (on a character boundary, at least one character of a non-empty text).
fn cut_texts(v: &mut Value, keep: f64, prose: bool) {
    match v {
        Value::String(s) if prose => {
            let chars = s.chars().count();
            let kept = ((chars as f64 * keep).ceil() as usize).clamp(chars.min(1), chars);
            if let Some((at, _)) = s.char_indices().nth(kept) {
                s.truncate(at);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| cut_texts(i, keep, prose)),
        Value::Object(map) => {
            // Prose by its own key, whatever holds it (`content` parts are
            // objects whose `text` is prose and whose `type` is not).
            // Tool-call `arguments` are JSON an engine parses: never cut.
            for (k, item) in map.iter_mut() {
                let prose = PROSE.contains(&k.as_str());
                cut_texts(item, keep, prose);
            }
        }
        _ => {}
    }
}

/// Replays `tasks`; a sample per call (family: the task's index, turn: the call's).
pub async fn run(common: &Common, tasks: &[(String, Vec<Call>)], keep_text: f64, pause_scale: f64) -> Vec<Sample> {
    let runs = tasks.iter().enumerate().map(|(t, (_, calls))| async move {
        let c = super::workloads::client();
        let mut samples = Vec::new();
        for (i, call) in calls.iter().enumerate() {
            if call.after_ms > 0 && i > 0 {
                tokio::time::sleep(Duration::from_secs_f64(call.after_ms as f64 * pause_scale / 1000.0)).await;
            }
            let base = common.base_for(t, i);
            let api = api_of(&call.path).expect("checked when read");
            let body = body_for(call, common, keep_text);
            let sample = match send(&c, &base, api, &call.path, &body).await {
                Ok((s, _)) => s,
                Err(e) => Sample { error: Some(e), ..Sample::default() },
            };
            samples.push(Sample { family: t, turn: i, ..sample });
        }
        samples
    });
    futures_util::future::join_all(runs).await.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common() -> Common {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            common: Common,
        }
        Cli::parse_from(["x", "--model", "m", "--max-tokens", "16"]).common
    }

    #[test]
    fn a_cut_keeps_prefixes_prefixes_and_leaves_arguments_whole() {
        let call = |messages: Value| Call {
            task: "t".into(),
            after_ms: 0,
            path: chat_path(),
            body: json!({"model": "rec", "max_completion_tokens": 900, "messages": messages, "tools": [{"type": "function", "function": {"name": "read", "description": "Reads a file from the workspace.", "parameters": {"type": "object"}}}]}),
        };
        let first = json!([{"role": "system", "content": "You are a coding agent. Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Fix the login bug in auth.py"}]}]);
        let mut second = first.clone();
        second.as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"auth.py\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "def login(user): return None"}),
        ]);
        let (a, b) = (body_for(&call(first), &common(), 0.5), body_for(&call(second), &common(), 0.5));
        assert_eq!(a["messages"][0]["content"], "You are a coding "); // 17 of 33 characters
        assert_eq!(a["messages"][1]["content"][0]["text"], "Fix the login ");
        assert_eq!(b["messages"].as_array().unwrap()[..2], a["messages"].as_array().unwrap()[..], "a prefix stays one");
        assert_eq!(b["messages"][2]["tool_calls"][0]["function"]["arguments"], "{\"path\": \"auth.py\"}");
        assert_eq!(b["messages"][3]["content"], "def login(user");
        assert_eq!(b["tools"][0]["function"]["description"], "Reads a file fro");
        assert_eq!(
            (a["model"].as_str(), a["stream"].as_bool(), a["max_tokens"].as_u64()),
            (Some("m"), Some(true), Some(16))
        );
        assert!(a.get("max_completion_tokens").is_none());
        assert_eq!(a["tools"][0]["function"]["name"], "read", "names are not prose");
    }

    #[test]
    fn a_trace_groups_calls_by_task_in_order_and_refuses_an_unknown_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let lines = [
            r#"{"task": "a", "body": {"messages": []}}"#,
            r#"{"task": "b", "after_ms": 5, "path": "/v1/messages", "body": {"messages": []}}"#,
            "",
            r#"{"task": "a", "after_ms": 7, "body": {"messages": [1]}}"#,
        ];
        std::fs::write(&p, lines.join("\n")).unwrap();
        let tasks = read_trace(&p).unwrap();
        let shape: Vec<(&str, Vec<u64>)> =
            tasks.iter().map(|(t, c)| (t.as_str(), c.iter().map(|c| c.after_ms).collect())).collect();
        assert_eq!(shape, vec![("a", vec![0, 7]), ("b", vec![5])]);
        std::fs::write(&p, r#"{"task": "a", "path": "/v1/embeddings", "body": {}}"#).unwrap();
        assert!(read_trace(&p).unwrap_err().contains("unknown path /v1/embeddings"));
    }
}
