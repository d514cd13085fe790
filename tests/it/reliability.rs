//! Issue 7: faults and hostile clients. Every test is bounded in time.

use std::time::{Duration, Instant};

use crate::common::*;
use prefixgate::fleet::Health;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A "replica" that answers every request with `reply` and closes.
async fn scripted(reply: &'static [u8]) -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(reply).await;
            });
        }
    });
    (url, task)
}

#[actix_web::test]
async fn a_black_hole_replica_times_out_is_marked_down_and_others_keep_serving() {
    let a = start_sim("a", fast_sim()).await;
    let (hole, _task) = black_hole().await;
    let mut config = test_config(&[&a]);
    config.replicas.push(prefixgate::fleet::ReplicaSpec::new("hole", &hole));
    config.timeouts.response_head_ms = 500;
    config.health.timeout_ms = 300;
    let gw = start_gateway(config).await;
    let hole_replica = gw.gw.fleet.get("hole").unwrap();
    wait_until("the black hole is marked down by its probe", Duration::from_secs(10), || {
        hole_replica.health() == Health::Down
    })
    .await;
    let started = Instant::now();
    for i in 0..6 {
        assert_eq!(chat(&gw, &[("user", &format!("q{i}"))]).await.status, 200);
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    gw.stop().await;
}

#[actix_web::test]
async fn a_request_stuck_on_a_black_hole_gets_504_while_the_gateway_stays_responsive() {
    let (hole, _task) = black_hole().await;
    let mut config = test_config(&[]);
    config.replicas.push(prefixgate::fleet::ReplicaSpec::new("hole", &hole));
    config.timeouts.response_head_ms = 800;
    config.health.interval_ms = 3_600_000;
    // The probe would mark it down; this test wants the request path.
    let traffic = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin_l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gwr = prefixgate::state::AppState::open(config).await.unwrap();
    let running = prefixgate::start(gwr.clone(), traffic, admin_l).unwrap();
    let base = format!("http://{}", running.traffic_addr);
    let url = format!("{base}/v1/chat/completions");
    let stuck = actix_web::rt::spawn(async move { post(&url, &chat_body(&[("user", "x")], json!({}))).await });
    // Meanwhile the gateway answers others at once.
    let t = Instant::now();
    let resp = client().get(format!("{base}/healthz")).send().await.unwrap();
    assert!(resp.status().is_success() || resp.status() == 503);
    assert!(t.elapsed() < Duration::from_millis(500));
    let r = stuck.await.unwrap();
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (504, Some("upstream_timeout")));
    let replica = gwr.fleet.get("hole").unwrap();
    assert_eq!(replica.inflight(), 0);
    running.stop().await;
}

#[actix_web::test]
async fn garbage_and_truncated_replies_are_clean_errors_not_hangs() {
    let (garbage, _g) = scripted(b"this is not http\r\n\r\n").await;
    let (truncated, _t) =
        scripted(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial\":")
            .await;
    for (url, expect_status) in [(garbage, Some(())), (truncated, None)] {
        let mut config = test_config(&[]);
        config.replicas.push(prefixgate::fleet::ReplicaSpec::new("bad", &url));
        config.health.interval_ms = 3_600_000;
        let traffic = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let admin_l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gwr = prefixgate::state::AppState::open(config).await.unwrap();
        let running = prefixgate::start(gwr.clone(), traffic, admin_l).unwrap();
        match expect_status {
            // 502 when the request met the garbage; 503 when the health probe met it first.
            Some(_) => {
                let sent = client()
                    .post(format!("http://{}/v1/chat/completions", running.traffic_addr))
                    .send_json(&chat_body(&[("user", "x")], json!({})))
                    .await;
                let status = sent.unwrap().status().as_u16();
                assert!(matches!(status, 502 | 503), "{status}");
            }
            // The head said 200 and the body is cut short: a client must be able to
            // tell (no response, a body short of its Content-Length, or a chunked body
            // without its terminator), never see a short "success". Read raw: awc
            // itself cannot tell a cut connection from a finished body.
            None => {
                let body = chat_body(&[("user", "x")], json!({})).to_string();
                let raw = raw_exchange(&running.traffic_addr.to_string(), &body).await;
                let text = String::from_utf8_lossy(&raw).to_string();
                let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
                let head = head.to_ascii_lowercase();
                let cut = raw.is_empty()
                    || (head.contains("content-length: 100") && rest.len() < 100)
                    || (head.contains("transfer-encoding: chunked") && !rest.ends_with("0\r\n\r\n"));
                assert!(cut, "a truncated body must not look complete: {text:?}");
            }
        }
        let replica = gwr.fleet.get("bad").unwrap();
        wait_until("counters released", Duration::from_secs(5), || replica.inflight() == 0).await;
        running.stop().await;
    }
}

