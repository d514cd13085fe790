//! Issue 3: the admin API against a live gateway: validation, secrets,
//! auth and rate limits, drain/resume/disable/enable, pins, events, policy,
//! and the OpenAPI spec.

use std::time::Duration;

use crate::common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[actix_web::test]
async fn replicas_crud_validates_input_and_never_echoes_secrets() {
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    // Probed once at start only: the replica added below at an address
    // nothing listens on must not turn its history into a health story.
    config.health.interval_ms = 3_600_000;
    let gw = start_gateway(config).await;
    let r = format!("{}/admin/v1/replicas", gw.admin);

    let (s, list) = admin("GET", &r, None, None).await;
    assert_eq!(s, 200);
    assert_eq!(list[0]["id"], "a");
    assert_eq!(list[0]["admin_state"], "active");
    assert_eq!(list[0]["health"], "up");

    let secret = "sk-upstream-very-secret";
    let (s, added) =
        admin("POST", &r, None, Some(json!({"id": "b", "url": "http://127.0.0.1:9/v1/", "api_key": secret}))).await;
    assert_eq!(s, 201, "{added}");
    assert_eq!((added["url"].as_str(), added["api_key_set"].as_bool()), (Some("http://127.0.0.1:9"), Some(true)));
    for (method, url, body) in [
        ("GET", r.clone(), None),
        ("GET", format!("{r}/b"), None),
        ("PATCH", format!("{r}/b"), Some(json!({"max_large_inflight": 2}))),
    ] {
        let (s, v) = admin(method, &url, None, body).await;
        assert_eq!(s, 200);
        assert!(!v.to_string().contains(secret), "secret leaked by {method} {url}");
    }

    for (method, url, body, status) in [
        ("POST", r.clone(), json!({"id": "b", "url": "http://127.0.0.1:9"}), 409),
        ("POST", r.clone(), json!({"id": "c", "url": "file:///etc/passwd"}), 422),
        ("POST", r.clone(), json!({"id": "c", "url": "gopher://x"}), 422),
        ("POST", r.clone(), json!({"id": "Bad Id", "url": "http://x"}), 422),
        ("POST", r.clone(), json!({"id": "c"}), 400),
        ("POST", r.clone(), json!({"id": "c", "url": "http://x", "surprise": 1}), 400),
        ("PATCH", format!("{r}/nope"), json!({"kv_tokens": 1}), 404),
        ("PATCH", format!("{r}/b"), json!({"url": "ftp://x"}), 422),
    ] {
        let (s, v) = admin(method, &url, None, Some(body.clone())).await;
        assert_eq!(s, status, "{method} {url} {body} -> {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let raw = client().post(&r).insert_header(("content-type", "application/json")).send_body("{oops").await.unwrap();
    assert_eq!(raw.status(), 400);
    for bad in ["%2e%2e%2fetc", "..", "UPPER"] {
        let (s, _) = admin("GET", &format!("{r}/{bad}"), None, None).await;
        assert!(s == 400 || s == 404, "{bad}: {s}");
    }

    let (s, _) = admin("DELETE", &format!("{r}/b"), None, None).await;
    assert_eq!(s, 204);
    assert_eq!(admin("GET", &format!("{r}/b"), None, None).await.0, 404);
    let (_, events) = admin("GET", &format!("{}/admin/v1/events?replica=b", gw.admin), None, None).await;
    let kinds: Vec<&str> = events["items"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["replica_removed", "replica_updated", "replica_added"]);
    gw.stop().await;
}

#[actix_web::test]
async fn the_admin_token_is_required_and_repeated_failures_are_locked_out() {
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    config.admin_token = Some("s3cret-token".into());
    config.rate_limits.admin_auth_failures_per_minute = 3;
    let gw = start_gateway(config).await;
    let url = format!("{}/admin/v1/replicas", gw.admin);
    assert_eq!(admin("GET", &url, Some("s3cret-token"), None).await.0, 200);
    let (s, v) = admin("GET", &url, None, None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(admin("GET", &url, Some("guess"), None).await.0);
    }
    assert_eq!(statuses, [401, 401, 429, 429, 429], "the 4th failure in a minute is locked out");
    let resp = client().get(&url).insert_header(("authorization", "Bearer s3cret-token")).send().await.unwrap();
    assert_eq!(resp.status(), 429, "a locked-out IP cannot keep guessing, even right");
    assert!(resp.headers().get("retry-after").is_some());
    // Metrics and docs stay open; the token is never in them.
    let mut m = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
    assert_eq!(m.status(), 200);
    assert!(!String::from_utf8_lossy(&m.body().await.unwrap()).contains("s3cret-token"));
    gw.stop().await;
}

#[actix_web::test]
async fn drain_waits_for_in_flight_requests_and_moves_pinned_conversations() {
    let slow = slow_decoder(10.0);
    let (a, b) = (start_sim("a", slow.clone()).await, start_sim("b", slow).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;

    // A conversation lives on one replica; then that replica is drained.
    let first = chat(&gw, &[("user", "remember me")]).await;
    let home = first.replica.clone();
    let other = if home == "a" { "b" } else { "a" };
    // A slow stream is in flight on the home replica.
    let mut stream = None;
    for i in 0..4 {
        let body = chat_body(&[("user", &format!("slow {i}"))], json!({"stream": true, "max_tokens": 40}));
        let resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
        if resp.headers().get("x-prefixgate-replica").unwrap() == home.as_str() {
            stream = Some(resp);
            break;
        }
        drop(resp);
    }
    let mut stream = stream.expect("spread reached the home replica");
    let home_replica = gw.gw.fleet.get(&home).unwrap();
    wait_until("stream in flight", Duration::from_secs(5), || home_replica.inflight() >= 1).await;

    let drain_url = format!("{}/admin/v1/replicas/{home}/drain?wait=true&timeout=20", gw.admin);
    let drain = actix_web::rt::spawn(async move { admin("POST", &drain_url, None, None).await });
    wait_until("draining", Duration::from_secs(5), || home_replica.admin() == prefixgate::fleet::AdminState::Draining)
        .await;

    // New traffic avoids the draining replica; the pinned conversation moves.
    let moved = chat(&gw, &[("user", "remember me"), ("assistant", "ok"), ("user", "still there?")]).await;
    assert_eq!((moved.route.as_str(), moved.replica.as_str()), ("repinned", other));
    let again = chat(
        &gw,
        &[
            ("user", "remember me"),
            ("assistant", "ok"),
            ("user", "still there?"),
            ("assistant", "yes"),
            ("user", "good"),
        ],
    )
    .await;
    assert_eq!((again.route.as_str(), again.replica.as_str()), ("pinned", other));

    assert!(!drain.is_finished(), "drain must wait for the stream");
    while let Some(chunk) = stream.next().await {
        chunk.unwrap();
    }
    let (s, v) = drain.await.unwrap();
    assert_eq!((s, v["admin_state"].as_str(), v["inflight"].as_i64()), (200, Some("draining"), Some(0)));

    let (_, events) = admin("GET", &format!("{}/admin/v1/events?replica={home}", gw.admin), None, None).await;
    let kinds: Vec<&str> = events["items"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert!(
        kinds.contains(&"drain_started") && kinds.contains(&"drain_completed") && kinds.contains(&"pin_moved"),
        "{kinds:?}"
    );

    // Timeout path, then resume / disable / enable.
    let (s, _) = admin("POST", &format!("{}/admin/v1/replicas/{home}/resume", gw.admin), None, None).await;
    assert_eq!(s, 200);
    let (s, v) = admin("POST", &format!("{}/admin/v1/replicas/{home}/disable", gw.admin), None, None).await;
    assert_eq!((s, v["admin_state"].as_str()), (200, Some("disabled")));
    assert_eq!(admin("POST", &format!("{}/admin/v1/replicas/{home}/resume", gw.admin), None, None).await.0, 409);
    let (s, v) = admin("POST", &format!("{}/admin/v1/replicas/{home}/enable", gw.admin), None, None).await;
    assert_eq!((s, v["admin_state"].as_str()), (200, Some("active")));
    gw.stop().await;
}

#[actix_web::test]
async fn a_drain_that_cannot_finish_in_time_is_a_504() {
    let slow = start_sim("a", slow_decoder(2.0)).await;
    let gw = start_gateway(test_config(&[&slow])).await;
    let body = chat_body(&[("user", "long")], json!({"stream": true, "max_tokens": 20}));
    let _stream = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
    let (s, v) =
        admin("POST", &format!("{}/admin/v1/replicas/a/drain?wait=true&timeout=1", gw.admin), None, None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (504, Some("timeout")));
    drop(_stream);
    gw.stop().await;
}

#[actix_web::test]
async fn pins_events_and_policy_through_the_api() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    for i in 0..3 {
        chat(&gw, &[("user", &format!("conversation {i}"))]).await;
    }
    let turn2 = chat(&gw, &[("user", "conversation 0"), ("assistant", "x"), ("user", "y")]).await;
    let pins = format!("{}/admin/v1/pins", gw.admin);
    let (s, page) = admin("GET", &format!("{pins}?limit=2"), None, None).await;
    // Three first turns, each with its message's lead; the second turn's
    // own pin, the boundary it passed that no request ended at (the answer
    // "x") and its last message's lead ("y").
    assert_eq!((s, page["total"].as_u64(), page["items"].as_array().unwrap().len()), (200, Some(9), 2));
    let newest = &page["items"][0];
    assert_eq!((newest["replica"].as_str(), newest["turns"].as_u64()), (Some(turn2.replica.as_str()), Some(2)));
    let key = newest["key"].as_str().unwrap().to_string();
    assert_eq!(key.len(), 32);
    let (s, one) = admin("GET", &format!("{pins}/{key}"), None, None).await;
    assert_eq!((s, one["key"].as_str()), (200, Some(key.as_str())));
    let (s, filtered) = admin("GET", &format!("{pins}?key_prefix={}", &key[..6]), None, None).await;
    assert_eq!((s, filtered["items"][0]["key"].as_str()), (200, Some(key.as_str())));
    let (_, by_a) = admin("GET", &format!("{pins}?replica=a"), None, None).await;
    assert!(by_a["items"].as_array().unwrap().iter().all(|p| p["replica"] == "a"));
    assert_eq!(admin("GET", &format!("{pins}/xyz"), None, None).await.0, 400);
    assert_eq!(admin("DELETE", &format!("{pins}/{key}"), None, None).await.0, 204);
    assert_eq!(admin("GET", &format!("{pins}/{key}"), None, None).await.0, 404);
    let (s, removed) = admin("DELETE", &format!("{}/admin/v1/replicas/a/pins", gw.admin), None, None).await;
    assert_eq!(s, 200);
    assert!(removed["removed"].as_u64().is_some());

    let policy = format!("{}/admin/v1/policy", gw.admin);
    let (s, v) = admin(
        "PUT",
        &policy,
        None,
        Some(json!({"mode": "roundrobin", "identity": {"block_bytes": 512, "block_tokens": 64}})),
    )
    .await;
    assert_eq!((s, v["mode"].as_str()), (200, Some("roundrobin")));
    assert_eq!(chat(&gw, &[("user", "q")]).await.route, "roundrobin", "takes effect at once");
    assert_eq!(admin("PUT", &policy, None, Some(json!({"mode": "fastest"}))).await.0, 400);
    let bad_blocks = json!({"mode": "shape", "identity": {"block_bytes": 0, "block_tokens": 64}});
    assert_eq!(admin("PUT", &policy, None, Some(bad_blocks)).await.0, 422);

    let events = format!("{}/admin/v1/events", gw.admin);
    let (_, v) = admin("GET", &format!("{events}?kind=policy_changed"), None, None).await;
    assert_eq!(v["items"].as_array().unwrap().len(), 1);
    assert_eq!(admin("GET", &format!("{events}?kind=nonsense"), None, None).await.0, 400);
    assert_eq!(admin("GET", &format!("{events}?since=yesterday"), None, None).await.0, 400);
    admin("POST", &format!("{}/admin/v1/replicas/b/disable", gw.admin), None, None).await;
    admin("POST", &format!("{}/admin/v1/replicas/b/enable", gw.admin), None, None).await;
    let (_, page1) = admin("GET", &format!("{events}?limit=1"), None, None).await;
    assert_eq!(page1["items"][0]["kind"], "enabled");
    let cursor = page1["next_cursor"].as_u64().unwrap();
    let (_, page2) = admin("GET", &format!("{events}?limit=1&cursor={cursor}"), None, None).await;
    assert!(page2["items"][0]["id"].as_u64().unwrap() < page1["items"][0]["id"].as_u64().unwrap());
    gw.stop().await;
}

#[actix_web::test]
async fn a_pin_is_dated_when_its_turn_began_not_when_the_engine_answered() {
    // 20 tokens at 40 a second, not streamed: the answer comes ~0.5 s after
    // the turn began. Every instance dates a conversation by its pins, and
    // the others hear them when the turn begins: the one serving it must
    // record the same moment, or they disagree on which session is youngest.
    let slow = start_sim("a", slow_decoder(40.0)).await;
    let gw = start_gateway(test_config(&[&slow])).await;
    let began = std::time::SystemTime::now();
    let r =
        post(&format!("{}/v1/chat/completions", gw.base), &chat_body(&[("user", "dated")], json!({"max_tokens": 20})))
            .await;
    let answered = std::time::SystemTime::now();
    assert_eq!(r.status, 200);
    let (_, page) = admin("GET", &format!("{}/admin/v1/pins", gw.admin), None, None).await;
    let pin = &page["items"][0];
    let at = |field: &str| humantime::parse_rfc3339(pin[field].as_str().unwrap()).unwrap();
    assert_eq!(at("created"), at("last_used"));
    assert!(at("created") <= began + Duration::from_millis(200), "dated at the turn's start");
    assert!(answered.duration_since(at("created")).unwrap() >= Duration::from_millis(400), "not at its answer");
    gw.stop().await;
}

#[actix_web::test]
async fn the_live_spec_matches_the_committed_one_and_swagger_ui_is_served() {
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    let mut resp = client().get(format!("{}/openapi.json", gw.admin)).send().await.unwrap();
    let live: Value = resp.json().limit(4 << 20).await.unwrap();
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/admin.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(live, committed, "openapi/admin.json is stale: run `cargo run -- openapi > openapi/admin.json`");
    let paths = live["paths"].as_object().unwrap();
    for p in [
        "/admin/v1/replicas",
        "/admin/v1/replicas/{id}",
        "/admin/v1/replicas/{id}/drain",
        "/admin/v1/replicas/{id}/resume",
        "/admin/v1/replicas/{id}/disable",
        "/admin/v1/replicas/{id}/enable",
        "/admin/v1/replicas/{id}/pins",
        "/admin/v1/pins",
        "/admin/v1/pins/{key}",
        "/admin/v1/events",
        "/admin/v1/policy",
        "/admin/v1/capacity",
    ] {
        assert!(paths.contains_key(p), "spec lacks {p}");
    }
    let mut ui = client().get(format!("{}/swagger-ui/", gw.admin)).send().await.unwrap();
    assert_eq!(ui.status(), 200);
    assert!(String::from_utf8_lossy(&ui.body().await.unwrap()).contains("swagger"));
    gw.stop().await;
}

#[test]
fn the_committed_spec_matches_the_code() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/admin.json")).unwrap();
    assert_eq!(committed, prefixgate::admin::openapi_json(), "run `cargo run -- openapi > openapi/admin.json`");
}

/// docs/configuration.md lists every config key, its default and its doc,
/// as the code defines them: a key added without it fails here.
#[test]
fn the_committed_configuration_reference_matches_the_code() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md")).unwrap();
    for key in prefixgate::config_flags::keys() {
        assert!(committed.contains(&format!("| `{}` |", key.key)), "docs/configuration.md lacks {}", key.key);
    }
    assert_eq!(
        committed,
        prefixgate::config_flags::configuration_markdown(),
        "run `cargo run -- config-reference > docs/configuration.md`"
    );
}
