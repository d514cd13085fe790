//! One streamed request, timed: time to first *content* chunk (not the
//! response head, which some servers send before prefill), the route the
//! gateway reported, and the usage the server reported. Speaks chat
//! completions, the Responses API and Anthropic Messages, from one
//! chat-style history (`role`, `content` text).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::Common;
use super::Sample;

/// The API a benchmark client speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `/v1/chat/completions`
    #[default]
    Chat,
    /// `/v1/responses` (the whole history as input items, `store: false`)
    Responses,
    /// `/v1/messages` (Anthropic)
    Messages,
    /// `/v1/responses` as Codex chains it: `store: true`, each turn sends
    /// only its new input and names the previous response
    /// (`previous_response_id`), so a follow-up on the wrong replica is a 404.
    ResponsesChain,
}

/// `previous`: the last response's id (`ResponsesChain` only).
fn request_body(api: Api, common: &Common, messages: &[Value], previous: Option<&str>) -> (&'static str, Value) {
    match api {
        Api::ResponsesChain => {
            let newest = messages.last().map_or(Value::Null, |m| m["content"].clone());
            let mut body = json!({"model": common.model, "input": newest, "stream": true, "store": true,
                                  "max_output_tokens": common.max_tokens});
            if let Some(p) = previous {
                body["previous_response_id"] = json!(p);
            }
            ("/v1/responses", body)
        }
        Api::Chat => (
            "/v1/chat/completions",
            json!({"model": common.model, "messages": messages, "stream": true,
                   "stream_options": {"include_usage": true}, "max_tokens": common.max_tokens}),
        ),
        Api::Responses => {
            let input: Vec<Value> = messages
                .iter()
                .map(|m| match m["role"].as_str() {
                    Some("assistant") => json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": m["content"], "annotations": []}]}),
                    _ => json!({"role": m["role"], "content": m["content"]}),
                })
                .collect();
            (
                "/v1/responses",
                json!({"model": common.model, "input": input, "stream": true, "store": false,
                       "max_output_tokens": common.max_tokens}),
            )
        }
        Api::Messages => (
            "/v1/messages",
            json!({"model": common.model, "messages": messages, "stream": true, "max_tokens": common.max_tokens}),
        ),
    }
}

/// Reads one event of a stream: content text, and usage when it carries it.
fn read_event(api: Api, v: &Value, sample: &mut Sample) -> Option<String> {
    match api {
        Api::Chat => {
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                sample.prompt_tokens = u["prompt_tokens"].as_u64();
                sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
            }
            // A completions stream carries its text in `text`.
            let choice = &v["choices"][0];
            choice["delta"]["content"].as_str().or(choice["text"].as_str()).map(str::to_string)
        }
        Api::Responses | Api::ResponsesChain => match v["type"].as_str() {
            Some("response.created") => {
                sample.response_id = v["response"]["id"].as_str().map(str::to_string);
                None
            }
            Some("response.output_text.delta") => v["delta"].as_str().map(str::to_string),
            Some("response.completed") => {
                let u = &v["response"]["usage"];
                sample.prompt_tokens = u["input_tokens"].as_u64();
                sample.cached_tokens = u["input_tokens_details"]["cached_tokens"].as_u64();
                None
            }
            _ => None,
        },
        Api::Messages => match v["type"].as_str() {
            Some("content_block_delta") => v["delta"]["text"].as_str().map(str::to_string),
            Some("message_start") => {
                let u = &v["message"]["usage"];
                let read = u["cache_read_input_tokens"].as_u64();
                let created = u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
                sample.prompt_tokens = u["input_tokens"].as_u64().map(|n| n + read.unwrap_or(0) + created);
                sample.cached_tokens = read;
                None
            }
            _ => None,
        },
    }
}

pub async fn stream_chat(c: &awc::Client, common: &Common, messages: &[Value]) -> Result<(Sample, String), String> {
    stream_turn(c, common, Api::Chat, messages, None).await
}

pub async fn stream_turn(
    c: &awc::Client,
    common: &Common,
    api: Api,
    messages: &[Value],
    previous: Option<&str>,
) -> Result<(Sample, String), String> {
    let (path, body) = request_body(api, common, messages, previous);
    send(c, common, api, path, &body).await
}

/// Sends `body` to `path` and reads its stream as `api` speaks it.
pub async fn send(
    c: &awc::Client,
    common: &Common,
    api: Api,
    path: &str,
    body: &Value,
) -> Result<(Sample, String), String> {
    let started = Instant::now();
    let mut req = c.post(format!("{}{path}", common.base_url)).timeout(Duration::from_secs(common.timeout));
    if let Some(k) = &common.api_key {
        req = req.insert_header(("authorization", format!("Bearer {k}")));
    }
    for (name, value) in &common.headers {
        req = req.insert_header((name.as_str(), value.as_str()));
    }
    let mut resp = req.send_json(body).await.map_err(|e| e.to_string())?;
    let header = |n: &str| resp.headers().get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let mut sample =
        Sample { replica: header("x-prefixgate-replica"), route: header("x-prefixgate-route"), ..Sample::default() };
    if !resp.status().is_success() {
        let text = resp.body().await.map(|b| String::from_utf8_lossy(&b).to_string()).unwrap_or_default();
        return Err(format!("status {}: {text}", resp.status()));
    }
    let mut buf = Vec::new();
    let mut answer = String::new();
    while let Some(chunk) = resp.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Some(data) = line.strip_prefix(b"data: ") else { continue };
            let Ok(v) = serde_json::from_slice::<Value>(data.trim_ascii()) else { continue };
            if let Some(text) = read_event(api, &v, &mut sample) {
                if sample.ttft_ms.is_none() {
                    sample.ttft_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
                }
                answer.push_str(&text);
            }
            if let Some(ms) = v["prefill_ms"].as_f64() {
                sample.sim_prefill_ms.get_or_insert(ms);
            }
        }
    }
    sample.total_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok((sample, answer))
}
