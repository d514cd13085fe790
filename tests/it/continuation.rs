//! Streams that outlive their replica: a stream whose replica dies or
//! stalls mid-answer goes on on another replica, token for token, and the
//! client reads one whole stream; what a seam would corrupt ends broken.

use std::time::Duration;

use futures_util::StreamExt;
use prefixgate::sim::SimConfig;
use serde_json::{json, Value};

use crate::common::*;

/// What a client read of a stream: its replica header and its events.
struct Streamed {
    replica: String,
    raw: String,
    events: Vec<Value>,
    done: usize,
}

impl Streamed {
    /// The answer's text, as the dialect carries it (chat, completions,
    /// Responses deltas, Messages text deltas).
    fn text(&self) -> String {
        let piece = |e: &Value| {
            let c = &e["choices"][0];
            let chat = c["delta"]["content"].as_str().or(c["text"].as_str());
            let responses = e["delta"].as_str().filter(|_| e["type"] == "response.output_text.delta");
            let messages = e["delta"]["text"].as_str().filter(|_| e["type"] == "content_block_delta");
            chat.or(responses).or(messages).unwrap_or("").to_string()
        };
        self.events.iter().map(piece).collect()
    }

    /// Events of `kind` (Responses and Messages name their events).
    fn of_type(&self, kind: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["type"] == kind).collect()
    }

    fn count(&self, f: impl Fn(&Value) -> bool) -> usize {
        self.events.iter().filter(|e| f(e)).count()
    }
}

/// Posts a streamed request through the gateway; once its head arrived,
/// `after_head` runs (the test steers the fleet), then the stream is read
/// whole, `after_first` running beside it from its first chunk on (the
/// stream is mid-answer then: its first event passed the gateway).
async fn stream(
    url: &str,
    body: &Value,
    after_head: impl std::future::Future<Output = ()>,
    after_first: impl std::future::Future<Output = ()>,
) -> Streamed {
    let mut resp = client().post(url).send_json(body).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let replica = resp.headers().get("x-prefixgate-replica").unwrap().to_str().unwrap().to_string();
    after_head.await;
    let first = resp.next().await.expect("a first chunk").unwrap();
    let rest = async {
        let mut raw = first.to_vec();
        while let Some(chunk) = resp.next().await {
            raw.extend_from_slice(&chunk.unwrap());
        }
        raw
    };
    let (raw, ()) = tokio::join!(rest, after_first);
    let raw = String::from_utf8(raw).unwrap();
    let mut events = Vec::new();
    let mut done = 0;
    for event in raw.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event.lines().find_map(|l| l.strip_prefix("data: "));
        let data = data.unwrap_or_else(|| panic!("not a data event: {event}"));
        match data {
            "[DONE]" => done += 1,
            _ => events.push(serde_json::from_str(data).unwrap()),
        }
    }
    Streamed { replica, raw, events, done }
}

/// Replica "a" dies (or stalls, per `a`) after 150 tokens of every stream;
/// "b" is healthy. Both decode 400 tokens a second.
async fn fleet(a: SimConfig, failover: prefixgate::config::FailoverConfig) -> (Sim, Sim, Gw) {
    let a = start_sim("a", a).await;
    let b = start_sim("b", slow_decoder(400.0)).await;
    let config = prefixgate::config::Config { failover, ..test_config(&[&a, &b]) };
    let gw = start_gateway(config).await;
    (a, b, gw)
}

fn dies_at_150() -> SimConfig {
    SimConfig { die_after_tokens: Some(150), ..slow_decoder(400.0) }
}

/// Sends the request to "a": "b" is drained until the head arrived.
async fn on_a(gw: &Gw, path: &str, body: &Value) -> Streamed {
    on_a_then(gw, path, body, std::future::ready(())).await
}

