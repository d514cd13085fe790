//! Issue 4: the capacity wall made visible, admission for large contexts
//! (queueing, rejection, release on every path), route receipts and metrics.

use std::time::Duration;

use crate::common::*;
use futures_util::StreamExt;
use prefixgate::policy::Mode;
use serde_json::{json, Value};

/// The seed's cards: 122,636 KV tokens, time scaled way down.
fn seed_card() -> prefixgate::sim::SimConfig {
    prefixgate::sim::SimConfig { kv_tokens: 122_636, time_scale: 0.0005, ..fast_sim() }
}

#[actix_web::test]
async fn three_large_families_on_two_cards_raise_a_capacity_warning_whatever_the_policy() {
    for mode in [Mode::Shape, Mode::RoundRobin, Mode::Affinity] {
        let (a, b) = (start_sim("a", seed_card()).await, start_sim("b", seed_card()).await);
        let mut config = test_config(&[&a, &b]);
        config.policy = mode;
        for r in &mut config.replicas {
            r.kv_tokens = Some(122_636);
        }
        let gw = start_gateway(config).await;
        // Any two of these exceed one card; three families on two cards put two on one card.
        let contexts: Vec<String> = [62_000, 70_000, 78_000]
            .iter()
            .enumerate()
            .map(|(i, t)| text(&format!("family{i}-{mode:?}"), *t))
            .collect();
        let families = contexts.iter().map(|ctx| {
            let base = gw.base.clone();
            async move {
                let mut msgs = vec![("user".to_string(), ctx.clone())];
                for turn in 0..3 {
                    let view: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
                    let r = post(&format!("{base}/v1/chat/completions"), &chat_body(&view, json!({}))).await;
                    assert_eq!(r.status, 200, "{:?}", r.body);
                    msgs.push(("assistant".into(), format!("answer {turn}")));
                    msgs.push(("user".into(), format!("next question {turn}")));
                }
            }
        });
        futures_util::future::join_all(families).await;

        let (s, report) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
        assert_eq!(s, 200);
        assert_eq!(report["verdict"], "over_capacity", "{mode:?}: {report}");
        let warning = report["warning"].as_str().unwrap();
        assert!(
            warning.contains("Routing cannot fix this")
                && warning.contains("another card")
                && warning.contains("compaction")
        );
        assert_eq!(report["aggregate"]["families_active"], 3);
        let over: Vec<&Value> =
            report["replicas"].as_array().unwrap().iter().filter(|r| r["over_capacity"] == true).collect();
        assert!(!over.is_empty());
        // The replica's own metrics (7,664 blocks x 16) win over the declared 122,636.
        assert!(over.iter().all(|r| r["kv_tokens"] == 122_624 && r["kv_source"] == "metrics"), "{report}");
        assert!(over.iter().all(|r| r["working_set_tokens"].as_u64().unwrap() > 122_624));

        let metrics = scrape(&gw).await;
        assert!(
            metrics.lines().any(|l| l.starts_with("prefixgate_capacity_warning{") && l.ends_with(" 1")),
            "{mode:?}"
        );
        // The background evaluation (once a second) records the transition; the GET did not.
        wait_until("a capacity_warning event", Duration::from_secs(5), || {
            gw.gw.events.count(prefixgate::events::EventKind::CapacityWarning) >= 1
        })
        .await;
        gw.stop().await;
    }
}

