//! The fleet over time (`GET /admin/v1/timeline`) and the sessions view
//! (`GET /admin/v1/sessions`), after streamed agent loops on two simulated
//! replicas; the sampling interval shortened so that seconds of traffic
//! give as many samples as minutes would.

use std::time::Duration;

use crate::common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// Streamed turns of one agent (its context growing) until `until`.
async fn agent(gw_base: String, family: usize, key: &'static str, until: tokio::time::Instant) {
    let mut messages = vec![json!({"role": "system", "content": text("a shared system prompt", 300)})];
    let mut turn = 0;
    while tokio::time::Instant::now() < until {
        messages.push(json!({"role": "user", "content": text(&format!("family {family} turn {turn}"), 200)}));
        let body = json!({"model": "sim-model", "messages": messages, "stream": true, "max_tokens": 8,
                          "stream_options": {"include_usage": true}});
        let mut resp = client()
            .post(format!("{gw_base}/v1/chat/completions"))
            .insert_header(("authorization", format!("Bearer {key}")))
            .insert_header(("x-prefixgate-priority", "background"))
            .send_json(&body)
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        while let Some(chunk) = resp.next().await {
            chunk.unwrap();
        }
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
        turn += 1;
    }
}

fn points(series: &Value) -> usize {
    series.as_array().unwrap().iter().filter(|v| !v.is_null()).count()
}

#[actix_web::test]
async fn after_agent_loops_the_timeline_has_every_series_per_replica_and_the_sessions_view_lists_them() {
    let mut sim = fast_sim();
    sim.time_scale = 0.01; // turns of a few ms: streams with a first token to time
    let (a, b) = (start_sim("a", sim.clone()).await, start_sim("b", sim).await);
    let mut config = test_config(&[&a, &b]);
    config.timeline.interval_ms = 100;
    config.api_keys = vec!["sk-agents".into()];
    let gw = start_gateway(config).await;
    let until = tokio::time::Instant::now() + Duration::from_millis(2_500);
    let agents: Vec<_> = (0..4).map(|f| actix_web::rt::spawn(agent(gw.base.clone(), f, "sk-agents", until))).collect();
    // While they run: the sessions view lists them, with class and client.
    let key = prefixgate::client_ids::key_id("sk-agents");
    let mut listed = Value::Null;
    for _ in 0..200 {
        let (status, v) = admin("GET", &format!("{}/admin/v1/sessions", gw.admin), None, None).await;
        assert_eq!(status, 200);
        if v.as_array().unwrap().len() >= 4 {
            listed = v;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sessions = listed.as_array().expect("four resident sessions listed");
    for s in sessions {
        assert_eq!((s["class"].as_str(), s["client"].as_str()), (Some("background"), Some(key.as_str())), "{s}");
        assert!(["running", "idle"].contains(&s["state"].as_str().unwrap()), "{s}");
        assert!(s["replica"].is_string() && s["context_tokens"].as_u64().unwrap() > 300, "{s}");
        assert_eq!(s["session"].as_str().unwrap().len(), 32);
    }
    for a in agents {
        a.await.unwrap();
    }

    let (status, v) = admin("GET", &format!("{}/admin/v1/timeline?window_s=300", gw.admin), None, None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["instance"], "this");
    assert!(v["at"].as_array().unwrap().len() >= 10, "{v}");
    let replicas = v["replicas"].as_array().unwrap();
    assert_eq!(replicas.iter().map(|r| r["replica"].as_str().unwrap()).collect::<Vec<_>>(), ["a", "b"]);
    for r in replicas {
        for series in ["resident_tokens", "capacity_tokens", "warm_share", "ttft_p50_ms", "ttft_p90_ms", "inflight"] {
            assert!(points(&r[series]) >= 10, "{}: {series} has {} points: {}", r["replica"], points(&r[series]), r);
        }
        let warm: Vec<f64> = r["warm_share"].as_array().unwrap().iter().filter_map(Value::as_f64).collect();
        assert!(warm.iter().any(|w| *w > 0.5), "pinned turns are warm: {warm:?}");
        let resident = r["resident_tokens"].as_array().unwrap().iter().filter_map(Value::as_u64).max().unwrap();
        assert!(resident > 300, "sessions were resident: {resident}");
        assert_eq!(r["capacity_tokens"].as_array().unwrap().iter().find_map(Value::as_u64), Some(122_624));
    }
    // A window is what it says, and bad input is the one error shape.
    let (_, short) = admin("GET", &format!("{}/admin/v1/timeline?window_s=1", gw.admin), None, None).await;
    assert!(short["at"].as_array().unwrap().len() < v["at"].as_array().unwrap().len());
    let (status, bad) = admin("GET", &format!("{}/admin/v1/timeline?window_s=0", gw.admin), None, None).await;
    assert_eq!(status, 400);
    assert!(bad["error"]["message"].as_str().unwrap().contains("window_s"));
    gw.stop().await;
}
