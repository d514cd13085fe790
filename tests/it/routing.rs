//! Issue 2 end to end: shape routing, streaming, failover, limits and errors,
//! against simulated replicas on loopback.

use std::time::Duration;

use crate::common::*;
use futures_util::StreamExt;
use prefixgate::events::EventKind;
use serde_json::json;

#[actix_web::test]
async fn single_turn_requests_spread_and_a_conversation_stays_warm_on_its_replica() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;

    let mut seen = Vec::new();
    for i in 0..6 {
        let r = chat(&gw, &[("user", &format!("one-shot question {i}"))]).await;
        assert_eq!((r.status, r.route.as_str()), (200, "spread"));
        seen.push(r.replica);
    }
    assert!(seen.windows(2).all(|w| w[0] != w[1]), "consecutive spread picks alternate: {seen:?}");

    // A conversation whose first turn is tiny, then grows with a long context.
    let context = text("ctx", 2_000);
    let first = chat(&gw, &[("user", "hi")]).await;
    let mut history = vec![("user".to_string(), "hi".to_string())];
    for turn in 1..6 {
        history.push(("assistant".into(), format!("answer {turn}")));
        history.push(("user".into(), if turn == 1 { context.clone() } else { format!("follow-up {turn}") }));
        let msgs: Vec<(&str, &str)> = history.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        let r = chat(&gw, &msgs).await;
        assert_eq!(
            (r.status, r.route.as_str(), r.replica.as_str()),
            (200, "pinned", first.replica.as_str()),
            "turn {turn}"
        );
        if turn >= 3 {
            // The replica reports the prefix as cached: the pin was real.
            assert!(cached_tokens(&r) >= 1_900, "turn {turn}: cached {}", cached_tokens(&r));
            let predicted: u64 =
                r.headers.get("x-prefixgate-predicted-cached-tokens").unwrap().to_str().unwrap().parse().unwrap();
            assert!(predicted >= 1_900, "predicted {predicted}");
        }
    }
    gw.stop().await;
}

#[actix_web::test]
async fn the_first_chunk_reaches_the_client_while_the_replica_is_still_generating() {
    // 5 tokens per simulated second at full time scale: 2 s of generation.
    let slow = start_sim("slow", slow_decoder(5.0)).await;
    let gw = start_gateway(test_config(&[&slow])).await;
    let body = chat_body(&[("user", "stream please")], json!({"stream": true, "max_tokens": 10}));
    let mut resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("x-prefixgate-route").unwrap(), "spread");
    let first = resp.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    assert_eq!(slow.state.running(), 1, "the replica is still generating when the client has its first chunk");
    let mut rest = Vec::new();
    while let Some(chunk) = resp.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    gw.stop().await;
}

#[actix_web::test]
async fn a_stopped_replica_is_failed_over_six_requests_six_200s_one_failover() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut config = test_config(&[&a, &b]);
    // Only the request path may notice the stop: no probe between.
    config.health.interval_ms = 3_600_000;
    let gw = start_gateway(config).await;
    b.stop(true).await;
    let requests = (0..6).map(|i| {
        let url = format!("{}/v1/chat/completions", gw.base);
        async move { post(&url, &chat_body(&[("user", &format!("during the stop {i}"))], json!({}))).await }
    });
    let replies = futures_util::future::join_all(requests).await;
    assert!(
        replies.iter().all(|r| r.status == 200 && r.replica == "a"),
        "{:?}",
        replies.iter().map(|r| (r.status, &r.replica)).collect::<Vec<_>>()
    );
    assert!(replies.iter().any(|r| r.route == "failover"));
    assert_eq!(gw.gw.events.count(EventKind::Failover), 1, "one failover per replica transition");
    assert_eq!(gw.gw.fleet.get("b").unwrap().health(), prefixgate::fleet::Health::Down);
    gw.stop().await;
}

#[actix_web::test]
async fn with_continuation_off_a_replica_dying_mid_stream_ends_that_stream_with_an_error_and_nothing_is_retried() {
    let slow = slow_decoder(5.0);
    let (a, b) = (start_sim("a", slow.clone()).await, start_sim("b", slow).await);
    let failover = prefixgate::config::FailoverConfig { continue_streams: false, ..Default::default() };
    let gw = start_gateway(prefixgate::config::Config { failover, ..test_config(&[&a, &b]) }).await;
    let body = chat_body(&[("user", "a long answer please")], json!({"stream": true, "max_tokens": 50}));
    let mut resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
    let serving = resp.headers().get("x-prefixgate-replica").unwrap().to_str().unwrap().to_string();
    let (dying, other) = if serving == "a" { (&a, &b) } else { (&b, &a) };
    let _first = resp.next().await.unwrap().unwrap();
    dying.stop(false).await;
    let mut rest = Vec::new();
    while let Some(chunk) = resp.next().await {
        match chunk {
            Ok(c) => rest.extend_from_slice(&c),
            Err(e) => rest.extend_from_slice(format!("<client error: {e}>").as_bytes()),
        }
    }
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("\"error\"") && !text.contains("[DONE]"), "{text}");
    assert_eq!(other.state.received(), 0, "nothing was re-sent after the stream started");
    let r = gw.gw.fleet.get(&serving).unwrap();
    wait_until("in-flight back to zero", Duration::from_secs(5), || r.inflight() == 0 && r.large_inflight() == 0).await;
    gw.stop().await;
}

/// A chat request written by hand on a new connection to the gateway at
/// `base`, so a test sees the reply's bytes as they arrive; `extra_headers`
/// are whole header lines.
async fn raw_chat_request(base: &str, body: &str, extra_headers: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = base.trim_start_matches("http://");
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    sock
}

