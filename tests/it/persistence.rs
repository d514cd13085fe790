//! Issue 3: what the gateway learned survives restarts: a graceful one (in
//! process) and a `kill -9` of the real binary.

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;
use prefixgate::events::EventKind;
use prefixgate::fleet::AdminState;

#[actix_web::test]
async fn pins_replicas_admin_state_and_events_survive_a_graceful_restart() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(&[&a, &b]);
    config.data_dir = Some(dir.path().to_path_buf());

    let gw = start_gateway(config.clone()).await;
    let first = chat(&gw, &[("user", "persist me")]).await;
    gw.gw.operator.set_admin("b", AdminState::Draining).await.unwrap();
    gw.gw.operator.set_admin("b", AdminState::Active).await.unwrap();
    gw.gw.operator.set_admin("a", AdminState::Disabled).await.unwrap();
    gw.gw.operator.set_admin("a", AdminState::Active).await.unwrap();
    let c = prefixgate::fleet::ReplicaSpec::new("c", "http://127.0.0.1:9");
    gw.gw.operator.add_replica(c).await.unwrap();
    gw.gw.operator.set_admin("c", AdminState::Disabled).await.unwrap();
    let policy = prefixgate::policy::PolicySettings {
        mode: prefixgate::policy::Mode::Affinity,
        identity: prefixgate::policy::IdentityBlocks { block_bytes: 2048, block_tokens: 128 },
    };
    gw.gw.operator.set_policy(policy).await.unwrap();
    gw.gw
        .operator
        .set_policy(prefixgate::policy::PolicySettings { mode: prefixgate::policy::Mode::Shape, ..policy })
        .await
        .unwrap();
    let events_before = gw.gw.events.query(&Default::default());
    let last_id = gw.gw.events.query(&prefixgate::events::EventFilter { limit: 1, ..Default::default() })[0].id;
    gw.stop().await;

    // The config no longer lists the replicas: the database is the truth now.
    config.replicas.clear();
    let gw = start_gateway(config).await;
    let ids: Vec<String> = gw.gw.fleet.snapshot().iter().map(|r| r.id.to_string()).collect();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert_eq!(gw.gw.fleet.get("c").unwrap().admin(), AdminState::Disabled);
    assert_eq!(gw.gw.policy.get().identity.block_bytes, 2048, "the policy set through the API persists");
    let again = chat(&gw, &[("user", "persist me"), ("assistant", "ok"), ("user", "back after a restart")]).await;
    assert_eq!((again.route.as_str(), again.replica.as_str()), ("pinned", first.replica.as_str()));
    // Pins are read from disk as they are touched and in the background:
    // once every page is read, the pin from before and its message's lead,
    // the new turn's, the mark of the boundary it passed (the assistant's
    // answer) and its last message's lead are there.
    gw.gw.pins.load_all();
    assert_eq!((gw.gw.pins.len(), gw.gw.pins.pages_left()), (5, 0));
    assert_eq!(gw.gw.events.count(EventKind::DrainStarted), 1);
    let all = gw.gw.events.query(&prefixgate::events::EventFilter { limit: 1000, ..Default::default() });
    assert!(all.len() >= events_before.len());
    let next = gw.gw.events.record(EventKind::Resumed, Some("a"), None, "after restart");
    assert!(next.id > last_id, "event ids stay monotonic across restarts");
    gw.stop().await;
}

fn spawn_gateway(data_dir: &std::path::Path, replicas: &[&Sim]) -> GatewayProcess {
    let replica_args: Vec<String> = replicas.iter().map(|r| format!("{}={}", r.id, r.url)).collect();
    let mut args = vec!["--data-dir", data_dir.to_str().unwrap()];
    for r in &replica_args {
        args.extend(["--replica", r.as_str()]);
    }
    let env = [("PREFIXGATE_PINS_FLUSH_INTERVAL_MS", "100"), ("PREFIXGATE_HEALTH_INTERVAL_MS", "200")];
    GatewayProcess::spawn(&args, &env, Stdio::null())
}

/// `prefixgate_pins_persisted_total` of a running gateway.
async fn persisted(p: &GatewayProcess) -> u64 {
    let mut resp = client().get(format!("{}/metrics", p.admin)).send().await.unwrap();
    let text = String::from_utf8(resp.body().limit(1 << 22).await.unwrap().to_vec()).unwrap();
    text.lines().find_map(|l| l.strip_prefix("prefixgate_pins_persisted_total ")).map_or(0, |v| v.parse().unwrap())
}