/// One HTTP/1.1 request on a fresh connection; everything until the server closes.
async fn raw_exchange(addr: &str, body: &str) -> Vec<u8> {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the gateway must end the response");
    out
}

#[actix_web::test]
async fn all_replicas_down_is_a_fast_503_and_recovery_is_automatic() {
    let port_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = port_listener.local_addr().unwrap();
    drop(port_listener);
    // The replica restarts on its own port, as a real one does.
    let start_on = |addr: std::net::SocketAddr| {
        let l = std::net::TcpListener::bind(addr).unwrap();
        let state = prefixgate::sim::SimState::new(fast_sim());
        let server = prefixgate::sim::serve(l, state).unwrap();
        let handle = server.handle();
        actix_web::rt::spawn(server);
        handle
    };
    let first = start_on(addr);
    let mut config = test_config(&[]);
    config.replicas.push(prefixgate::fleet::ReplicaSpec::new("a", &format!("http://{addr}")));
    config.health.interval_ms = 100;
    let gw = start_gateway(config).await;
    assert_eq!(chat(&gw, &[("user", "before")]).await.status, 200);
    first.stop(false).await;
    let t = Instant::now();
    let r = chat(&gw, &[("user", "during")]).await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (503, Some("no_routable_replica")));
    assert!(r.headers.get("retry-after").is_some());
    assert!(t.elapsed() < Duration::from_millis(500), "within the connect timeout: {:?}", t.elapsed());
    let _second = start_on(addr);
    let replica = gw.gw.fleet.get("a").unwrap();
    wait_until("the replica came back by itself", Duration::from_secs(10), || replica.health() == Health::Up).await;
    assert_eq!(chat(&gw, &[("user", "after")]).await.status, 200);
    gw.stop().await;
}

#[actix_web::test]
async fn graceful_shutdown_finishes_every_accepted_request() {
    let slow = start_sim("a", slow_decoder(20.0)).await;
    let gw = start_gateway(test_config(&[&slow])).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let streams = (0..8).map(|i| {
        let url = url.clone();
        actix_web::rt::spawn(async move {
            let body = chat_body(&[("user", &format!("finish me {i}"))], json!({"stream": true, "max_tokens": 10}));
            let mut resp = client().post(&url).send_json(&body).await.unwrap();
            let bytes = resp.body().limit(1 << 20).await.unwrap();
            (resp.status().as_u16(), String::from_utf8_lossy(&bytes).ends_with("data: [DONE]\n\n"))
        })
    });
    let streams: Vec<_> = streams.collect();
    let replica = gw.gw.fleet.get("a").unwrap();
    wait_until("all in flight", Duration::from_secs(5), || replica.inflight() == 8).await;
    gw.stop().await;
    for s in streams {
        assert_eq!(s.await.unwrap(), (200, true));
    }
}

#[actix_web::test]
async fn slow_headers_and_huge_headers_are_cut_off() {
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    // actix measures this from a clock it refreshes every 500 ms: keep it well above that.
    config.limits.header_timeout_ms = 1_500;
    let gw = start_gateway(config).await;
    let addr = gw.base.trim_start_matches("http://").to_string();

    // Slowloris: a request head that never completes is dropped.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), slow.read(&mut buf))
        .await
        .expect("the gateway closed or answered")
        .unwrap_or(0);
    let reply = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || reply.starts_with("HTTP/1.1 408"), "{reply}");

    // A header far larger than any client needs.
    let mut big = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!("GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(256 * 1024));
    let _ = big.write_all(head.as_bytes()).await;
    let n = tokio::time::timeout(Duration::from_secs(5), big.read(&mut buf)).await.expect("answered").unwrap_or(0);
    let reply = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || reply.starts_with("HTTP/1.1 4"), "{reply}");

    // And everyone else is still served.
    let r = chat(&gw, &[("user", "still here")]).await;
    assert_eq!(r.status, 200, "{:?} {:?}", r.headers, r.body);
    gw.stop().await;
}

