//! The agent dialects on the simulated engine: the OpenAI Responses API
//! (with `store` and `previous_response_id`, kept in this process as vLLM
//! keeps them: an id this replica did not make is a 404) and the Anthropic
//! Messages API, streaming and not, with each API's event names and usage
//! fields, on the same KV model as chat, so tests read cache hits from usage.

use std::sync::atomic::Ordering;

use actix_web::{web, HttpResponse};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{prefill, prefill_and_decode, sse_response, Frame, Prefilled, SimState, WORDS};

pub(super) fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/responses", web::post().to(create_response))
        .route("/v1/responses/{id}", web::get().to(get_response))
        .route("/v1/responses/{id}", web::delete().to(delete_response))
        .route("/v1/responses/{id}/cancel", web::post().to(get_response))
        .route("/v1/responses/{id}/input_items", web::get().to(input_items))
        .route("/v1/messages", web::post().to(messages));
}

/// A stored response: the prompt that led to it with its output appended
/// (what a follow-up continues), the response object, and its input items.
pub(crate) struct StoredResponse {
    prompt: Vec<u8>,
    body: Value,
    input: Vec<Value>,
}

/// Keys a template would not render: markers that move between turns and
/// ids the server assigns.
fn strip(v: &Value, skip: &[&str]) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter().filter(|(k, _)| !skip.contains(&k.as_str())).map(|(k, v)| (k.clone(), strip(v, skip))).collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|v| strip(v, skip)).collect()),
        other => other.clone(),
    }
}

/// A chat template stand-in for one message-like item.
fn render_message(out: &mut Vec<u8>, role: &str, content: Option<&Value>, skip: &[&str]) {
    out.extend_from_slice(role.as_bytes());
    out.push(b'\n');
    match content {
        Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
        Some(other) => out.extend_from_slice(strip(other, skip).to_string().as_bytes()),
        None => {}
    }
    out.push(b'\n');
}

fn render_item(out: &mut Vec<u8>, item: &Value) {
    const SKIP: &[&str] = &["id", "status"];
    match item.get("role").and_then(Value::as_str) {
        Some(role) if item.get("type").is_none_or(|t| t == "message") => {
            render_message(out, role, item.get("content"), SKIP)
        }
        _ => {
            out.extend_from_slice(strip(item, SKIP).to_string().as_bytes());
            out.push(b'\n');
        }
    }
}

fn openai_error(status: actix_web::http::StatusCode, message: String, code: &str) -> HttpResponse {
    HttpResponse::build(status)
        .json(json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}}))
}

fn anthropic_error(status: actix_web::http::StatusCode, kind: &str, message: String) -> HttpResponse {
    HttpResponse::build(status).json(json!({"type": "error", "error": {"type": kind, "message": message}}))
}

fn event(kind: &str, data: &Value) -> web::Bytes {
    web::Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

fn text_of(n: u64) -> String {
    (0..n as usize).map(|i| WORDS[i % WORDS.len()]).collect()
}

#[derive(Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    #[serde(default)]
    input: Value,
    instructions: Option<Value>,
    tools: Option<Value>,
    previous_response_id: Option<String>,
    #[serde(default)]
    stream: bool,
    max_output_tokens: Option<u64>,
    store: Option<bool>,
}

