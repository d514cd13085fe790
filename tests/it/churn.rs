//! Issue 25: a gateway lives for months through replica churn. Pods come
//! back under new names; each name a replica ever had must leave with it:
//! pins and interned names, metric series, calibration, capacity state.

use crate::common::*;
use serde_json::json;

/// What the gateway keeps per replica name, summed.
fn kept(gw: &Gw) -> [usize; 4] {
    let g = &gw.gw;
    [g.pins.interned(), g.metrics.replica_names_exposed(), g.fleet.records_alive(), g.sessions.len()]
}

#[actix_web::test]
async fn thousands_of_names_churned_through_the_admin_api_leave_nothing_behind() {
    let sim = start_sim("engine", fast_sim()).await;
    let mut config = test_config(&[]);
    config.rate_limits.admin_rps = 0;
    let gw = start_gateway(config).await;
    let replicas = format!("{}/admin/v1/replicas", gw.admin);
    let metrics_lines = || async {
        let mut resp = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
        let text = String::from_utf8(resp.body().limit(64 << 20).await.unwrap().to_vec()).unwrap();
        text.lines()
            .filter(|l| l.contains("replica=\"") || l.contains("from=\""))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let mut previous: Option<String> = None;
    let mut at_100 = None;
    for i in 0..2_000 {
        let name = format!("pod-{i}");
        let (s, v) = admin("POST", &replicas, None, Some(json!({"id": name, "url": sim.url}))).await;
        assert_eq!(s, 201, "{v}");
        if let Some(old) = previous.take() {
            let (s, _) = admin("DELETE", &format!("{replicas}/{old}"), None, None).await;
            assert_eq!(s, 204);
        }
        // One family, two turns: pins, the working set, calibration, series.
        let first = chat(&gw, &[("system", &text("sys", 300)), ("user", &format!("task {i}"))]).await;
        assert_eq!((first.status, first.replica.as_str()), (200, name.as_str()));
        let second = chat(
            &gw,
            &[("system", &text("sys", 300)), ("user", &format!("task {i}")), ("assistant", "ok"), ("user", "more")],
        )
        .await;
        assert_eq!((second.status, second.route.as_str()), (200, "pinned"));
        if i == 100 {
            at_100 = Some(kept(&gw));
        }
        previous = Some(name);
    }
    let last = previous.unwrap();
    // A scrape shows the one replica that exists, whatever came before.
    let lines = metrics_lines().await;
    assert!(!lines.is_empty());
    assert!(
        lines.iter().all(|l| l.contains(&format!("\"{last}\"")) || l.contains("\"_aggregate\"")),
        "series of removed replicas: {:?}",
        lines.iter().find(|l| !l.contains(&last))
    );
    // Per-name state is what the live replica (and at most the one just
    // removed) needs; the exposition names the live replica and
    // `_aggregate` (the capacity warning's) once scraped: after 2,000 names no more than
    // after 100. Exact counts move with timing (a scrape's sweep, the
    // capacity evaluation each second), so each is bounded, not matched.
    let now = kept(&gw);
    let before = at_100.unwrap();
    let names = "[interned names, replica names in the metrics exposition, replica records alive (calibration, admission slots, \
                 capacity state, resident sessions), sessions indexed]";
    // Sessions whose replica left go at the next sweep (every 200 ms): what
    // is indexed is what the last few hundred ms served (about 20 here).
    // Records of removed replicas live while something in flight holds them
    // (a probe round holds the fleet it started with): a few, never more.
    for (i, bound) in [2, 3, 4, 100].into_iter().enumerate() {
        assert!(now[i] <= bound && before[i] <= bound, "{names}: after 100 {before:?}, after 2,000 {now:?}");
    }
    assert_eq!(gw.gw.fleet.snapshot().len(), 1);
    let (s, _) = admin("GET", &format!("{}/healthz", gw.base), None, None).await;
    assert_eq!(s, 200);
    gw.stop().await;
}

/// A keyed engine refuses unkeyed calls, health and models included; the
/// prober sends the replica's key, so it is up, its models are learned and
/// its KV capacity read.
#[actix_web::test]
async fn a_keyed_replica_is_probed_with_its_key() {
    // A small pool: the session below nearly fills it, where its turns are counted.
    let cfg = prefixgate::sim::SimConfig {
        api_key: Some("sk-engine".into()),
        model: "keyed-model".into(),
        kv_tokens: 1_024,
        ..fast_sim()
    };
    let sim = start_sim("keyed", cfg).await;
    let (unkeyed, _) = admin("GET", &format!("{}/v1/models", sim.url), None, None).await;
    assert_eq!(unkeyed, 401, "the engine refuses unkeyed calls");
    let mut config = test_config(&[&sim]);
    config.replicas[0].api_key = Some("sk-engine".into());
    config.sessions.max_wait_ms = 10_000; // the hold on, at the declared wall: sessions' turns are counted
    config.sessions.wall = prefixgate::sessions::WallAt::Declared;
    let gw = start_gateway(config).await;
    let r = gw.gw.fleet.get("keyed").unwrap();
    assert_eq!(r.health(), prefixgate::fleet::Health::Up);
    wait_until("models learned", std::time::Duration::from_secs(5), || !r.models().is_empty()).await;
    assert_eq!(**r.models(), vec!["keyed-model".to_string()]);
    assert_eq!(r.observed_kv(), Some(1_024), "the KV capacity read from its metrics");
    let body = json!({"model": "keyed-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let reply = post(&format!("{}/v1/chat/completions", gw.base), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // A session's turn is counted by the engine with the same key.
    let messages =
        json!([{"role": "system", "content": text("you are terse", 950)}, {"role": "user", "content": "hi"}]);
    let body = json!({"model": "keyed-model", "max_tokens": 4, "messages": messages});
    let reply = post(&format!("{}/v1/chat/completions", gw.base), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(sim.state.tokenize_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(r.calibration.engine_counts(u64::MAX), "the count was answered, not refused");
    // A stored response the gateway never saw is looked for on the replica
    // with the replica's key, as the request itself would carry it.
    let stored = json!({"model": "keyed-model", "input": "stored elsewhere", "max_output_tokens": 4});
    let direct =
        post_with(&format!("{}/v1/responses", sim.url), &stored, &[("authorization", "Bearer sk-engine")]).await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    let follow = json!({"model": "keyed-model", "input": "again", "previous_response_id": direct.body["id"], "max_output_tokens": 4});
    let reply = post(&format!("{}/v1/responses", gw.base), &follow).await;
    assert_eq!((reply.status, reply.route.as_str()), (200, "response"), "located with the key: {}", reply.body);
    gw.stop().await;
}