#[actix_web::test]
async fn a_short_load_run_of_streams_has_no_errors_and_no_leaks() {
    let a = start_sim("a", fast_sim()).await;
    let b = start_sim("b", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a, &b])).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let c = client();
    let all = (0..300).map(|i| {
        let (url, c) = (url.clone(), c.clone());
        async move {
            let body = chat_body(&[("user", &format!("load {i}"))], json!({"stream": true, "max_tokens": 8}));
            let mut resp = c.post(&url).send_json(&body).await.unwrap();
            let ok = resp.status() == 200;
            let bytes = resp.body().await.unwrap();
            ok && bytes.ends_with(b"data: [DONE]\n\n")
        }
    });
    let results = futures_util::future::join_all(all).await;
    assert!(results.iter().all(|ok| *ok), "{} failed", results.iter().filter(|ok| !**ok).count());
    for r in gw.gw.fleet.snapshot().iter() {
        wait_until("no leaked in-flight", Duration::from_secs(5), || r.inflight() == 0).await;
    }
    gw.stop().await;
}

#[actix_web::test]
async fn a_client_that_sends_half_a_body_and_leaves_costs_nothing_upstream() {
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    let addr = gw.base.trim_start_matches("http://").to_string();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n");
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(br#"{"model":"sim-model","messages":[{"role":"user","content":"slow"#).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // a slow client, mid-body
    drop(sock);
    // The gateway is still fine, and nothing of the half request went upstream.
    assert_eq!(chat(&gw, &[("user", "next")]).await.status, 200);
    assert_eq!(a.state.received(), 1, "only the complete request reached the replica");
    assert_eq!(gw.gw.fleet.get("a").unwrap().inflight(), 0);
    gw.stop().await;
}

/// A replica stand-in that answers like an engine and remembers the request head it got.
async fn recording_replica() -> (String, std::sync::Arc<std::sync::Mutex<String>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let req = String::from_utf8_lossy(&buf[..n]).to_string();
                    if req.starts_with("POST") {
                        *record.lock().unwrap() = req;
                    }
                    let body = br#"{"object":"list","data":[{"id":"sim-model"}],"choices":[]}"#;
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(reply.as_bytes()).await;
                    let _ = s.write_all(body).await;
                }
            });
        }
    });
    (url, seen)
}

#[actix_web::test]
async fn client_keys_are_checked_and_the_replica_gets_its_own_key_never_the_clients() {
    let (url, seen) = recording_replica().await;
    let mut config = test_config(&[]);
    let mut spec = prefixgate::fleet::ReplicaSpec::new("r", &url);
    spec.api_key = Some("sk-upstream".into());
    config.replicas.push(spec);
    config.api_keys = vec!["sk-client".into()];
    let gw = start_gateway(config).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let body = chat_body(&[("user", "x")], json!({}));
    let mut no_key = client().post(&url).send_json(&body).await.unwrap();
    assert_eq!(no_key.status(), 401);
    let v: serde_json::Value = no_key.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert_eq!(client().post(&url).bearer_auth("sk-wrong").send_json(&body).await.unwrap().status(), 401);
    let ok = client().post(&url).bearer_auth("sk-client").send_json(&body).await.unwrap();
    assert_eq!(ok.status(), 200);
    let upstream_head = seen.lock().unwrap().to_ascii_lowercase();
    assert!(upstream_head.contains("authorization: bearer sk-upstream"), "{upstream_head}");
    assert!(!upstream_head.contains("sk-client"), "the client's key must not reach the replica");
    gw.stop().await;
}

#[actix_web::test]
async fn the_per_client_rate_limit_answers_429_with_retry_after() {
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    config.rate_limits.client_rps = 1;
    config.rate_limits.client_burst = 2;
    let gw = start_gateway(config).await;
    let mut replies = Vec::new();
    for i in 0..6 {
        replies.push(chat(&gw, &[("user", &format!("burst {i}"))]).await);
    }
    // The burst of 2 passes; then (at 1 request/s, however slow this machine is) most are refused.
    assert!(replies[..2].iter().all(|r| r.status == 200));
    let limited: Vec<&Reply> = replies[2..].iter().filter(|r| r.status == 429).collect();
    assert!(limited.len() >= 2, "{:?}", replies.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(limited[0].headers.get("retry-after").is_some());
    assert_eq!(limited[0].body["error"]["code"], "rate_limited");
    gw.stop().await;
}
