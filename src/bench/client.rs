//! One streamed chat request, timed: time to first *content* chunk (not the
//! response head, which some servers send before prefill), the route the
//! gateway reported, and the usage the server reported.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::Common;
use super::Sample;

pub async fn stream_chat(c: &awc::Client, common: &Common, messages: &[Value]) -> Result<(Sample, String), String> {
    let body = json!({
        "model": common.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": common.max_tokens,
    });
    let started = Instant::now();
    let mut req =
        c.post(format!("{}/v1/chat/completions", common.base_url)).timeout(Duration::from_secs(common.timeout));
    if let Some(k) = &common.api_key {
        req = req.insert_header(("authorization", format!("Bearer {k}")));
    }
    let mut resp = req.send_json(&body).await.map_err(|e| e.to_string())?;
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
            if let Some(text) = v["choices"][0]["delta"]["content"].as_str() {
                if sample.ttft_ms.is_none() {
                    sample.ttft_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
                }
                answer.push_str(text);
            }
            if let Some(ms) = v["prefill_ms"].as_f64() {
                sample.sim_prefill_ms.get_or_insert(ms);
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                sample.prompt_tokens = u["prompt_tokens"].as_u64();
                sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
            }
        }
    }
    sample.total_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok((sample, answer))
}
