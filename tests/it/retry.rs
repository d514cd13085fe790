//! The retry rule (`src/proxy/attempt.rs`, docs/operations.md, "Failover"), one test per
//! case, against hand-written replicas that fail in exactly one way beside a
//! simulated replica that works.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use prefixgate::fleet::{Health, ReplicaSpec};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How a hand-written replica treats a POST (GETs, the prober's, are always answered).
#[derive(Clone, Copy, PartialEq)]
enum Misbehaviour {
    /// Resets the connection before reading anything.
    ResetAtOnce,
    /// Reads the whole request, then closes without a byte (a replica killed after reading).
    CloseAfterReading,
    /// Answers the first POST on a connection; reads the second and closes
    /// (what a client sees when a pooled connection is closed by the replica as
    /// the request goes out).
    CloseSecondOnConnection,
}

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

/// Reads one HTTP/1.1 request (head and Content-Length body); None at EOF.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(head);
        }
        let n = s.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn answer(s: &mut TcpStream, body: &str) -> bool {
    let reply =
        format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    s.write_all(reply.as_bytes()).await.is_ok()
}

/// A replica that misbehaves as told; returns its URL and the POSTs it saw.
async fn misbehaving(how: Misbehaviour) -> (String, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let posts = Arc::new(AtomicUsize::new(0));
    let seen = posts.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                if how == Misbehaviour::ResetAtOnce {
                    // Probes get a connection that resets too: the gateway's own
                    // verdict (refused/reset) is what the test reads.
                    // Zero linger is the point: the close is an RST. (Deprecated
                    // for blocking on drop; with zero it never blocks.)
                    #[allow(deprecated)]
                    let _ = s.set_linger(Some(Duration::ZERO));
                    return;
                }
                let mut posts_here = 0;
                while let Some(head) = read_request(&mut s).await {
                    if !head.starts_with("POST") {
                        if !answer(&mut s, r#"{"object":"list","data":[]}"#).await {
                            return;
                        }
                        continue;
                    }
                    seen.fetch_add(1, Ordering::SeqCst);
                    posts_here += 1;
                    let close = match how {
                        Misbehaviour::CloseAfterReading => true,
                        Misbehaviour::CloseSecondOnConnection => posts_here == 2,
                        Misbehaviour::ResetAtOnce => unreachable!(),
                    };
                    if close || !answer(&mut s, CHAT_REPLY).await {
                        return;
                    }
                }
            });
        }
    });
    (url, posts)
}

/// A gateway over a working simulated replica `ok`, then the replica `id` at
/// `url`, added once the gateway runs: the prober (every 60 s here) has not
/// judged it, so only the request path does. One request has gone to `ok`,
/// so the spread's next pick is `id`.
async fn gateway_with(id: &str, url: &str, ok: &Sim, tweak: impl FnOnce(&mut prefixgate::config::Config)) -> Gw {
    let mut config = test_config(&[ok]);
    config.health.interval_ms = 60_000;
    tweak(&mut config);
    let gw = start_gateway(config).await;
    gw.gw.operator.add_replica(ReplicaSpec::new(id, url)).await.unwrap();
    let (url, body) = chat_to(&gw, "warm-up");
    assert_eq!(post(&url, &body).await.replica, "ok");
    gw
}

fn chat_to(gw: &Gw, text: &str) -> (String, serde_json::Value) {
    (format!("{}/v1/chat/completions", gw.base), chat_body(&[("user", text)], json!({})))
}