async fn create_response(s: web::Data<SimState>, body: web::Bytes) -> HttpResponse {
    s.received.fetch_add(1, Ordering::Relaxed);
    let Ok(r) = serde_json::from_slice::<ResponsesRequest>(&body) else {
        return openai_error(
            actix_web::http::StatusCode::BAD_REQUEST,
            "invalid Responses request".into(),
            "invalid_request",
        );
    };
    let items: Vec<Value> = match &r.input {
        Value::String(t) => vec![json!({"role": "user", "content": t})],
        Value::Array(a) => a.clone(),
        _ => {
            return openai_error(
                actix_web::http::StatusCode::BAD_REQUEST,
                "'input' must be a string or an array".into(),
                "invalid_request",
            )
        }
    };
    let mut prompt = Vec::new();
    if let Some(prev) = &r.previous_response_id {
        match s.responses.lock().expect("responses lock").get(prev) {
            Some(stored) => prompt.extend_from_slice(&stored.prompt),
            None => {
                return openai_error(
                    actix_web::http::StatusCode::NOT_FOUND,
                    format!("Response with id '{prev}' not found."),
                    "response_not_found",
                )
            }
        }
    } else {
        if let Some(i) = &r.instructions {
            render_message(&mut prompt, "system", Some(i), &[]);
        }
        if let Some(t) = &r.tools {
            prompt.extend_from_slice(t.to_string().as_bytes());
        }
    }
    for item in &items {
        render_item(&mut prompt, item);
    }
    let max_tokens = r.max_output_tokens.unwrap_or(16).min(4096);
    let (id, msg_id) = (super::random_id("resp"), super::random_id("msg"));
    let model = r.model.clone().unwrap_or_else(|| s.cfg.model.clone());
    let created = crate::clock::now_ms() / 1000;
    let text = text_of(max_tokens);
    let item = json!({"type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": []}]});
    let response = move |status: &str, output: Vec<Value>, usage: Value| {
        json!({"id": id, "object": "response", "created_at": created, "status": status, "model": model,
               "output": output, "usage": usage, "previous_response_id": r.previous_response_id,
               "instructions": r.instructions, "tools": r.tools.clone().unwrap_or(json!([])),
               "parallel_tool_calls": true, "tool_choice": "auto", "store": r.store.unwrap_or(true),
               "text": {"format": {"type": "text"}}, "error": null, "incomplete_details": null,
               "metadata": {}, "temperature": 1.0, "top_p": 1.0, "truncation": "disabled",
               "max_output_tokens": max_tokens, "reasoning": null})
    };
    let usage = move |p: &Prefilled| {
        json!({"input_tokens": p.prompt_tokens, "input_tokens_details": {"cached_tokens": p.cached_tokens},
               "output_tokens": max_tokens, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": p.prompt_tokens + max_tokens})
    };
    let store = r.store.unwrap_or(true);
    let s = s.into_inner();
    let keep = {
        let s = s.clone();
        let mut full = prompt.clone();
        render_item(&mut full, &item);
        move |body: &Value| {
            if store {
                let stored = StoredResponse { prompt: full, body: body.clone(), input: items };
                s.responses
                    .lock()
                    .expect("responses lock")
                    .insert(body["id"].as_str().unwrap_or("").to_string(), stored);
            }
        }
    };
    let per_token = s.scaled(1.0 / s.cfg.decode_tps);
    if !r.stream {
        let p = match prefill_and_decode(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(resp) => return resp,
        };
        let body = response("completed", vec![item], usage(&p));
        keep(&body);
        return HttpResponse::Ok().json(body);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(8);
    actix_web::rt::spawn(async move {
        let mut seq = 0u64;
        let mut next = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            event(kind, &data)
        };
        let created_ev = response("in_progress", vec![], Value::Null);
        if tx.send(Frame::Chunk(next("response.created", json!({"response": created_ev})))).await.is_err() {
            return;
        }
        let p = match prefill(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(_) => {
                let _ = tx
                    .send(Frame::Chunk(next(
                        "error",
                        json!({"code": "kv_full", "message": "prompt does not fit", "param": null}),
                    )))
                    .await;
                let _ = tx.send(Frame::End).await;
                return;
            }
        };
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        added["content"] = json!([]);
        let mut frames = vec![
            next("response.in_progress", json!({"response": response("in_progress", vec![], Value::Null)})),
            next("response.output_item.added", json!({"output_index": 0, "item": added})),
            next(
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
            ),
        ];
        for i in 0..max_tokens as usize {
            frames.push(next(
                "response.output_text.delta",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "delta": WORDS[i % WORDS.len()]}),
            ));
        }
        frames.push(next(
            "response.output_text.done",
            json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "text": text}),
        ));
        frames.push(next("response.content_part.done", json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}})));
        frames.push(next("response.output_item.done", json!({"output_index": 0, "item": item})));
        let body = response("completed", vec![item.clone()], usage(&p));
        keep(&body);
        frames.push(next("response.completed", json!({"response": body})));
        for (i, f) in frames.into_iter().enumerate() {
            if i >= 3 && i < 3 + max_tokens as usize {
                if i > 3 {
                    super::elapse(per_token).await;
                }
                if s.fault(&tx, i as u64 - 3).await {
                    return;
                }
                s.generated.fetch_add(1, Ordering::Relaxed);
            }
            if tx.send(Frame::Chunk(f)).await.is_err() {
                s.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        drop(p.seq);
        let _ = tx.send(Frame::End).await;
    });
    sse_response(rx)
}

fn not_found(id: &str) -> HttpResponse {
    openai_error(
        actix_web::http::StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
        "response_not_found",
    )
}

async fn get_response(s: web::Data<SimState>, id: web::Path<String>) -> HttpResponse {
    match s.responses.lock().expect("responses lock").get(id.as_str()) {
        Some(r) => HttpResponse::Ok().json(&r.body),
        None => not_found(&id),
    }
}

async fn delete_response(s: web::Data<SimState>, id: web::Path<String>) -> HttpResponse {
    match s.responses.lock().expect("responses lock").remove(id.as_str()) {
        Some(_) => HttpResponse::Ok().json(json!({"id": *id, "object": "response", "deleted": true})),
        None => not_found(&id),
    }
}