#[actix_web::test]
async fn a_client_leaving_mid_stream_cancels_the_upstream_and_releases_counters() {
    use tokio::io::AsyncReadExt;
    let slow = start_sim("a", slow_decoder(10.0)).await;
    let gw = start_gateway(test_config(&[&slow])).await;
    let body = chat_body(&[("user", "stream then hang up")], json!({"stream": true, "max_tokens": 100})).to_string();
    let mut sock = raw_chat_request(&gw.base, &body, "").await;
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = sock.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    drop(sock);
    let r = gw.gw.fleet.get("a").unwrap();
    wait_until("upstream cancelled", Duration::from_secs(10), || slow.state.cancelled() == 1).await;
    wait_until("counters released", Duration::from_secs(5), || r.inflight() == 0 && slow.state.running() == 0).await;
    gw.stop().await;
}

#[actix_web::test]
async fn bad_input_gets_openai_errors_and_is_not_forwarded() {
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    config.limits.max_body_bytes = 1_000;
    let gw = start_gateway(config).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.base);
    for (body, status, code) in [
        ("{not json".to_string(), 400, "invalid_request"),
        (r#"{"model":"sim-model","messages":"hi"}"#.to_string(), 400, "invalid_request"),
        (
            format!(r#"{{"model":"sim-model","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(2_000)),
            413,
            "body_too_large",
        ),
        (r#"{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}"#.to_string(), 404, "model_not_found"),
    ] {
        let mut resp = c.post(&url).insert_header(("content-type", "application/json")).send_body(body).await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().len() > 5);
        assert!(v["error"]["type"].is_string());
    }
    assert_eq!(a.state.received(), 0, "nothing unroutable was forwarded");
    gw.stop().await;
}

#[actix_web::test]
async fn no_routable_replica_is_a_503_with_retry_after_and_recovery_is_automatic() {
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    let r = gw.gw.fleet.get("a").unwrap();
    gw.gw.operator.set_admin("a", prefixgate::fleet::AdminState::Disabled).await.unwrap();
    let mut resp = client()
        .post(format!("{}/v1/chat/completions", gw.base))
        .send_json(&chat_body(&[("user", "x")], json!({})))
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers().get("retry-after").unwrap(), "1");
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_routable_replica");
    gw.gw.operator.set_admin("a", prefixgate::fleet::AdminState::Active).await.unwrap();
    assert_eq!(chat(&gw, &[("user", "x")]).await.status, 200);
    assert_eq!(r.inflight(), 0);
    gw.stop().await;
}

#[actix_web::test]
async fn models_are_the_union_and_each_model_goes_only_to_its_replicas() {
    let a = start_sim("a", prefixgate::sim::SimConfig { model: "m1".into(), ..fast_sim() }).await;
    let b = start_sim("b", prefixgate::sim::SimConfig { model: "m2".into(), ..fast_sim() }).await;
    let gw = start_gateway(test_config(&[&a, &b])).await;
    wait_until("models known", Duration::from_secs(5), || {
        gw.gw.fleet.snapshot().iter().all(|r| !r.models().is_empty())
    })
    .await;
    let mut resp = client().get(format!("{}/v1/models", gw.base)).send().await.unwrap();
    let v: serde_json::Value = resp.json().await.unwrap();
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["m1", "m2"]);
    for i in 0..4 {
        for (model, replica) in [("m1", "a"), ("m2", "b")] {
            let body =
                json!({"model": model, "messages": [{"role": "user", "content": format!("q{i}")}], "max_tokens": 2});
            let r = post(&format!("{}/v1/chat/completions", gw.base), &body).await;
            assert_eq!((r.status, r.replica.as_str()), (200, replica));
        }
    }
    gw.stop().await;
}

#[actix_web::test]
async fn completions_and_other_paths_are_forwarded_byte_for_byte() {
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    let prompt = text("completion", 1_000);
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2});
    let first = post(&format!("{}/v1/completions", gw.base), &body).await;
    assert_eq!(first.status, 200);
    let longer = json!({"model": "sim-model", "prompt": format!("{prompt} and more"), "max_tokens": 2});
    let second = post(&format!("{}/v1/completions", gw.base), &longer).await;
    assert_eq!(second.route, "pinned");
    assert!(cached_tokens(&second) > 900);
    // Unknown /v1 paths reach the replica (which answers 404 itself).
    let mut resp = client()
        .post(format!("{}/v1/embeddings", gw.base))
        .send_json(&json!({"model": "sim-model", "input": "x"}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers().get("x-prefixgate-replica").unwrap(), "a");
    let _ = resp.body().await;
    gw.stop().await;
}

#[actix_web::test]
async fn a_reply_keeps_the_upstreams_framing_and_content_type() {
    use tokio::io::AsyncReadExt;
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    let body = chat_body(&[("user", "framing")], json!({"max_tokens": 4})).to_string();
    let mut sock = raw_chat_request(&gw.base, &body, "connection: close\r\n").await;
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, reply) = text.split_once("\r\n\r\n").expect("a head and a body");
    let head = head.to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("the upstream's length is kept")
        .parse()
        .unwrap();
    assert_eq!(length, reply.len(), "{head}");
    assert!(!head.contains("transfer-encoding"), "a reply with a length is not chunked: {head}");
    let content_types: Vec<&str> = head.lines().filter_map(|l| l.strip_prefix("content-type: ")).collect();
    assert_eq!(content_types, ["application/json"], "the upstream's content type, once: {head}");
    gw.stop().await;
}