/// As `on_a`, with `after_first` running from the stream's first chunk on.
async fn on_a_then(gw: &Gw, path: &str, body: &Value, after_first: impl std::future::Future<Output = ()>) -> Streamed {
    let (status, _) = admin("POST", &format!("{}/admin/v1/replicas/b/drain", gw.admin), None, None).await;
    assert_eq!(status, 200);
    let resume = async {
        let (status, _) = admin("POST", &format!("{}/admin/v1/replicas/b/resume", gw.admin), None, None).await;
        assert_eq!(status, 200);
    };
    stream(&format!("{}{path}", gw.base), body, resume, after_first).await
}

/// The unstreamed answer to a streamed chat `body`, asked of `replica` directly.
async fn chat_answer(replica: &Sim, body: &Value) -> String {
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let whole = post(&format!("{}/v1/chat/completions", replica.url), &whole).await;
    whole.body["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

/// A chat stream read as one answer: begun on "a", the `expected` text word
/// for word, one role, one finish, one `[DONE]`, usage of 400 tokens, the
/// first leg's id throughout and none of the ids the gateway asked for.
fn assert_one_chat_answer(got: &Streamed, expected: &str) {
    assert_eq!(got.replica, "a");
    assert_eq!(got.text(), expected, "the uninterrupted answer, word for word");
    assert_eq!(got.count(|e| !e["choices"][0]["delta"]["role"].is_null()), 1, "one role");
    assert_eq!(got.count(|e| !e["choices"][0]["finish_reason"].is_null()), 1, "one finish");
    assert_eq!(got.done, 1, "one [DONE]");
    let usage = got.events.iter().find(|e| !e["usage"].is_null()).expect("usage");
    assert_eq!(usage["usage"]["completion_tokens"], 400);
    let ids: std::collections::HashSet<&str> = got.events.iter().filter_map(|e| e["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "the first leg's id throughout: {ids:?}");
    assert!(!got.raw.contains("token_ids"), "the ids the gateway asked for are not the client's");
}

async fn events_of(gw: &Gw, kind: &str) -> Vec<Value> {
    let (_, events) = admin("GET", &format!("{}/admin/v1/events?kind={kind}", gw.admin), None, None).await;
    events["items"].as_array().cloned().unwrap_or_default()
}

#[actix_web::test]
async fn a_chat_stream_whose_replica_dies_goes_on_elsewhere_token_for_token_and_its_pin_moves() {
    let (_a, b, gw) = fleet(dies_at_150(), Default::default()).await;
    let messages = [("system", "You are terse."), ("user", "Tell me about caches.")];
    let extra = json!({"stream": true, "temperature": 0, "max_tokens": 400, "stream_options": {"include_usage": true}});
    let body = chat_body(&messages, extra);
    let expected = chat_answer(&b, &body).await;
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_one_chat_answer(&got, &expected);
    let continued = events_of(&gw, "stream_continued").await;
    assert_eq!(continued.len(), 1, "{continued:?}");
    assert_eq!((continued[0]["replica"].as_str(), continued[0]["to_replica"].as_str()), (Some("a"), Some("b")));
    // The conversation lives where its answer was finished: its next turn goes there.
    let next = [messages[0], messages[1], ("assistant", expected.as_str()), ("user", "And then?")];
    let follow = post(&format!("{}/v1/chat/completions", gw.base), &chat_body(&next, json!({}))).await;
    assert_eq!(follow.replica, "b", "the pin moved to the replica that finished the answer");
    assert!(scrape(&gw)
        .await
        .contains(r#"prefixgate_streams_continued_total{dialect="chat",reason="replica_failed",exact="true"} 1"#));
}

#[actix_web::test]
async fn a_completion_stream_whose_replica_dies_goes_on_elsewhere_token_for_token() {
    let (_a, b, gw) = fleet(dies_at_150(), Default::default()).await;
    let body = json!({"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true}});
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let expected = post(&format!("{}/v1/completions", b.url), &whole).await.body["choices"][0]["text"].clone();
    let got = on_a(&gw, "/v1/completions", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(json!(got.text()), expected);
    assert_eq!(got.count(|e| !e["choices"][0]["finish_reason"].is_null()), 1);
    assert_eq!(got.done, 1);
    let usage = got.events.iter().find(|e| !e["usage"].is_null()).expect("usage");
    assert_eq!(usage["usage"]["completion_tokens"], 400);
    assert!(!got.raw.contains("token_ids"));
    assert_eq!(events_of(&gw, "stream_continued").await.len(), 1);
}

#[actix_web::test]
async fn a_stream_whose_replica_stalls_goes_on_after_stall_ms() {
    let stalls = SimConfig { stall_after_tokens: Some(150), ..slow_decoder(400.0) };
    let failover = prefixgate::config::FailoverConfig { stall_ms: 300, ..Default::default() };
    let (_a, _b, gw) = fleet(stalls, failover).await;
    let body = chat_body(&[("user", "Go on.")], json!({"stream": true, "max_tokens": 400, "temperature": 0}));
    let started = std::time::Instant::now();
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(got.count(|e| !e["choices"][0]["delta"]["content"].is_null()), 400, "every token, once");
    assert_eq!(got.done, 1);
    assert!(started.elapsed() < Duration::from_secs(10), "not the idle timeout's 30 s");
    let continued = events_of(&gw, "stream_continued").await;
    assert!(continued[0]["detail"].as_str().unwrap().contains("stalled"), "{continued:?}");
}

#[actix_web::test]
async fn a_structured_output_stream_that_breaks_ends_broken_and_says_why() {
    let (_a, _b, gw) = fleet(dies_at_150(), Default::default()).await;
    let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    let body =
        chat_body(&[("user", "JSON please.")], json!({"stream": true, "max_tokens": 400, "response_format": schema}));
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(got.done, 0, "no [DONE]: the stream ended broken");
    assert!(got.events.last().unwrap()["error"]["message"].is_string(), "an error event ends it");
    assert_eq!(got.count(|e| !e["choices"][0]["delta"]["content"].is_null()), 150);
    let refused = events_of(&gw, "stream_not_continued").await;
    assert_eq!(refused.len(), 1);
    assert!(refused[0]["detail"].as_str().unwrap().contains("structured_output"), "{refused:?}");
    assert!(events_of(&gw, "stream_continued").await.is_empty());
}

#[actix_web::test]
async fn a_drain_with_hand_over_moves_a_long_stream_in_seconds_and_it_completes_whole() {
    // "a" would take 60 s for the answer; "b" is quick.
    let a = start_sim("a", slow_decoder(10.0)).await;
    let b = start_sim("b", slow_decoder(1_000.0)).await;
    let gw = start_gateway(test_config(&[&a, &b])).await;
    let body = chat_body(&[("user", "A long one.")], json!({"stream": true, "max_tokens": 600, "temperature": 0}));
    let expected = chat_answer(&b, &body).await;
    let drain = async {
        let started = std::time::Instant::now();
        let url = format!("{}/admin/v1/replicas/a/drain?wait=true&handoff=true&timeout=30", gw.admin);
        let (status, _) = admin("POST", &url, None, None).await;
        assert_eq!(status, 200);
        assert!(started.elapsed() < Duration::from_secs(3), "the drain returned in {:?}", started.elapsed());
    };
    let got = on_a_then(&gw, "/v1/chat/completions", &body, drain).await;
    assert_eq!(got.replica, "a");
    assert_eq!(got.text(), expected, "whole, word for word");
    assert_eq!(got.done, 1);
    let continued = events_of(&gw, "stream_continued").await;
    assert!(continued[0]["detail"].as_str().unwrap().contains("drained"), "{continued:?}");
    assert!(a.state.cancelled() >= 1, "the draining replica's stream was cut");
}

/// The continued event says a -> b, not exact; the next turn (`next`, a
/// request of the same conversation to `path`) goes to b.
async fn moved_from_text(gw: &Gw, dialect: &str, path: &str, next: &Value) {
    let continued = events_of(gw, "stream_continued").await;
    assert_eq!(continued.len(), 1, "{continued:?}");
    assert_eq!((continued[0]["replica"].as_str(), continued[0]["to_replica"].as_str()), (Some("a"), Some("b")));
    assert!(continued[0]["detail"].as_str().unwrap().contains("after 150 tokens (exact: false"), "{continued:?}");
    let follow = post(&format!("{}{path}", gw.base), next).await;
    assert_eq!(follow.replica, "b", "the pin moved to the replica that finished the answer");
    let metric =
        format!(r#"prefixgate_streams_continued_total{{dialect="{dialect}",reason="replica_failed",exact="false"}} 1"#);
    assert!(scrape(gw).await.contains(&metric), "{metric}");
}

#[actix_web::test]
async fn a_responses_stream_whose_replica_dies_goes_on_in_the_same_output_item() {
    let (_a, b, gw) = fleet(dies_at_150(), Default::default()).await;
    let input = json!([{"role": "user", "content": "Tell me about caches."}]);
    let body = json!({"model": "sim-model", "instructions": "You are terse.", "input": input, "max_output_tokens": 400,
        "temperature": 0, "stream": true, "store": false});
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let expected = post(&format!("{}/v1/responses", b.url), &whole).await.body["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let got = on_a(&gw, "/v1/responses", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(got.text(), expected, "the uninterrupted answer, word for word");
    let sequence: Vec<u64> = got.events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(sequence, (0..sequence.len() as u64).collect::<Vec<_>>(), "sequence numbers go on");
    let items: std::collections::HashSet<&str> =
        got.of_type("response.output_text.delta").iter().map(|e| e["item_id"].as_str().unwrap()).collect();
    assert_eq!(items.len(), 1, "one output item: {items:?}");
    assert_eq!(got.of_type("response.output_text.done")[0]["text"], json!(expected));
    let completed = got.of_type("response.completed");
    assert_eq!(completed.len(), 1, "one terminal event");
    assert_eq!(got.events.last().unwrap()["type"], "response.completed", "and it ends the stream");
    let response = &completed[0]["response"];
    assert_eq!(response["id"], got.of_type("response.created")[0]["response"]["id"], "the first leg's id");
    assert_eq!(response["output"][0]["content"][0]["text"], json!(expected));
    assert_eq!(response["usage"]["output_tokens"], 400);
    let next = json!({"model": "sim-model", "instructions": "You are terse.", "store": false, "input": [
        input[0], {"role": "assistant", "content": expected}, {"role": "user", "content": "And then?"}]});
    moved_from_text(&gw, "responses", "/v1/responses", &next).await;
}

#[actix_web::test]
async fn a_messages_stream_whose_replica_dies_goes_on_in_the_same_content_block() {
    let (_a, b, gw) = fleet(dies_at_150(), Default::default()).await;
    let user = json!({"role": "user", "content": "Tell me about caches."});
    let body = json!({"model": "sim-model", "system": "You are terse.", "messages": [user], "max_tokens": 400,
        "temperature": 0, "stream": true});
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let expected =
        post(&format!("{}/v1/messages", b.url), &whole).await.body["content"][0]["text"].as_str().unwrap().to_string();
    let got = on_a(&gw, "/v1/messages", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(got.text(), expected, "the uninterrupted answer, word for word");
    assert!(got.of_type("content_block_delta").iter().all(|e| e["index"] == 0), "one content block");
    assert_eq!(got.of_type("message_start").len(), 1);
    assert_eq!(got.of_type("content_block_stop").len(), 1);
    let delta = got.of_type("message_delta");
    assert_eq!(delta.len(), 1);
    assert_eq!(
        (delta[0]["delta"]["stop_reason"].clone(), delta[0]["usage"]["output_tokens"].clone()),
        (json!("max_tokens"), json!(400))
    );
    assert_eq!(got.of_type("message_stop").len(), 1, "one terminal event");
    assert_eq!(got.events.last().unwrap()["type"], "message_stop");
    let next = json!({"model": "sim-model", "system": "You are terse.", "max_tokens": 4, "messages": [
        user, {"role": "assistant", "content": expected}, {"role": "user", "content": "And then?"}]});
    moved_from_text(&gw, "messages", "/v1/messages", &next).await;
}

/// llama-server's way: no token ids, a completion stream's usage in its
/// finish chunk, a chat stream's only when asked.
fn like_llama_server(sim: SimConfig) -> SimConfig {
    SimConfig { no_token_ids: true, usage_in_finish_chunk: true, ..sim }
}

#[actix_web::test]
async fn on_an_engine_without_ids_that_puts_usage_in_its_finish_chunk_a_broken_stream_reports_the_whole_answers_usage()
{
    let a = start_sim("a", like_llama_server(dies_at_150())).await;
    let b = start_sim("b", like_llama_server(slow_decoder(400.0))).await;
    let gw = start_gateway(test_config(&[&a, &b])).await;
    let whole = |body: &Value| {
        let mut whole = body.clone();
        whole["stream"] = json!(false);
        whole
    };

    let chat = chat_body(
        &[("system", "You are terse."), ("user", "Tell me about caches.")],
        json!({"stream": true, "max_tokens": 400, "temperature": 0, "stream_options": {"include_usage": true}}),
    );
    let expected = post(&format!("{}/v1/chat/completions", b.url), &whole(&chat)).await.body["usage"].clone();
    let got = on_a(&gw, "/v1/chat/completions", &chat).await;
    assert_eq!(got.replica, "a");
    let usage: Vec<&Value> = got.events.iter().filter(|e| !e["usage"].is_null()).collect();
    assert_eq!(usage.len(), 1, "the usage chunk the client asked for: {}", got.raw);
    assert_eq!(usage[0]["choices"], json!([]), "a chunk of its own");
    for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[0]["usage"][key], expected[key], "{key}: {}", usage[0]);
    }

    let responses = json!({"model": "sim-model", "instructions": "You are terse.", "max_output_tokens": 400,
        "input": [{"role": "user", "content": "Tell me about caches."}], "temperature": 0, "stream": true, "store": false});
    let expected = post(&format!("{}/v1/responses", b.url), &whole(&responses)).await.body["usage"].clone();
    let got = on_a(&gw, "/v1/responses", &responses).await;
    let completed = got.of_type("response.completed");
    assert_eq!(completed.len(), 1, "{}", got.raw);
    let usage = &completed[0]["response"]["usage"];
    for key in ["input_tokens", "output_tokens", "total_tokens"] {
        assert_eq!(usage[key], expected[key], "{key}: {usage}");
    }

    let messages = json!({"model": "sim-model", "system": "You are terse.", "max_tokens": 400, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about caches."}], "stream": true});
    let expected = post(&format!("{}/v1/messages", b.url), &whole(&messages)).await.body["usage"].clone();
    let got = on_a(&gw, "/v1/messages", &messages).await;
    let delta = got.of_type("message_delta");
    assert_eq!(delta.len(), 1, "{}", got.raw);
    assert_eq!(delta[0]["usage"]["output_tokens"], expected["output_tokens"]);
    let continued = events_of(&gw, "stream_continued").await;
    assert_eq!(continued.len(), 3, "every stream went on: {continued:?}");
}

/// "a" dies after 150 tokens; "b" calls the request's first tool after 20
/// tokens of the next leg, as an engine's tool parser hands a call over.
async fn calls_after_the_seam() -> (Sim, Sim, Gw) {
    let a = start_sim("a", dies_at_150()).await;
    let b = start_sim("b", SimConfig { tool_call_after_tokens: Some(20), ..slow_decoder(400.0) }).await;
    let gw = start_gateway(test_config(&[&a, &b])).await;
    (a, b, gw)
}

#[actix_web::test]
async fn a_responses_stream_whose_model_calls_a_tool_after_the_seam_delivers_a_function_call_item() {
    let (_a, b, gw) = calls_after_the_seam().await;
    let body = json!({"model": "sim-model", "instructions": "Use tools.", "max_output_tokens": 400, "temperature": 0,
        "input": [{"role": "user", "content": "List the files."}], "stream": true, "store": false,
        "tools": [{"type": "function", "name": "ls", "description": "list", "parameters": {"type": "object"}}]});
    let got = on_a(&gw, "/v1/responses", &body).await;
    assert_eq!(got.replica, "a");
    assert_eq!(b.state.received(), 1, "the next leg went to b's chat endpoint");
    let words: String = prefixgate::sim::WORDS.iter().cycle().take(170).copied().collect();
    assert_eq!(got.text(), words, "150 words before the seam, 20 after it, then the call");
    let sequence: Vec<u64> = got.events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(sequence, (0..sequence.len() as u64).collect::<Vec<_>>(), "sequence numbers go on");
    let added: Vec<&Value> = got
        .of_type("response.output_item.added")
        .into_iter()
        .filter(|e| e["item"]["type"] == "function_call")
        .collect();
    assert_eq!(added.len(), 1, "{}", got.raw);
    assert_eq!((added[0]["item"]["name"].as_str(), added[0]["output_index"].as_u64()), (Some("ls"), Some(1)));
    let args = got.of_type("response.function_call_arguments.done");
    assert_eq!(args.len(), 1);
    assert_eq!(args[0]["arguments"], "{}");
    let completed = got.of_type("response.completed");
    assert_eq!(completed.len(), 1, "one terminal event");
    assert_eq!(got.events.last().unwrap()["type"], "response.completed");
    let output = completed[0]["response"]["output"].as_array().unwrap();
    let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["message", "function_call"]);
    assert_eq!(output[0]["content"][0]["text"], json!(words));
    assert_eq!((output[1]["name"].as_str(), output[1]["arguments"].as_str()), (Some("ls"), Some("{}")));
    assert_eq!(output[1]["call_id"], added[0]["item"]["call_id"]);
}

#[actix_web::test]
async fn a_messages_stream_whose_model_calls_a_tool_after_the_seam_delivers_a_tool_use_block() {
    let (_a, b, gw) = calls_after_the_seam().await;
    let body = json!({"model": "sim-model", "system": "Use tools.", "max_tokens": 400, "temperature": 0, "stream": true,
        "messages": [{"role": "user", "content": "List the files."}],
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]});
    let got = on_a(&gw, "/v1/messages", &body).await;
    assert_eq!(b.state.received(), 1, "the next leg went to b's chat endpoint");
    let words: String = prefixgate::sim::WORDS.iter().cycle().take(170).copied().collect();
    assert_eq!(got.text(), words);
    let starts = got.of_type("content_block_start");
    let kinds: Vec<(&str, u64)> =
        starts.iter().map(|e| (e["content_block"]["type"].as_str().unwrap(), e["index"].as_u64().unwrap())).collect();
    assert_eq!(kinds, [("text", 0), ("tool_use", 1)], "{}", got.raw);
    assert_eq!(starts[1]["content_block"]["name"], "ls");
    let json: String = got
        .of_type("content_block_delta")
        .iter()
        .filter(|e| e["delta"]["type"] == "input_json_delta")
        .map(|e| e["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(json, "{}");
    let stops: Vec<u64> = got.of_type("content_block_stop").iter().map(|e| e["index"].as_u64().unwrap()).collect();
    assert_eq!(stops, [0, 1], "each block closed once, in order");
    let delta = got.of_type("message_delta");
    assert_eq!(delta.len(), 1);
    assert_eq!(
        (delta[0]["delta"]["stop_reason"].as_str(), delta[0]["usage"]["output_tokens"].as_u64()),
        (Some("tool_use"), Some(171))
    );
    assert_eq!(got.events.last().unwrap()["type"], "message_stop");
}

#[actix_web::test]
async fn across_instances_sharing_a_store_the_resumed_legs_starting_at_once_are_bounded_per_model() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let a = start_sim("a", dies_at_150()).await;
    let b = start_sim("b", slow_decoder(400.0)).await;
    let mut config = crate::shared::on_redis(test_config(&[&a, &b]), &redis, "gw0");
    config.failover.max_resuming = 1;
    let gw = start_gateway(config).await;
    // Another instance's resumed leg of this model is starting: it holds the fleet's one start.
    use prefixgate::store::Store;
    let other = prefixgate::store::RedisStore::open(&redis.url, "gw1").await.unwrap();
    assert!(other.try_lease("resume:sim-model", "gw1:0", 1, 60_000).await.unwrap());
    let body = chat_body(&[("user", "Go on.")], json!({"stream": true, "max_tokens": 400, "temperature": 0}));
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_eq!(got.done, 0, "not continued: the stream ended broken");
    let refused = events_of(&gw, "stream_not_continued").await;
    assert!(refused[0]["detail"].as_str().unwrap().contains("too_many_resuming"), "{refused:?}");
    // Its start given back, the next break goes on.
    other.release_lease("resume:sim-model", "gw1:0").await.unwrap();
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_eq!((got.done, got.count(|e| !e["choices"][0]["delta"]["content"].is_null())), (1, 400));
    assert_eq!(events_of(&gw, "stream_continued").await.len(), 1);
}

#[actix_web::test]
async fn a_drain_with_hand_over_on_one_instance_moves_the_streams_of_every_instance() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    // "a" would take 60 s for the answer; "b" is quick.
    let a = start_sim("a", slow_decoder(10.0)).await;
    let b = start_sim("b", slow_decoder(1_000.0)).await;
    let gw0 = start_gateway(crate::shared::on_redis(test_config(&[&a, &b]), &redis, "gw0")).await;
    let gw1 = start_gateway(crate::shared::on_redis(test_config(&[&a, &b]), &redis, "gw1")).await;
    let body = chat_body(&[("user", "A long one.")], json!({"stream": true, "max_tokens": 600, "temperature": 0}));
    let drain_on_gw0 = async {
        let url = format!("{}/admin/v1/replicas/a/drain?handoff=true", gw0.admin);
        assert_eq!(admin("POST", &url, None, None).await.0, 200);
    };
    let started = std::time::Instant::now();
    let got = on_a_then(&gw1, "/v1/chat/completions", &body, drain_on_gw0).await;
    assert_eq!(got.replica, "a");
    assert!(started.elapsed() < Duration::from_secs(20), "moved, not finished on a: {:?}", started.elapsed());
    assert_eq!((got.done, got.count(|e| !e["choices"][0]["delta"]["content"].is_null())), (1, 600), "whole");
    let continued = events_of(&gw1, "stream_continued").await;
    assert!(continued[0]["detail"].as_str().unwrap().contains("drained"), "{continued:?}");
}

#[actix_web::test]
async fn a_chat_stream_that_offers_tools_goes_on_through_the_chat_endpoint_so_a_tool_call_after_the_seam_is_parsed() {
    let (_a, b, gw) = fleet(dies_at_150(), Default::default()).await;
    let tools = json!([{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]);
    let extra = json!({"stream": true, "temperature": 0, "max_tokens": 400, "tools": tools,
        "stream_options": {"include_usage": true}});
    let body = chat_body(&[("user", "Look around.")], extra);
    let expected = chat_answer(&b, &body).await;
    let got = on_a(&gw, "/v1/chat/completions", &body).await;
    assert_one_chat_answer(&got, &expected);
    let continued = events_of(&gw, "stream_continued").await;
    let detail = continued[0]["detail"].as_str().unwrap();
    assert!(detail.contains("after 150 tokens (exact: false"), "resumed from its text, through chat: {detail}");
}