#[actix_web::test]
async fn a_refused_connection_fails_over_and_marks_the_replica_down() {
    let ok = start_sim("ok", fast_sim()).await;
    // A port nobody listens on: bound, read, released, never bound again.
    let refused = format!("http://{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap());
    let gw = gateway_with("gone", &refused, &ok, |_| {}).await;
    let (url, body) = chat_to(&gw, "refused");
    let r = post(&url, &body).await;
    assert_eq!((r.status, r.replica.as_str(), r.route.as_str()), (200, "ok", "failover"));
    assert_eq!(gw.gw.fleet.get("gone").unwrap().health(), Health::Down, "down at once");
    gw.stop().await;
}

#[actix_web::test]
async fn a_reset_before_the_write_fails_over() {
    let ok = start_sim("ok", fast_sim()).await;
    let (reset, _) = misbehaving(Misbehaviour::ResetAtOnce).await;
    let gw = gateway_with("reset", &reset, &ok, |_| {}).await;
    let (url, body) = chat_to(&gw, "reset");
    let r = post(&url, &body).await;
    assert_eq!((r.status, r.replica.as_str(), r.route.as_str()), (200, "ok", "failover"));
    assert_eq!(ok.state.received(), 2, "the warm-up, then this request once");
    gw.stop().await;
}

#[actix_web::test]
async fn an_idle_pooled_connection_closed_by_the_replica_is_re_sent_to_the_same_replica() {
    let ok = start_sim("ok", fast_sim()).await;
    let (flaky, posts) = misbehaving(Misbehaviour::CloseSecondOnConnection).await;
    let gw = gateway_with("keepalive", &flaky, &ok, |_| {}).await;
    // Turns of one conversation, pinned to the replica, one more than the
    // gateway has traffic workers (one per core). Each worker keeps its own
    // pool, so at least one turn goes out on a connection an earlier turn
    // left in the pool, which the replica closes as the request arrives.
    let turns = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let url = format!("{}/v1/chat/completions", gw.base);
    let mut msgs = vec![("user".to_string(), "turn 0".to_string())];
    for turn in 0..turns {
        let view: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        let r = post(&url, &chat_body(&view, json!({}))).await;
        assert_eq!((r.status, r.replica.as_str()), (200, "keepalive"), "turn {turn}");
        if turn > 0 {
            assert_eq!(r.route, "pinned", "turn {turn} stays: a closed pooled connection is no failover");
        }
        msgs.push(("assistant".into(), "ok".into()));
        msgs.push(("user".into(), format!("turn {}", turn + 1)));
    }
    let closed = posts.load(Ordering::SeqCst) - turns;
    assert!(closed >= 1, "some turn met a closed pooled connection and was re-sent");
    assert_ne!(gw.gw.fleet.get("keepalive").unwrap().health(), Health::Down, "a healthy replica stays up");
    assert_eq!(ok.state.received(), 1, "only the warm-up");
    gw.stop().await;
}

#[actix_web::test]
async fn a_replica_killed_after_reading_the_body_gets_one_re_send_then_the_request_fails_over() {
    let ok = start_sim("ok", fast_sim()).await;
    let (dying, posts) = misbehaving(Misbehaviour::CloseAfterReading).await;
    let gw = gateway_with("dying", &dying, &ok, |_| {}).await;
    let (url, body) = chat_to(&gw, "killed after reading");
    let r = post(&url, &body).await;
    assert_eq!((r.status, r.replica.as_str(), r.route.as_str()), (200, "ok", "failover"));
    assert_eq!(posts.load(Ordering::SeqCst), 2, "the attempt and one re-send to the same replica");
    assert_eq!(ok.state.received(), 2, "the warm-up and the failover");
    gw.stop().await;
}

#[actix_web::test]
async fn a_timeout_before_the_head_is_a_504_and_is_never_re_sent() {
    let ok = start_sim("ok", fast_sim()).await;
    let (hole, _task) = black_hole().await;
    let gw = gateway_with("slow", &hole, &ok, |c| c.timeouts.response_head_ms = 300).await;
    let (url, body) = chat_to(&gw, "timeout");
    let r = post(&url, &body).await;
    assert_eq!((r.status, r.replica.as_str()), (504, ""));
    assert_eq!(ok.state.received(), 1, "only the warm-up: not re-sent, the engine may be generating");
    gw.stop().await;
}

#[actix_web::test]
async fn a_responses_request_that_stores_is_re_sent_after_a_close_and_the_history_says_so() {
    let ok = start_sim("ok", fast_sim()).await;
    let (dying, posts) = misbehaving(Misbehaviour::CloseAfterReading).await;
    let gw = gateway_with("dying", &dying, &ok, |_| {}).await;
    let url = format!("{}/v1/responses", gw.base);
    let r = post(&url, &json!({"model": "sim-model", "input": "remember this", "store": true})).await;
    assert_eq!((r.status, r.replica.as_str()), (200, "ok"), "{}", r.body);
    assert_eq!(posts.load(Ordering::SeqCst), 2);
    let events = gw.gw.events.query(&prefixgate::events::EventFilter {
        kind: Some(prefixgate::events::EventKind::Failover),
        limit: 100,
        ..Default::default()
    });
    let stored = |events: &[prefixgate::events::Event]| {
        events.iter().filter(|e| e.replica.as_deref() == Some("dying") && e.detail.contains("stored response")).count()
    };
    assert_eq!(stored(&events), 2, "one per attempt the replica read and closed: {events:?}");
    // The client's chain goes on from the response it did get.
    let id = r.body["id"].as_str().unwrap();
    let follow = post(&url, &json!({"model": "sim-model", "input": "and then", "previous_response_id": id})).await;
    assert_eq!((follow.status, follow.replica.as_str(), follow.route.as_str()), (200, "ok", "response"));
    // store: false is re-sent with nothing to record (the spread is back at
    // the dying replica: `ok` took the warm-up and the failover's picks).
    let r = post(&url, &json!({"model": "sim-model", "input": "forget this", "store": false})).await;
    assert_eq!((r.status, r.replica.as_str()), (200, "ok"));
    assert_eq!(posts.load(Ordering::SeqCst), 4, "it went to the dying replica first");
    let after = gw.gw.events.query(&prefixgate::events::EventFilter {
        kind: Some(prefixgate::events::EventKind::Failover),
        limit: 100,
        ..Default::default()
    });
    assert_eq!(stored(&after), 2, "nothing new: {after:?}");
    gw.stop().await;
}