async fn chat_at(base: &str, msgs: &[(&str, &str)]) -> Reply {
    post(&format!("{base}/v1/chat/completions"), &chat_body(msgs, serde_json::json!({}))).await
}

#[actix_web::test]
async fn after_kill_9_flushed_pins_survive_and_continuations_stay_pinned() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let dir = tempfile::tempdir().unwrap();
    let mut p = spawn_gateway(dir.path(), &[&a, &b]);
    p.wait_until_up().await;
    let mut homes = Vec::new();
    for i in 0..6 {
        let r = chat_at(&p.base, &[("user", &format!("family {i}"))]).await;
        assert_eq!(r.status, 200);
        homes.push(r.replica);
    }
    assert!(homes.contains(&"a".to_string()) && homes.contains(&"b".to_string()));
    // The six pins are persisted before the crash (the flusher says so)...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while persisted(&p).await < 6 {
        assert!(tokio::time::Instant::now() < deadline, "the flusher never persisted the pins");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...and the crash comes under load: requests in flight, pins being written.
    let base = p.base.clone();
    let received = || a.state.received() + b.state.received();
    let before = received();
    let load: Vec<_> = (0..20)
        .map(|i| {
            let base = base.clone();
            actix_web::rt::spawn(async move {
                let body = chat_body(&[("user", &format!("in flight at the crash {i}"))], serde_json::json!({}));
                let _ = client().post(format!("{base}/v1/chat/completions")).send_json(&body).await;
            })
        })
        .collect();
    wait_until("the load reached the replicas", Duration::from_secs(10), || received() > before).await;
    p.kill();
    for l in load {
        let _ = l.await;
    }

    let p = spawn_gateway(dir.path(), &[]);
    p.wait_until_up().await;
    for (i, home) in homes.iter().enumerate() {
        let first = format!("family {i}");
        let r = chat_at(&p.base, &[("user", &first), ("assistant", "x"), ("user", "after the crash")]).await;
        assert_eq!((r.status, r.route.as_str(), r.replica.as_str()), (200, "pinned", home.as_str()), "family {i}");
    }
    let (s, pins) = admin("GET", &format!("{}/admin/v1/pins", p.admin), None, None).await;
    assert_eq!(s, 200);
    assert!(pins["total"].as_u64().unwrap() >= 6);
    // The history reopened cleanly too: ids strictly increasing, no duplicates.
    let (s, events) = admin("GET", &format!("{}/admin/v1/events?limit=1000", p.admin), None, None).await;
    assert_eq!(s, 200);
    let ids: Vec<u64> = events["items"].as_array().unwrap().iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
}

#[actix_web::test]
async fn logs_never_contain_prompts_or_secrets_even_at_debug_level() {
    let a = start_sim("a", fast_sim()).await;
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("gateway.log");
    let mut p = GatewayProcess::spawn(
        &["--replica", &format!("a={}", a.url)],
        &[("PREFIXGATE_ADMIN_TOKEN", "admin-token-canary"), ("PREFIXGATE_LOG", "debug")],
        std::fs::File::create(&log_path).unwrap().into(),
    );
    p.wait_until_up().await;
    let (base, admin_url) = (p.base.clone(), p.admin.clone());
    let patch = serde_json::json!({"api_key": "sk-upstream-canary"});
    assert_eq!(
        admin("PATCH", &format!("{admin_url}/admin/v1/replicas/a"), Some("admin-token-canary"), Some(patch)).await.0,
        200
    );
    assert_eq!(admin("GET", &format!("{admin_url}/admin/v1/replicas"), Some("wrong-token-canary"), None).await.0, 401);
    for stream in [false, true] {
        let body = chat_body(&[("user", "PROMPT-CANARY tell me a secret")], serde_json::json!({"stream": stream}));
        let mut resp = client().post(format!("{base}/v1/chat/completions")).send_json(&body).await.unwrap();
        assert_eq!(resp.status(), 200);
        let _ = resp.body().await;
    }
    p.kill();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        log.contains("applied migration") || log.contains("DEBUG") || log.contains("INFO"),
        "the log was written: {log}"
    );
    for canary in ["PROMPT-CANARY", "admin-token-canary", "sk-upstream-canary", "wrong-token-canary"] {
        assert!(!log.contains(canary), "{canary} leaked into the log");
    }
}
