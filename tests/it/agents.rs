//! Issue 10: the agent dialects through the gateway, on simulated replicas
//! that speak them: the Responses API (with stored responses), the
//! Anthropic Messages API, and explicit session keys.

use crate::common::*;
use serde_json::{json, Value};

async fn two_replicas() -> (Sim, Sim, Gw) {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    (a, b, gw)
}

fn responses_cached(r: &Reply) -> u64 {
    r.body["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[actix_web::test]
async fn a_responses_agent_loop_stays_on_its_replica_and_one_shots_spread() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/responses", gw.base);
    let mut input = vec![json!({"role": "user", "content": text("codex task", 2_000)})];
    let mut home = String::new();
    for turn in 0..4 {
        let body = json!({"model": "sim-model", "instructions": "You are Codex.", "input": input, "max_output_tokens": 4, "store": false});
        let r = post_with(&url, &body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if turn == 0 {
            home = r.replica.clone();
            assert_eq!(r.route, "spread");
        } else {
            assert_eq!((r.replica.as_str(), r.route.as_str()), (home.as_str(), "pinned"), "turn {turn}");
            assert!(responses_cached(&r) > 1_000, "turn {turn} is warm: {}", r.body["usage"]);
        }
        input.push(r.body["output"][0].clone());
        input.push(json!({"type": "function_call_output", "call_id": format!("c{turn}"), "output": "ok"}));
        input.push(json!({"role": "user", "content": format!("next {turn}")}));
    }
    let mut used = std::collections::HashSet::new();
    for i in 0..4 {
        let r = post_with(&url, &json!({"model": "sim-model", "input": format!("one-shot {i}")}), &[]).await;
        assert_eq!(r.route, "spread");
        used.insert(r.replica);
    }
    assert_eq!(used.len(), 2, "one-shots use every replica");
    gw.stop().await;
}

#[actix_web::test]
async fn previous_response_id_is_a_hard_pin_for_every_request_that_names_it() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/responses", gw.base);
    let first =
        post_with(&url, &json!({"model": "sim-model", "input": text("stored", 2_000), "max_output_tokens": 4}), &[])
            .await;
    assert_eq!(first.status, 200);
    let (home, mut prev) = (first.replica.clone(), first.body["id"].as_str().unwrap().to_string());
    for turn in 0..4 {
        // Streamed and not: the id is read from the body or from response.created.
        let stream = turn % 2 == 1;
        let body = json!({"model": "sim-model", "input": format!("turn {turn}"), "previous_response_id": prev, "max_output_tokens": 4, "stream": stream});
        let r = post_with(&url, &body, &[]).await;
        assert_eq!((r.status, r.replica.as_str(), r.route.as_str()), (200, home.as_str(), "response"), "turn {turn}");
        prev = if stream {
            let text = r.body.as_str().unwrap().to_string();
            assert!(text.contains("event: response.completed"));
            let created = text
                .lines()
                .find(|l| l.contains("response.created"))
                .and_then(|l| l.strip_prefix("data: "))
                .map(|d| serde_json::from_str::<Value>(d).unwrap());
            match created {
                Some(ev) => ev["response"]["id"].as_str().unwrap().to_string(),
                None => text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .map(|d| serde_json::from_str::<Value>(d).unwrap())
                    .find(|v| v["type"] == "response.created")
                    .unwrap()["response"]["id"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            }
        } else {
            assert!(responses_cached(&r) > 1_000, "a stored continuation is warm: {}", r.body["usage"]);
            r.body["id"].as_str().unwrap().to_string()
        };
    }
    // Reads, listings, cancels and deletes of a stored response go to its replica too.
    for (method, path) in [
        ("GET", format!("/v1/responses/{prev}")),
        ("GET", format!("/v1/responses/{prev}/input_items")),
        ("POST", format!("/v1/responses/{prev}/cancel")),
        ("DELETE", format!("/v1/responses/{prev}")),
    ] {
        let mut resp = client().request(method.parse().unwrap(), format!("{}{path}", gw.base)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{method} {path}: {:?}", resp.body().await);
        assert_eq!(resp.headers().get("x-prefixgate-replica").unwrap(), home.as_str(), "{method} {path}");
        assert_eq!(resp.headers().get("x-prefixgate-route").unwrap(), "response");
    }
    // An id nobody recorded is forwarded (spread) and the engine answers for itself.
    let r = post_with(&url, &json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_unknown"}), &[])
        .await;
    assert_eq!((r.status, r.route.as_str()), (404, "spread"));
    gw.stop().await;
}

#[actix_web::test]
async fn a_stored_response_whose_replica_is_gone_is_a_clear_error_never_a_silent_move() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/responses", gw.base);
    let first = post_with(&url, &json!({"model": "sim-model", "input": "remember me"}), &[]).await;
    let (home, id) = (first.replica.clone(), first.body["id"].as_str().unwrap().to_string());
    let follow = json!({"model": "sim-model", "input": "again", "previous_response_id": id});
    // Draining: follow-ups are still served until the drain completes.
    gw.gw.operator.drain(&home).await.unwrap();
    let r = post_with(&url, &follow, &[]).await;
    assert_eq!((r.status, r.replica.as_str()), (200, home.as_str()));
    // Disabled: a clear 503 naming the replica, in OpenAI's shape.
    gw.gw.operator.disable(&home).await.unwrap();
    let r = post_with(&url, &follow, &[]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["error"]["code"], "response_replica_unavailable");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&id) && msg.contains(&format!("'{home}'")) && msg.contains("disabled"), "{msg}");
    // Removed: a 404 that says so.
    gw.gw.operator.remove_replica(&home).await.unwrap();
    let r = post_with(&url, &follow, &[]).await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("response_replica_removed")));
    assert!(r.body["error"]["message"].as_str().unwrap().contains("removed from the fleet"));
    gw.stop().await;
}