#[actix_web::test]
async fn admission_queues_in_order_rejects_past_the_bounds_and_never_leaks_a_slot() {
    // Decode is slow so the first large stream holds its slot until we let go.
    let a = start_sim("a", slow_decoder(20.0)).await;
    let mut config = test_config(&[&a]);
    config.replicas[0].max_large_inflight = Some(1);
    config.admission.max_queue = 2;
    config.admission.wait_ms = 20_000;
    let gw = start_gateway(config).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let replica = gw.gw.fleet.get("a").unwrap();

    let mut first = client().post(&url).send_json(&large_stream("first", 200)).await.unwrap();
    assert_eq!(first.status(), 200);
    let _ = first.next().await.unwrap().unwrap();
    assert_eq!(gw.gw.fleet.get("a").unwrap().large_slots.in_use(), 1);

    // Two more wait in line; a third is over the queue bound.
    let (u2, u3) = (url.clone(), url.clone());
    let second = actix_web::rt::spawn(async move {
        client().post(&u2).send_json(&large_stream("second", 200)).await.map(|r| r.status().as_u16())
    });
    wait_until("second queued", Duration::from_secs(5), || gw.gw.fleet.get("a").unwrap().large_slots.queued() == 1)
        .await;
    let third = actix_web::rt::spawn(async move {
        client().post(&u3).send_json(&large_stream("third", 200)).await.map(|r| r.status().as_u16())
    });
    wait_until("third queued", Duration::from_secs(5), || gw.gw.fleet.get("a").unwrap().large_slots.queued() == 2)
        .await;
    let mut over = client().post(&url).send_json(&large_stream("over", 200)).await.unwrap();
    assert_eq!(over.status(), 503);
    assert!(over.headers().get("retry-after").is_some());
    let v: Value = over.json().await.unwrap();
    assert_eq!(v["error"]["code"], "admission_queue_full");

    // A waiting client gives up: it leaves the line.
    third.abort();
    let _ = third.await;
    wait_until("third left the queue", Duration::from_secs(5), || {
        gw.gw.fleet.get("a").unwrap().large_slots.queued() == 1
    })
    .await;

    // The first client disconnects mid-stream: its slot goes to the second.
    drop(first);
    assert_eq!(second.await.unwrap().unwrap(), 200);
    wait_until("everything released", Duration::from_secs(10), || {
        gw.gw.fleet.get("a").unwrap().large_slots.in_use() == 0
            && gw.gw.fleet.get("a").unwrap().large_slots.queued() == 0
            && replica.inflight() == 0
            && replica.large_inflight() == 0
    })
    .await;
    let metrics = scrape(&gw).await;
    assert!(metrics.contains("prefixgate_admission_waits_total{replica=\"a\"}"));
    assert!(metrics.contains("prefixgate_admission_rejections_total{replica=\"a\"} 1"));
    gw.stop().await;
}

#[actix_web::test]
async fn a_pinned_large_continuation_waits_for_its_own_replica_and_a_timeout_is_a_503() {
    let slow = slow_decoder(20.0);
    let (a, b) = (start_sim("a", slow.clone()).await, start_sim("b", slow).await);
    let mut config = test_config(&[&a, &b]);
    for r in &mut config.replicas {
        r.max_large_inflight = Some(1);
    }
    config.admission.wait_ms = 300;
    let gw = start_gateway(config).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let ctx = text("pinned-large", 40_000);
    let turn1 = post(&url, &chat_body(&[("user", &ctx)], json!({"max_tokens": 1}))).await;
    let home = turn1.replica.clone();

    // Occupy the home replica's only large slot (a spread pick prefers the free one, so retry until it lands home).
    let mut holder = None;
    for i in 0..4 {
        let resp = client().post(&url).send_json(&large_stream(&format!("holder {i}"), 200)).await.unwrap();
        if resp.headers().get("x-prefixgate-replica").unwrap() == home.as_str() {
            holder = Some(resp);
            break;
        }
        drop(resp);
        wait_until("released", Duration::from_secs(5), || {
            gw.gw.fleet.get("a").unwrap().large_slots.in_use() + gw.gw.fleet.get("b").unwrap().large_slots.in_use() == 0
        })
        .await;
    }
    let mut holder = holder.expect("a large request landed on the home replica");
    // Decoding (its first event read): a stream, not a prefill queued ahead
    // of the continuation (which would move it, `policy::moves`).
    holder.next().await.expect("a first chunk").unwrap();
    let turn2 =
        post(&url, &chat_body(&[("user", &ctx), ("assistant", "x"), ("user", "more")], json!({"max_tokens": 1}))).await;
    assert_eq!(turn2.status, 503, "the continuation waited for its own replica, not the free one");
    assert_eq!(turn2.body["error"]["code"], "admission_queue_full");
    drop(holder);
    wait_until("released", Duration::from_secs(5), || gw.gw.fleet.get(&home).unwrap().large_slots.in_use() == 0).await;
    let turn3 =
        post(&url, &chat_body(&[("user", &ctx), ("assistant", "x"), ("user", "more")], json!({"max_tokens": 1}))).await;
    assert_eq!((turn3.status, turn3.route.as_str(), turn3.replica.as_str()), (200, "pinned", home.as_str()));
    gw.stop().await;
}

