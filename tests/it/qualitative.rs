//! The seed's qualitative claims, scaled down, measured in *simulated* time
//! (the replicas' own prefill accounting), so a loaded CI machine cannot
//! make them flaky: shape routing is within 10% of affinity on warm turns
//! and within 10% of round-robin on a cold burst, and each baseline loses
//! on the other workload.

use crate::common::*;
use prefixgate::policy::Mode;
use serde_json::json;

fn sim_prefill_ms(r: &Reply) -> f64 {
    r.headers.get("x-sim-prefill-ms").unwrap().to_str().unwrap().parse().unwrap()
}

async fn gateway(mode: Mode, time_scale: f64) -> (Gw, Sim, Sim) {
    let card = prefixgate::sim::SimConfig { kv_tokens: 122_636, time_scale, ..fast_sim() };
    let (a, b) = (start_sim("a", card.clone()).await, start_sim("b", card).await);
    let mut config = test_config(&[&a, &b]);
    config.policy = mode;
    (start_gateway(config).await, a, b)
}

/// Mean simulated prefill of warm turns: two families, growing contexts.
async fn warm_turns(mode: Mode) -> f64 {
    let (gw, _a, _b) = gateway(mode, 0.0002).await;
    let mut warm = Vec::new();
    for f in 0..2 {
        let mut msgs = vec![("user".to_string(), text(&format!("{mode:?} family {f}"), 30_000))];
        for turn in 0..5 {
            let view: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
            let r = chat(&gw, &view).await;
            assert_eq!(r.status, 200);
            if turn > 0 {
                warm.push(sim_prefill_ms(&r));
            }
            msgs.push(("assistant".into(), format!("answer {turn}")));
            msgs.push(("user".into(), text(&format!("{mode:?} f{f} t{turn}"), 300)));
        }
    }
    gw.stop().await;
    warm.iter().sum::<f64>() / warm.len() as f64
}

/// Simulated makespan of a burst: the busiest replica's total prefill (one
/// prefill at a time per card). 16 requests sharing a system prompt.
///
/// Each prefill takes ~40 ms of real time, so the burst's requests are in
/// flight together, as a burst is: placed by load, a replica's outstanding
/// work is what spreads them. At a scale where each is answered before the
/// next arrives, every replica is idle at every choice and the shared
/// prompt's holder rightly takes them (a warm prefix, nobody waiting).
async fn burst(mode: Mode) -> f64 {
    let (gw, _a, _b) = gateway(mode, 0.02).await;
    let system = text(&format!("{mode:?} shared system prompt"), 500);
    let url = format!("{}/v1/chat/completions", gw.base);
    let all = (0..16).map(|i| {
        let body = chat_body(&[("system", &system), ("user", &text(&format!("{mode:?} task {i}"), 8_000))], json!({}));
        let url = url.clone();
        async move { post(&url, &body).await }
    });
    let replies = futures_util::future::join_all(all).await;
    let mut per_replica = std::collections::HashMap::<String, f64>::new();
    for r in &replies {
        assert_eq!(r.status, 200);
        *per_replica.entry(r.replica.clone()).or_default() += sim_prefill_ms(r);
    }
    gw.stop().await;
    per_replica.values().copied().fold(0.0, f64::max)
}

#[actix_web::test]
async fn shape_gets_warm_turns_like_affinity_and_bursts_like_roundrobin() {
    let (shape_warm, affinity_warm, rr_warm) =
        (warm_turns(Mode::Shape).await, warm_turns(Mode::Affinity).await, warm_turns(Mode::RoundRobin).await);
    let (shape_burst, affinity_burst, rr_burst) =
        (burst(Mode::Shape).await, burst(Mode::Affinity).await, burst(Mode::RoundRobin).await);
    eprintln!("warm turns (simulated ms): shape {shape_warm:.0}, affinity {affinity_warm:.0}, roundrobin {rr_warm:.0}");
    eprintln!(
        "burst makespan (simulated ms): shape {shape_burst:.0}, affinity {affinity_burst:.0}, roundrobin {rr_burst:.0}"
    );
    assert!(shape_warm <= affinity_warm * 1.10, "shape warm turns within 10% of affinity");
    assert!(shape_burst <= rr_burst * 1.10, "shape burst within 10% of round-robin");
    assert!(rr_warm > shape_warm * 2.0, "round-robin loses the cache on warm turns");
    assert!(affinity_burst > shape_burst * 1.5, "affinity loses a card on the burst");
}