fn anthropic_turns(n: usize) -> Vec<Value> {
    // A Claude-Code-style history: tool use and results, cache_control on the newest message only.
    let mut msgs = vec![json!({"role": "user", "content": [{"type": "text", "text": text("claude task", 2_000)}]})];
    for t in 0..n {
        msgs.push(json!({"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": "sig"}, {"type": "tool_use", "id": format!("tu{t}"), "name": "bash", "input": {"cmd": "ls"}}]}));
        msgs.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("tu{t}"), "content": format!("file{t}.rs")}]}));
    }
    if let Some(last) = msgs.last_mut() {
        last["content"][0]["cache_control"] = json!({"type": "ephemeral"});
    }
    msgs
}

#[actix_web::test]
async fn a_messages_agent_loop_is_pinned_and_cached_with_cache_control_moving() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/messages", gw.base);
    let mut home = String::new();
    for turn in 0..4 {
        let body = json!({"model": "sim-model", "max_tokens": 4, "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
                          "tools": [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}], "messages": anthropic_turns(turn), "stream": turn == 3});
        let r = post_with(&url, &body, &[("anthropic-version", "2023-06-01")]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if turn == 0 {
            home = r.replica.clone();
            continue;
        }
        assert_eq!((r.replica.as_str(), r.route.as_str()), (home.as_str(), "pinned"), "turn {turn}");
        if turn < 3 {
            assert!(r.body["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 1_000, "{}", r.body["usage"]);
        } else {
            assert!(r.body.as_str().unwrap().contains("event: message_stop"));
        }
    }
    // Receipts: the streamed turn's cache reads reached the metrics too.
    let (_, text) = {
        let mut resp = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
        ((), String::from_utf8(resp.body().limit(1 << 22).await.unwrap().to_vec()).unwrap())
    };
    let cached: u64 = text
        .lines()
        .filter(|l| l.starts_with("prefixgate_cached_tokens_total{") && l.contains("route=\"pinned\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(cached > 3_000, "{text}");
    gw.stop().await;
}

#[actix_web::test]
async fn messages_errors_come_in_anthropics_shape() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/messages", gw.base);
    let r = post_with(
        &url,
        &json!({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!((r.body["type"].as_str(), r.body["error"]["type"].as_str()), (Some("error"), Some("not_found_error")));
    assert!(r.body["error"]["message"].as_str().unwrap().contains("no-such-model"));
    let mut raw =
        client().post(&url).insert_header(("content-type", "application/json")).send_body("{not json").await.unwrap();
    assert_eq!(raw.status(), 400);
    let v: Value = raw.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // The same mistake on the Responses API answers in OpenAI's shape.
    let r =
        post_with(&format!("{}/v1/responses", gw.base), &json!({"model": "no-such-model", "input": "hi"}), &[]).await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("model_not_found")));
    gw.stop().await;
}

#[actix_web::test]
async fn session_keys_pin_compacted_histories_and_subagents_are_spread() {
    let (_a, _b, gw) = two_replicas().await;
    let url = format!("{}/v1/messages", gw.base);
    let msg = |t: &str| json!({"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": t}]});
    let session = [("x-claude-code-session-id", "sess-1")];
    let first = post_with(&url, &msg("start"), &session).await;
    // A compacted history shares no prefix with the first turn: the session keeps it home.
    for i in 0..3 {
        let r = post_with(&url, &msg(&format!("summary of everything so far, take {i}")), &session).await;
        assert_eq!((r.replica.as_str(), r.route.as_str()), (first.replica.as_str(), "session"));
    }
    // Parallel subagents of that session: told apart by agent id, so spread.
    let mut used = std::collections::HashSet::new();
    for agent in ["sub-1", "sub-2", "sub-3", "sub-4"] {
        let r = post_with(
            &url,
            &msg(&format!("subtask for {agent}")),
            &[("x-claude-code-session-id", "sess-1"), ("x-claude-code-agent-id", agent)],
        )
        .await;
        assert_eq!(r.route, "spread", "{agent}");
        used.insert(r.replica);
    }
    assert_eq!(used.len(), 2, "subagents use every replica");
    // prompt_cache_key does the same for OpenAI clients; absurd keys are refused.
    let chat_url = format!("{}/v1/chat/completions", gw.base);
    let keyed = |t: &str| chat_body(&[("user", t)], json!({"prompt_cache_key": "conv-9"}));
    let r1 = post(&chat_url, &keyed("first")).await;
    let r2 = post(&chat_url, &keyed("compacted")).await;
    assert_eq!((r2.replica.as_str(), r2.route.as_str()), (r1.replica.as_str(), "session"));
    let long = chat_body(&[("user", "x")], json!({"prompt_cache_key": "k".repeat(600)}));
    let r = post(&chat_url, &long).await;
    assert_eq!(r.status, 400);
    assert!(r.body["error"]["message"].as_str().unwrap().contains("512 bytes"));
    // The pin view says which dialect and which key kind pinned it.
    let (_, pins) = admin("GET", &format!("{}/admin/v1/pins?limit=100", gw.admin), None, None).await;
    let kinds: std::collections::HashSet<(String, String)> = pins["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["dialect"].as_str().unwrap().to_string(), p["pinned_by"].as_str().unwrap().to_string()))
        .collect();
    for want in [("messages", "session_header"), ("messages", "prefix"), ("chat", "prompt_cache_key")] {
        assert!(kinds.contains(&(want.0.to_string(), want.1.to_string())), "{want:?} in {kinds:?}");
    }
    gw.stop().await;
}

/// Issue 25: a response id goes to a replica only as one path segment, and
/// an id nobody holds is looked for once per window, not on every request.
#[actix_web::test]
async fn response_ids_stay_one_segment_and_an_unknown_id_is_asked_about_once() {
    let (a, b, gw) = two_replicas().await;
    let url = format!("{}/v1/responses", gw.base);
    let lookups =
        |sim: &Sim| sim.state.seen.lock().unwrap().iter().filter(|l| l.starts_with("GET /v1/responses/")).count();
    for bad in ["../../v1/models", "a/b", "x?y=1", "x#y"] {
        let r = post_with(&url, &json!({"model": "sim-model", "input": "x", "previous_response_id": bad}), &[]).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("previous_response_id: "), "{message}");
    }
    for path in ["/v1/responses/..%2F..%2Fv1%2Fmodels", "/v1/responses/a%3Fb"] {
        let mut resp = client().get(format!("{}{path}", gw.base)).send().await.unwrap();
        assert_eq!(resp.status(), 400, "{path}: {:?}", resp.body().await);
    }
    assert_eq!((lookups(&a), lookups(&b)), (0, 0), "a refused id reached no replica");
    // The same unknown id ten times: each replica is asked once.
    for _ in 0..10 {
        let r =
            post_with(&url, &json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_nobody"}), &[])
                .await;
        assert_eq!(r.status, 404, "{}", r.body);
    }
    assert_eq!((lookups(&a), lookups(&b)), (1, 1));
    gw.stop().await;
}