#[actix_web::test]
async fn every_documented_metric_is_exposed_with_sane_values_and_receipts_join_usage() {
    let (a, b) = (start_sim("a", seed_card()).await, start_sim("b", seed_card()).await);
    let mut config = test_config(&[&a, &b]);
    config.health.interval_ms = 3_600_000;
    config.replicas[0].max_large_inflight = Some(4);
    // A discovery source (listing nothing more) has its series too.
    let dir = tempfile::tempdir().unwrap();
    let more = dir.path().join("more.toml");
    std::fs::write(&more, "").unwrap();
    config.discovery = vec![prefixgate::config::SourceConfig::new(&format!("file://{}", more.display()))];
    let gw = start_gateway(config).await;
    let ctx = text("receipts", 5_000);
    let mut msgs = vec![("user".to_string(), ctx)];
    for turn in 0..4 {
        let view: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        assert_eq!(chat(&gw, &view).await.status, 200);
        msgs.push(("assistant".into(), format!("a{turn}")));
        msgs.push(("user".into(), format!("q{turn}")));
    }
    for i in 0..4 {
        chat(&gw, &[("user", &format!("one-shot {i}"))]).await;
    }
    // A streamed request with usage requested, and one without (unmeasured).
    for include in [true, false] {
        let body =
            chat_body(&[("user", "stream")], json!({"stream": true, "stream_options": {"include_usage": include}}));
        let mut resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
        let _ = resp.body().await.unwrap();
    }
    assert_eq!(post(&format!("{}/v1/chat/completions", gw.base), &json!({"model": "sim-model", "messages": [{"role": "user", "content": text("big", 40_000)}], "max_tokens": 1})).await.status, 200);
    b.stop(true).await;
    for i in 0..2 {
        assert_eq!(chat(&gw, &[("user", &format!("after stop {i}"))]).await.status, 200);
    }
    assert_eq!(
        client().post(format!("{}/v1/chat/completions", gw.base)).send_body("nope").await.unwrap().status(),
        400
    );

    let metrics = scrape(&gw).await;
    let names = gw.gw.metrics.exposed_names();
    for name in &names {
        let exposed = metrics.lines().any(|l| {
            l.starts_with(&format!("{name}{{"))
                || l.starts_with(&format!("{name} "))
                || l.starts_with(&format!("{name}_bucket{{"))
        });
        assert!(exposed, "{name} has no sample in\n{metrics}");
    }
    let sample = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(sample("prefixgate_requests_total{"), 4.0 + 4.0 + 2.0 + 1.0 + 2.0, "every proxied request counted once");
    assert!(sample("prefixgate_pin_lookups_total{result=\"hit\"}") >= 3.0);
    assert_eq!(sample("prefixgate_inflight_requests{"), 0.0);
    assert_eq!(sample("prefixgate_kv_capacity_tokens{replica=\"a\"}"), 122_624.0, "read from the sim's vLLM metrics");
    assert!(sample("prefixgate_failovers_total{from=\"b\"") >= 1.0);
    assert!(sample("prefixgate_failovers_total{from=\"b\",to=\"a\"}") >= 1.0, "failovers carry where they went");
    assert_eq!(sample("prefixgate_replica_up{replica=\"b\"}"), 0.0);
    assert_eq!(sample("prefixgate_usage_measured_total{result=\"unmeasured\"}"), 1.0);
    let bpt = sample("prefixgate_bytes_per_token{replica=\"a\"}");
    assert!(bpt > 2.0 && bpt < 6.0, "calibrated ratio {bpt}");
    // Route receipts: pinned turns were served from cache, spread ones were not.
    let pinned_cached = sample("prefixgate_cached_tokens_total{replica=\"a\",route=\"pinned\"}")
        + sample("prefixgate_cached_tokens_total{replica=\"b\",route=\"pinned\"}");
    let pinned_prompt = sample("prefixgate_prompt_tokens_total{replica=\"a\",route=\"pinned\"}")
        + sample("prefixgate_prompt_tokens_total{replica=\"b\",route=\"pinned\"}");
    assert!(pinned_cached / pinned_prompt > 0.9, "pinned turns {pinned_cached}/{pinned_prompt} cached");

    // docs/observability.md lists exactly the metrics the code exposes.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/observability.md")).unwrap();
    let section = readme.split("<!-- metrics:start -->").nth(1).unwrap().split("<!-- metrics:end -->").next().unwrap();
    let listed: Vec<&str> =
        section.lines().filter_map(|l| l.strip_prefix("- `")).map(|l| l.split(['{', '`']).next().unwrap()).collect();
    assert_eq!(listed, names, "docs/observability.md's metrics list and the code differ");
    gw.stop().await;
}