async fn input_items(s: web::Data<SimState>, id: web::Path<String>) -> HttpResponse {
    match s.responses.lock().expect("responses lock").get(id.as_str()) {
        Some(r) => HttpResponse::Ok().json(json!({"object": "list", "data": r.input, "has_more": false,
            "first_id": null, "last_id": null})),
        None => not_found(&id),
    }
}

#[derive(Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    system: Option<Value>,
    tools: Option<Value>,
    messages: Vec<Value>,
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
}

async fn messages(s: web::Data<SimState>, body: web::Bytes) -> HttpResponse {
    s.received.fetch_add(1, Ordering::Relaxed);
    let r = match serde_json::from_slice::<MessagesRequest>(&body) {
        Ok(r) if !r.messages.is_empty() => r,
        _ => {
            return anthropic_error(
                actix_web::http::StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "expected a Messages request with a non-empty 'messages' array".into(),
            )
        }
    };
    const SKIP: &[&str] = &["cache_control"];
    let mut prompt = Vec::new();
    if let Some(system) = &r.system {
        render_message(&mut prompt, "system", Some(system), SKIP);
    }
    if let Some(t) = &r.tools {
        prompt.extend_from_slice(strip(t, SKIP).to_string().as_bytes());
    }
    for m in &r.messages {
        render_message(&mut prompt, m.get("role").and_then(Value::as_str).unwrap_or("user"), m.get("content"), SKIP);
    }
    let max_tokens = r.max_tokens.unwrap_or(16).min(4096);
    let id = super::random_id("msg");
    let model = r.model.unwrap_or_else(|| s.cfg.model.clone());
    let usage = move |p: &Prefilled, out: u64| {
        json!({"input_tokens": p.prompt_tokens - p.cached_tokens, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": p.cached_tokens, "output_tokens": out})
    };
    let message = move |content: Value, stop: Value, usage: Value| {
        json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
               "stop_reason": stop, "stop_sequence": null, "usage": usage})
    };
    let s = s.into_inner();
    let per_token = s.scaled(1.0 / s.cfg.decode_tps);
    if !r.stream {
        let p = match prefill_and_decode(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(_) => {
                return anthropic_error(
                    actix_web::http::StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "prompt does not fit in the KV cache".into(),
                )
            }
        };
        let body =
            message(json!([{"type": "text", "text": text_of(max_tokens)}]), json!("max_tokens"), usage(&p, max_tokens));
        return HttpResponse::Ok().json(body);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(8);
    actix_web::rt::spawn(async move {
        let p = match prefill(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(_) => {
                let e =
                    json!({"type": "error", "error": {"type": "overloaded_error", "message": "prompt does not fit"}});
                let _ = tx.send(Frame::Chunk(event("error", &e))).await;
                let _ = tx.send(Frame::End).await;
                return;
            }
        };
        let start = json!({"type": "message_start", "message": message(json!([]), Value::Null, usage(&p, 1))});
        let mut frames = vec![
            event("message_start", &start),
            event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", &json!({"type": "ping"})),
        ];
        for i in 0..max_tokens as usize {
            frames.push(event("content_block_delta", &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": WORDS[i % WORDS.len()]}})));
        }
        frames.push(event("content_block_stop", &json!({"type": "content_block_stop", "index": 0})));
        frames.push(event("message_delta", &json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": {"output_tokens": max_tokens}})));
        frames.push(event("message_stop", &json!({"type": "message_stop"})));
        for (i, f) in frames.into_iter().enumerate() {
            if i > 3 && i < 3 + max_tokens as usize {
                super::elapse(per_token).await;
            }
            if (3..3 + max_tokens as usize).contains(&i) && s.fault(&tx, i as u64 - 3).await {
                return;
            }
            if tx.send(Frame::Chunk(f)).await.is_err() {
                s.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        s.generated.fetch_add(max_tokens, Ordering::Relaxed);
        drop(p.seq);
        let _ = tx.send(Frame::End).await;
    });
    sse_response(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering_ignores_moving_markers_and_server_ids() {
        let mut a = Vec::new();
        render_item(
            &mut a,
            &json!({"type": "message", "id": "m1", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}),
        );
        let mut b = Vec::new();
        render_item(&mut b, &json!({"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}));
        assert_eq!(a, b);
        let mut c = Vec::new();
        render_message(
            &mut c,
            "user",
            Some(&json!([{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}])),
            &["cache_control"],
        );
        let mut d = Vec::new();
        render_message(&mut d, "user", Some(&json!([{"type": "text", "text": "q"}])), &["cache_control"]);
        assert_eq!(c, d);
    }
}