/// The simulator's host tier (`--host-cache-tokens`): what the pool
/// evicted comes back restored, reported cached, as llama-server's
/// `--cache-ram` and vLLM's CPU offload do; without the tier it is
/// prefilled again.
#[actix_web::test]
async fn a_prompt_evicted_from_the_pool_is_restored_from_the_host_tier_and_reported_cached() {
    let card = |host_cache_tokens| prefixgate::sim::SimConfig { kv_tokens: 4_000, host_cache_tokens, ..fast_sim() };
    let cached = |r: &Reply| r.body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    for (host, restored) in [(0, false), (2_000_000, true)] {
        let sim = start_sim("a", card(host)).await;
        let url = format!("{}/v1/chat/completions", sim.url);
        let (a, b) = (text("family a", 3_000), text("family b", 3_000));
        let first = post(&url, &chat_body(&[("user", &a)], json!({}))).await;
        post(&url, &chat_body(&[("user", &b)], json!({}))).await; // evicts most of a
        let again = post(&url, &chat_body(&[("user", &a)], json!({}))).await;
        let prompt = again.body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(cached(&first), 0);
        match restored {
            true => assert!(cached(&again) + 16 >= prompt, "restored whole: {} of {prompt}", cached(&again)),
            false => assert!(cached(&again) < prompt / 2, "prefilled again: {} of {prompt}", cached(&again)),
        }
    }
}

/// The engine's prefill rate (shown, and the bound of a pause) leaves the
/// queue out: a cold prompt sent alone measures the card, and three sent
/// together to a card that prefills one at a time do not drag it down
/// with the waits behind the first. Timed from their sends, their waits
/// made the card look 0.6x as fast here; on a one-slot llama-server,
/// several times slower, and pauses that long.
#[actix_web::test]
async fn the_prefill_rate_shown_is_the_engines_not_its_queue() {
    // 4,100 tokens a simulated second, at 0.05 of real time: 82,000 a second.
    let card = prefixgate::sim::SimConfig { time_scale: 0.05, ..fast_sim() };
    let engine_rate = card.prefill_tps / card.time_scale;
    let sim = start_sim("a", card).await;
    let gw = start_gateway(test_config(&[&sim])).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let cold = |tag: String| {
        let options = json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 2});
        let body = chat_body(&[("user", &text(&tag, 8_000))], options);
        let url = url.clone();
        async move {
            let reply = post(&url, &body).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
        }
    };
    let measured = || async {
        let (_, report) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
        report["replicas"][0]["prefill_tokens_per_s"].as_f64().unwrap_or_else(|| panic!("not measured: {report}"))
    };
    let near = |rate: f64| rate > 0.8 * engine_rate && rate < 1.25 * engine_rate;
    cold("alone".into()).await;
    let alone = measured().await;
    assert!(near(alone), "alone: {alone:.0} tokens/s against the engine's {engine_rate:.0}");
    futures_util::future::join_all((0..3).map(|i| cold(format!("together {i}")))).await;
    let after = measured().await;
    assert!(near(after), "after three together: {after:.0} tokens/s against the engine's {engine_rate:.0}");
}
